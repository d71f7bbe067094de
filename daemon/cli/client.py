"""The CLI's client of the daemon's HTTP API: a route's JSON body, or one line saying why
not and what to do, with the exit code it stands for. An https:// daemon is checked
against --cacert (else the system's CAs), and given --cert/--key when it asks for a
client certificate."""
from __future__ import annotations

import ssl
from pathlib import Path

import httpx

from ac_observe.daemon.cli.app import EXIT_REFUSED, EXIT_UNREACHABLE


class DaemonError(RuntimeError):
    """The daemon cannot answer: one line saying why and what to do."""
    exit_code = EXIT_REFUSED


class DaemonUnreachable(DaemonError):
    exit_code = EXIT_UNREACHABLE


def client_tls(cacert: Path | None, cert: Path | None,
               key: Path | None) -> ssl.SSLContext | None:
    """The TLS context for an https:// daemon (None: the system's CAs, no client
    certificate); ValueError (a usage error) naming a file that does not load."""
    if cacert is None and cert is None and key is None:
        return None
    if key is not None and cert is None:
        raise ValueError("--key without --cert: give the client certificate too")
    try:
        context = ssl.create_default_context(cafile=str(cacert) if cacert else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--cacert {cacert}: cannot load it: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if cert is not None:
        try:
            context.load_cert_chain(str(cert), str(key) if key else None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--cert {cert}" + (f" --key {key}" if key else "") +
                             f": cannot load them: {getattr(exc, 'strerror', None) or exc}"
                             ) from None
    return context


def _tls_hint(exc: Exception) -> str:
    """What to do about a failed TLS connection, from what OpenSSL said."""
    text = str(exc).lower()
    if "certificate verify failed" in text:
        return "; the daemon's certificate is not trusted: pass its CA with --cacert " \
               "(or AC_OBSERVE_CACERT)"
    if "certificate required" in text or "handshake failure" in text or \
            "unknown ca" in text or "bad certificate" in text:
        return "; the daemon refused this client's certificate or wants one: pass " \
               "--cert and --key (or AC_OBSERVE_CERT, AC_OBSERVE_KEY)"
    if "wrong version number" in text or "record layer failure" in text:
        return "; it may not speak TLS: try http://"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        # TLS 1.3: a refused client certificate shows after the client's handshake.
        return "; it closed the connection: if it wants a client certificate, pass " \
               "--cert and --key (or AC_OBSERVE_CERT, AC_OBSERVE_KEY)"
    return ""


def get_json(obj: dict, path: str, expect: str, **params) -> dict:
    """GET a daemon route; its JSON body, which must hold the key `expect`."""
    url = obj["url"]
    headers = {}
    if obj.get("token"):
        headers["Authorization"] = b"Bearer " + obj["token"].encode("utf-8")
    verify = obj.get("tls") or True
    try:
        response = httpx.get(url + path, params=params, headers=headers, timeout=10,
                             verify=verify)
        if response.status_code == 400 and \
                response.text.startswith("Client sent an HTTP request to an HTTPS server"):
            raise DaemonError(f"the daemon at {url} speaks TLS: use https:// in --daemon "
                              "(or AC_OBSERVE_URL)")
    except (httpx.HTTPError, ssl.SSLError) as exc:
        hint = _tls_hint(exc) if url.startswith("https://") else ""
        raise DaemonUnreachable(
            f"cannot reach the ac-observe daemon at {url} ({type(exc).__name__}{hint}); "
            "start one with `ac-observe daemon` or `ac-observe up`, or point --daemon / "
            "AC_OBSERVE_URL at it") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 401:
        raise DaemonError(f"the daemon at {url} refused the token" if obj.get("token") else
                          f"the daemon at {url} wants a bearer token: pass --token-file, "
                          "or set AC_OBSERVE_TOKEN")
    if response.status_code == 403:
        raise DaemonError(f"the daemon at {url} refused access (HTTP 403)")
    ours = isinstance(body, dict) and (
        expect in body if response.status_code == 200 else isinstance(body.get("error"), str))
    if not ours:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise DaemonError(f"{url} does not answer like an ac-observe daemon "
                          f"(HTTP {response.status_code}, {kind}); check --daemon")
    if response.status_code != 200:
        raise DaemonError(str(body.get("error", f"HTTP {response.status_code}")))
    return body
