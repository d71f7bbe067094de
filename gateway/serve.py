"""The gateway process: its telemetry writer (kind `gateway`), the upstream's label and
the HTTP server (http_server) answering with `proxy.Gateway`."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from ac_observe.engine.telemetry import SkeletonLabeler, TelemetryWriter
from ac_observe.gateway.http_server import Server
from ac_observe.gateway.measure import GatewayStats
from ac_observe.gateway.proxy import Gateway, GatewayConfig
from ac_observe.gateway.upstream import tls_context
from ac_observe.metrics import GATEWAY_METRICS, KIND_GATEWAY
from ac_observe.telemetry_format import (
    ENGINE_INFO_FILE,
    MAX_INFO_BYTES,
    parse_engine_info,
    read_regular_file,
)

log = logging.getLogger("ac_observe.gateway")
GRACE_S = 5  # uvicorn's timeout_graceful_shutdown, which the gateway served on before
# The telemetry writer's thread (skeletons, files) would hold the GIL for up to the switch
# interval, 5 ms by default, while the loop waits to relay an event (as in the engine).
GIL_SWITCH_SECONDS = 0.001


def check_upstream(url: str) -> str:
    """The upstream's base URL, checked: http(s), a host, no query or fragment."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream {url!r}: an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream {url!r}: no query or fragment")
    return url.rstrip("/")


def check_ca_file(ca_file: str | None, url: str) -> str | None:
    """The CA file an https upstream is verified with, checked now (readable PEM holding
    a certificate) so a bad one stops the gateway at start, never a request later."""
    if not ca_file:
        return None
    if urlsplit(url).scheme != "https":
        raise ValueError(f"--upstream-ca-file: the upstream {url!r} is not https")
    tls_context(ca_file)  # ValueError with the reason
    return ca_file


def upstream_label(url: str, telemetry_root: Path) -> str:
    """The upstream's engine name when an engine under the telemetry root serves that
    address (its engine.json's api_address), else its host:port."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = f"{parts.hostname}:{port}"
    try:
        names = sorted(os.listdir(telemetry_root))
    except OSError:
        return address
    for name in names:
        try:
            fd = os.open(telemetry_root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = parse_engine_info(read_regular_file(fd, ENGINE_INFO_FILE, MAX_INFO_BYTES))
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
        known = urlsplit(str(info.get("api_address", "")))
        if info.get("kind") != KIND_GATEWAY and known.hostname == parts.hostname \
                and (known.port or 80) == port:
            return info["engine"]
    return address


def build(config: GatewayConfig, name: str, model: str, telemetry_dir: str | None,
          telemetry_root: Path, api_address: str, upstream_name: str = "") -> Gateway:
    """The gateway's application with its writer open (None telemetry_dir: no telemetry)."""
    writer = None
    if telemetry_dir is not None:
        upstream = upstream_name or upstream_label(config.upstream, telemetry_root)
        writer = TelemetryWriter(telemetry_dir, {
            "engine_id": uuid.uuid4().hex, "api_address": api_address, "kind": KIND_GATEWAY,
            "upstream": upstream}, engine=name, model=model, specs=GATEWAY_METRICS,
            buffered=True)
        log.info("gateway %s: upstream %s (label %s), telemetry %s", name, config.upstream,
                 upstream, telemetry_dir)
    return Gateway(config, GatewayStats(writer, SkeletonLabeler()))


def serve(gateway: Gateway, host: str, port: int) -> None:
    """Serves until SIGINT or SIGTERM, then shuts down gracefully: GRACE_S for the answers
    in flight, cut short by a second signal. On uvloop where it is installed."""
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # What start-up built lives as long as the process: out of the collector's scans,
    # whose full pass over it (19 ms) stalled every stream.
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    try:
        loop.run_until_complete(_serve(gateway, host, port))
    finally:
        gateway.stats.close()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _serve(gateway: Gateway, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop, cut_short = asyncio.Event(), asyncio.Event()

    def signalled() -> None:
        (cut_short if stop.is_set() else stop).set()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signalled)
    # A client that takes nothing for as long as an upstream may stay silent is gone.
    server = Server(gateway, gateway.config.max_body_bytes,
                    write_timeout_s=gateway.config.read_timeout)
    await server.start(host, port)
    log.info("gateway listening on http://%s:%d", host, server.port)
    try:
        await stop.wait()
    finally:
        log.info("gateway shutting down: %d s for the answers in flight (a second signal "
                 "ends them now)", GRACE_S)
        await server.shutdown(GRACE_S, cut_short)
        await gateway.aclose()
