"""The daemon's HTTP endpoints (stdlib server: the daemon installs without a web stack).

GET /metrics            Prometheus text of the latest snapshot
GET /api/v1/query       ?metric=NAME&window=60s&labels=k=v,k=v  -> stats per series
GET /api/v1/metrics     the friendly names
GET /api/v1/status      collectors (up/down, reason) and engines
GET /healthz            liveness (no token needed)
A bearer token, when configured, guards everything but /healthz.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from ac_observe.daemon.query import describe_friendly, parse_duration, parse_labels
from ac_observe.metrics import FRIENDLY
from ac_observe.daemon.service import Daemon

log = logging.getLogger("ac_observe.daemon.http")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def make_handler(daemon: Daemon, token: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "ac-observe"
        disable_nagle_algorithm = True  # headers and body leave at once: no 40 ms ACK stall

        def log_message(self, fmt, *args):  # access logs stay at debug level
            log.debug("%s %s", self.address_string(), fmt % args)

        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/healthz":
                return self._json(200, {"status": "ok"})
            if token and not self._authorized():
                return self._json(401, {"error": "missing or wrong bearer token"},
                                  {"WWW-Authenticate": "Bearer"})
            try:
                if url.path == "/metrics":
                    return self._send(200, daemon.render_metrics(), PROMETHEUS_CONTENT_TYPE)
                if url.path == "/api/v1/query":
                    return self._query(parse_qs(url.query))
                if url.path == "/api/v1/metrics":
                    return self._json(200, {"metrics": describe_friendly()})
                if url.path == "/api/v1/status":
                    return self._json(200, daemon.status())
            except Exception:
                log.exception("request %s failed", url.path)
                return self._json(500, {"error": "internal error"})
            return self._json(404, {"error": f"no route {url.path}"})

        def _query(self, params):
            metric = (params.get("metric") or [""])[0]
            if metric not in FRIENDLY:
                return self._json(400, {"error": f"unknown metric {metric!r}",
                                        "known": sorted(FRIENDLY)})
            try:
                window = parse_duration((params.get("window") or ["60s"])[0])
                labels = parse_labels((params.get("labels") or [""])[0])
            except ValueError as exc:
                return self._json(400, {"error": str(exc)})
            return self._json(200, daemon.query(metric, window, labels))

        def _authorized(self) -> bool:
            header = self.headers.get("Authorization", "")
            return header.startswith("Bearer ") and hmac.compare_digest(
                header[7:].encode(), token.encode())

        def _json(self, status, body, headers=None):
            self._send(status, json.dumps(body).encode(), "application/json", headers)

        def _send(self, status, payload: bytes, content_type: str, headers=None):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)

    return Handler


class DaemonServer:
    def __init__(self, daemon: Daemon, host: str, port: int, token: str | None):
        self.httpd = ThreadingHTTPServer((host, port), make_handler(daemon, token))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ac-daemon-http",
                                        daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
