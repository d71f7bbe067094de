"""The daemon's HTTP routes (served by `daemon/http_server.py`).

GET /metrics            Prometheus text of the latest snapshot (gzipped when asked)
GET /api/v1/query       ?metric=NAME&window=60s&labels=k=v,k=v[&at=UNIX]  -> stats per
                        series, as of the newest cycle at or before `at` (default: now)
GET /api/v1/metrics     the friendly names
GET /api/v1/status      collectors (up/down, reason) and engines
GET /api/v1/alerts      pending and firing alerts, the rules' series that cannot be
                        evaluated yet and why (?history=1: the latest transitions;
                        ?explain=1: each alert with its explanation, why: the change
                        split into parts and causes)
GET /healthz            liveness (no token needed)
POST /-/reload          reload the alerting file and the token file (daemon/reload.py):
                        from this host, or with the bearer token
A bearer token, or the web-config file's basic-auth users, when configured, guard
everything but /healthz and a reload from this host; either credential admits
(`daemon/credentials.py`; RFC 6750: the scheme is case-insensitive; the token is compared
as bytes, in constant time). Refusals are counted (ac_http_refused_total).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from urllib.parse import parse_qs

from ac_observe.daemon.config import is_loopback
from ac_observe.daemon.credentials import Credentials, Verdict
from ac_observe.daemon.http_server import HttpServer, Refusals, Request, Response
from ac_observe.daemon.query import describe_friendly, parse_labels
from ac_observe.daemon.reload import ConfigReloader, ReloadFailed
from ac_observe.daemon.service import Daemon, HistoryUnavailable, WindowTooLong
from ac_observe.daemon.store import StoreUnavailable
from ac_observe.daemon.tls import WebSettings, WebSnapshot
from ac_observe.durations import parse_duration, parse_instant
from ac_observe.friendly import FRIENDLY, query_labels

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ALLOWED_METHODS = "GET, HEAD"


def metrics_response(body: bytes, gzipped: bool) -> Response:
    headers = {"Vary": "Accept-Encoding"}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return Response(200, body, PROMETHEUS_CONTENT_TYPE, headers)


def accepts_gzip(request: Request) -> bool:
    """Whether Accept-Encoding lists gzip (Prometheus sends `gzip`), not at q=0."""
    for part in request.headers.get("accept-encoding", "").split(","):
        coding, *params = part.split(";")
        if coding.strip().lower() != "gzip":
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def json_response(status: int, body, headers: dict | None = None) -> Response:
    """JSON with no NaN or Infinity (not JSON): non-finite numbers become null."""
    return Response(status, json.dumps(_finite(body), allow_nan=False).encode(),
                    headers=headers or {})


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Routes:
    """The daemon's routes as one handler: called on the handlers' pool, and `inline` on
    the event loop for what is answered at once (see HttpServer)."""

    def __init__(self, daemon: Daemon, token: str | None,
                 reloader: ConfigReloader | None = None, web: WebSettings | None = None,
                 refusals: Refusals | None = None):
        self.daemon = daemon
        self.credentials = Credentials(token)
        self.web = web
        self.refusals = refusals if refusals is not None else Refusals()
        self.reloader = reloader
        if reloader is not None:
            reloader.on_token = self.set_token
        self.routes: dict[str, Callable[[Request, dict], Response]] = {
            # path -> (request, its query parameters) -> Response
            "/metrics": lambda request, params: self.metrics(request),
            "/api/v1/query": lambda request, params: self.query(params),
            "/api/v1/metrics": lambda request, params: json_response(
                200, {"metrics": describe_friendly()}),
            "/api/v1/status": lambda request, params: json_response(200, daemon.status()),
            "/api/v1/alerts": lambda request, params: self.alerts(params),
        }

    def set_token(self, token: str) -> None:
        self.credentials.set_token(token)

    def _web(self) -> WebSnapshot | None:
        return self.web.current() if self.web is not None else None

    def reload(self, request: Request) -> Response:
        """POST /-/reload: from this host (a sidecar, systemd's ExecReload, an operator's
        curl) or with the token; 200 with what is loaded, 400 with why not."""
        if request.method != "POST":
            return json_response(405, {"error": "POST to reload"}, {"Allow": "POST"})
        if request.headers.get("origin"):  # a browser's cross-site POST needs no preflight
            return json_response(403, {"error": "a reload is not taken from a web page"})
        web = self._web()
        basic = web.basic if web is not None else None
        if not is_loopback(request.peer) and not (
                self.credentials.configured(basic) and self.authorized(request, web)):
            self._count_refusal(request)
            return json_response(401, {"error": "a reload comes from this host or carries "
                                                "the bearer token or a basic-auth user's "
                                                "password"},
                                 {"WWW-Authenticate": self.credentials.challenge(basic)})
        if self.reloader is None:
            return json_response(404, {"error": "this daemon does not reload"})
        try:
            return json_response(200, {"status": "reloaded", **self.reloader.reload()})
        except ReloadFailed as exc:
            return json_response(400, {"error": f"reload failed, the previous configuration "
                                                f"stays: {exc}"})

    def authorized(self, request: Request, web: WebSnapshot | None) -> bool:
        """No credential is configured, or the request carries one that matches."""
        return self.credentials.verdict(request.headers.get("authorization"),
                                        web.basic if web is not None else None
                                        ) is Verdict.ADMIT

    def _count_refusal(self, request: Request) -> None:
        self.refusals.count("missing_credentials" if not request.headers.get("authorization")
                            else "bad_credentials")

    def query(self, params: dict) -> Response:
        metric = (params.get("metric") or [""])[0]
        if metric not in FRIENDLY:
            return json_response(400, {"error": f"unknown metric {metric[:100]!r}",
                                       "known": sorted(FRIENDLY)})
        try:
            window = parse_duration((params.get("window") or ["60s"])[0])
            labels = parse_labels((params.get("labels") or [""])[0],
                                  query_labels(FRIENDLY[metric]))
            at = parse_instant((params.get("at") or [""])[0])
        except ValueError as exc:
            return json_response(400, {"error": str(exc)})
        try:
            return json_response(200, self.daemon.query(metric, window, labels, now=at))
        except WindowTooLong as exc:
            return json_response(400, {"error": str(exc)})
        except HistoryUnavailable as exc:
            return json_response(503, {"error": str(exc)})

    def alerts(self, params: dict) -> Response:
        alerts = self.daemon.alerts
        if alerts is None:
            return json_response(200, {"alerts": [], "history": [], "rules": 0,
                                       "waiting": []})
        history, explain = ((params.get(key) or ["0"])[0] not in ("", "0", "false")
                            for key in ("history", "explain"))
        # An explanation reads many series: worked out only when asked for.
        return json_response(200, {"alerts": alerts.explained() if explain else alerts.active(),
                                   "rules": len(alerts.rules),
                                   "waiting": alerts.waiting(),
                                   "history": alerts.history() if history else []})

    def metrics(self, request: Request) -> Response:
        gzipped = accepts_gzip(request)
        return metrics_response(self.daemon.render_metrics_gzip() if gzipped
                                else self.daemon.render_metrics(), gzipped)

    def inline(self, request: Request) -> Response | None:
        """On the event loop: a plain scrape of /metrics whose render is made already is
        answered at once (50 scrapers need no 50 thread hops); anything else, None."""
        if request.path != "/metrics" or request.method not in ("GET", "HEAD") or \
                request.query:
            return None
        web = self._web()
        verdict = self.credentials.verdict(request.headers.get("authorization"),
                                           web.basic if web is not None else None,
                                           may_hash=False)
        if verdict is not Verdict.ADMIT:  # refusals are the pool's to answer and count
            return None
        gzipped = accepts_gzip(request)
        body = self.daemon.rendered_metrics(gzipped)
        return None if body is None else self._with_headers(metrics_response(body, gzipped),
                                                            web)

    def _with_headers(self, response: Response, web: WebSnapshot | None) -> Response:
        """The web-config file's http_server_config.headers on every answer."""
        if web is not None and web.headers:
            response.headers.update(web.headers)
        return response

    def __call__(self, request: Request) -> Response:
        web = self._web()
        return self._with_headers(self._answer(request, web), web)

    def _answer(self, request: Request, web: WebSnapshot | None) -> Response:
        if request.path == "/-/reload":
            return self.reload(request)
        if request.method not in ("GET", "HEAD"):
            return json_response(405, {"error": f"method {request.method[:20]} not allowed"},
                                 {"Allow": ALLOWED_METHODS})
        if request.path == "/healthz":
            return json_response(200, {"status": "ok"})
        if not self.authorized(request, web):
            basic = web.basic if web is not None else None
            self._count_refusal(request)
            return json_response(401, {"error": "missing or wrong credentials (bearer token"
                                                + (" or basic auth" if basic else "") + ")"},
                                 {"WWW-Authenticate": self.credentials.challenge(basic)})
        route = self.routes.get(request.path)
        if route is None:
            return json_response(404, {"error": f"no route {request.path[:200]}"})
        try:
            params = parse_qs(request.query, max_num_fields=20)
        except ValueError:
            return json_response(400, {"error": "too many query parameters"})
        try:
            return route(request, params)
        except StoreUnavailable as exc:  # an outage, not a bug: say which
            return json_response(503, {"error": f"the daemon's store is unreachable: {exc}"})


def make_handler(daemon: Daemon, token: str | None,
                 reloader: ConfigReloader | None = None, web: WebSettings | None = None,
                 refusals: Refusals | None = None) -> Routes:
    return Routes(daemon, token, reloader, web, refusals)


def make_server(daemon: Daemon, host: str, port: int, token: str | None,
                max_requests: int = 40, reloader: ConfigReloader | None = None,
                web: WebSettings | None = None) -> HttpServer:
    """The daemon's server; with a web-config file that sets TLS, every connection is
    TLS with the context in force when it opens. Refusals are counted in the daemon's
    `http_refusals`, which its cycle exports."""
    refusals = daemon.http_refusals

    def tls_in_force():
        assert web is not None
        snapshot = web.current()
        assert snapshot.context is not None  # TLS stays on until a restart
        return snapshot.context, snapshot.allowed_sans
    return HttpServer(make_handler(daemon, token, reloader, web, refusals), host, port,
                      max_requests=max_requests,
                      tls=tls_in_force if web is not None and web.tls else None,
                      refusals=refusals)
