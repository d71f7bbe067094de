"""One bounded scrape of an engine's `/metrics`: its text within a deadline and a size
limit, parsed by prometheus_client's own parser.

NOTE: an endpoint is outside input. Every way it can fail (refused, slow, a body too big,
not Prometheus text, an HTTP error) raises `ScrapeFailed` with a reason a user can act
on; nothing it sends is trusted beyond the families the mapping table names.
"""
from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MAX_BODY_BYTES = 4 * 1024 * 1024   # a vLLM with 8 DP ranks answers ~0.5 MiB
_CHUNK = 64 * 1024


class ScrapeFailed(RuntimeError):
    """The endpoint could not be read as Prometheus text: the reason, for `status`."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # answered as the HTTP error it is


# No redirects: a process that claims to be an engine (discovery trusts command lines)
# would steer the daemon to another address and see its text in a parse error. No
# proxies from the environment: an engine on the node is reached directly.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


def check_endpoint_url(url: str) -> str:
    """The URL if it is an http(s) URL with a host, else ValueError; a bare host:port
    gets http:// and /metrics."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        # Said without the URL: its password would land in the log, the status and, as
        # the default name, the engine label. (urllib would not send it anyway.)
        raise ValueError(f"engine endpoint at {parts.hostname}: user:password@ in the URL is "
                         "not supported (vLLM and SGLang serve /metrics without it)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine endpoint {url[:200]!r}: give an http(s) URL with a host")
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    return url


def fetch_text(url: str, timeout_seconds: float, max_bytes: int = MAX_BODY_BYTES) -> str:
    """The endpoint's body, read within `timeout_seconds` overall (a server that drips
    bytes is cut off too) and at most `max_bytes` long."""
    deadline = time.monotonic() + timeout_seconds
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    try:
        with _OPENER.open(request, timeout=timeout_seconds) as response:
            if response.status != 200:
                raise ScrapeFailed(f"HTTP {response.status}")
            body = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise ScrapeFailed(f"timed out after {timeout_seconds:g}s")
                # read1: one recv at most, so the deadline is checked between recvs (read
                # waits for the whole chunk, however slowly it drips).
                chunk = response.read1(_CHUNK)
                if not chunk:
                    break
                body += chunk
                if len(body) > max_bytes:
                    raise ScrapeFailed(f"body over {max_bytes} bytes: not read")
    except urllib.error.HTTPError as exc:
        raise ScrapeFailed(f"HTTP {exc.code}") from None
    except TimeoutError:
        raise ScrapeFailed(f"timed out after {timeout_seconds:g}s") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise ScrapeFailed(f"timed out after {timeout_seconds:g}s") from None
        raise ScrapeFailed(f"cannot connect: {getattr(reason, 'strerror', None) or reason}"
                           ) from None
    except (http.client.HTTPException, OSError) as exc:
        raise ScrapeFailed(f"bad answer: {type(exc).__name__}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeFailed("not Prometheus text: not UTF-8") from None


def parse_text(text: str) -> dict[str, Metric]:
    """The families of a Prometheus text body by name (counters without `_total`, as
    prometheus_client names them)."""
    families: dict[str, Metric] = {}
    try:
        for family in text_string_to_metric_families(text):
            families[family.name] = family
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        # The parser quotes the line it choked on: what the endpoint sent, so cut short.
        raise ScrapeFailed(f"not Prometheus text: {str(exc)[:60]}") from None
    return families
