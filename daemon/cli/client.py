"""The CLI's client of the daemon's HTTP API: a route's JSON body, or one line saying why
not and what to do, with the exit code it stands for."""
from __future__ import annotations

import httpx

from ac_observe.daemon.cli.app import EXIT_REFUSED, EXIT_UNREACHABLE


class DaemonError(RuntimeError):
    """The daemon cannot answer: one line saying why and what to do."""
    exit_code = EXIT_REFUSED


class DaemonUnreachable(DaemonError):
    exit_code = EXIT_UNREACHABLE


def get_json(obj: dict, path: str, expect: str, **params) -> dict:
    """GET a daemon route; its JSON body, which must hold the key `expect`."""
    url = obj["url"]
    headers = {}
    if obj.get("token"):
        headers["Authorization"] = b"Bearer " + obj["token"].encode("utf-8")
    try:
        response = httpx.get(url + path, params=params, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise DaemonUnreachable(
            f"cannot reach the ac-observe daemon at {url} ({type(exc).__name__}); start one "
            "with `ac-observe daemon` or `ac-observe up`, or point --daemon / AC_OBSERVE_URL "
            "at it") from None
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
