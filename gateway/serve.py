"""The gateway process: its telemetry writer (kind `gateway`), the upstream's label and
uvicorn serving `proxy.Gateway`."""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from ac_observe.engine.telemetry import SkeletonLabeler, TelemetryWriter
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


def serve(gateway: Gateway, host: str, port: int, log_level: str) -> None:
    import uvicorn

    # The upstream's own Date and Server headers pass through; uvicorn adds none.
    server = uvicorn.Server(uvicorn.Config(
        gateway, host=host, port=port, log_level=log_level, lifespan="on",
        http="httptools" if _has("httptools") else "h11", loop="auto",
        server_header=False, date_header=False, timeout_graceful_shutdown=5))
    try:
        server.run()
    finally:
        gateway.stats.close()


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
