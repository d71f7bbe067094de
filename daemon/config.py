"""Daemon settings (torch-free)."""
from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ac_observe.collectors.attribution.pod_resources import DEFAULT_SOCKET, default_socket
from ac_observe.collectors.scrape.fetch import check_endpoint_url
from ac_observe.metrics import DEFAULT_DAEMON_PORT
from ac_observe.telemetry_format import default_telemetry_root

DEFAULT_COLLECTORS = ("engine", "nvml", "ebpf")
# Series the daemon exports and windows at most (daemon/series_budget.py): a busy node,
# ~50 engines of ~900 watched series each, their GPUs and CUDA processes.
DEFAULT_MAX_SERIES = 50_000
DEFAULT_POD_RESOURCES_SOCKET = DEFAULT_SOCKET

log = logging.getLogger("ac_observe.daemon")


# Longest node name taken: a Kubernetes node name is a DNS subdomain (253), a host name
# fits in 255.
MAX_NODE_NAME = 253


def check_node_name(name: str) -> str:
    """A node name as every series carries it (`node`): a Prometheus label value, so any
    UTF-8 text, but not empty, not past MAX_NODE_NAME characters and no control
    characters (they would break logs and receivers' displays)."""
    if not name or not name.strip():
        raise ValueError("the node name is empty: give --node-name (or "
                         "AC_OBSERVE_NODE_NAME) a name, or leave it out for the host name")
    if len(name) > MAX_NODE_NAME:
        raise ValueError(f"the node name is {len(name)} characters long: at most "
                         f"{MAX_NODE_NAME} (--node-name, AC_OBSERVE_NODE_NAME)")
    if any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in name):
        raise ValueError(f"the node name {name[:100]!r} holds a control character "
                         "(--node-name, AC_OBSERVE_NODE_NAME)")
    return name


# uids no engine's files may be trusted as: nobody (the overflow uid, what an unmapped
# user reads as), and (uid_t)-1 and -2, "no change" to chown and the other overflow value.
NOT_AN_OWNER = {65534: "nobody, the overflow uid", 0xFFFFFFFE: "an overflow uid",
                0xFFFFFFFF: "(uid_t)-1, no uid"}


def parse_owner(text: str | None) -> int | None:
    """--telemetry-owner: a uid or a user name of this host (None or '': none). Warns
    when it names root or the daemon's own user (already trusted: nothing to do)."""
    text = (text or "").strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        uid = int(text)
    elif text.lstrip("-+").isascii() and text.lstrip("-+").isdigit():
        raise ValueError(f"--telemetry-owner {text[:20]}: not a uid (0 to 4294967293)")
    else:
        try:
            uid = pwd.getpwnam(text).pw_uid
        except KeyError:
            raise ValueError(f"--telemetry-owner {text[:100]!r}: no such user on this host "
                             "(give a uid: the daemon's image may not know the engine's "
                             "user names)") from None
    if uid > 0xFFFFFFFF:
        raise ValueError(f"--telemetry-owner {text[:20]}: not a uid (0 to 4294967293)")
    if uid in NOT_AN_OWNER:
        raise ValueError(f"--telemetry-owner {text[:20]}: uid {uid} is {NOT_AN_OWNER[uid]}, "
                         "no engine's own user")
    if uid in (0, os.geteuid()):
        log.warning("--telemetry-owner %s is %s, already trusted: the setting changes "
                    "nothing (give the uid the engines run as)", uid,
                    "root" if uid == 0 else "this daemon's own user")
    return uid


def default_node_name() -> str:
    return socket.gethostname() or "localhost"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack bind
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def parse_endpoint(text: str) -> tuple[str, str]:
    """`[name=]URL` -> (name, url); the name defaults to the URL's host:port."""
    name, sep, rest = text.partition("=")
    if sep and name and "/" not in name and ":" not in name:
        url = check_endpoint_url(rest.strip())
        name = name.strip()
    else:
        url = check_endpoint_url(text.strip())
        name = url.split("://", 1)[1].split("/", 1)[0]
    if not name or any(c in name for c in '"\\\n'):
        raise ValueError(f"engine endpoint name {name[:100]!r}: give a plain name")
    return name, url


@dataclass(slots=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_DAEMON_PORT
    token: str | None = None              # bearer token; required off loopback
    interval_seconds: float = 1.0
    window_seconds: float = 3600.0
    collectors: tuple[str, ...] = DEFAULT_COLLECTORS
    collector_timeout_seconds: float = 2.0
    telemetry_root: Path = field(default_factory=default_telemetry_root)
    # The uid non-root engines run as: beside root and the daemon's own user, it may own
    # the telemetry root and engine directories (collectors/engine/discovery.py)
    telemetry_owner: int | None = None
    engine_stale_seconds: float = 5.0     # no heartbeat for this long: the engine is gone
    engine_grace_seconds: float = 30.0    # then its series stay this long before they vanish
    max_series: int = DEFAULT_MAX_SERIES  # past it new series are refused
    ebpf_probes: tuple[str, ...] = ()     # probe groups (empty: all)
    ebpf_pids: tuple[int, ...] = ()       # only these processes (empty: every CUDA process)
    ebpf_comm: str = ""                   # only processes whose name matches this regex
    alerting_file: Path | None = None     # receivers and rules: daemon/alerting/
    alert_interval_seconds: float = 5.0   # rules are evaluated this often
    store_url: str | None = None          # SQLAlchemy URL; None: SQLite in state_dir
    state_dir: Path | None = None         # None: $AC_OBSERVE_STATE_DIR, $XDG_STATE_HOME/ac-observe
    history: bool = True                  # per-minute history in the store (daemon/history.py)
    history_retention_seconds: float = 8 * 86400.0
    grafana_url: str | None = None        # alerts become annotations in this Grafana
    grafana_token: str | None = field(default=None, repr=False)  # its service-account token
    # vLLM / SGLang servers to scrape: (name, /metrics URL) pairs (collectors/scrape/)
    engine_endpoints: tuple[tuple[str, str], ...] = ()
    # Find vLLM / SGLang server processes on the node and scrape them too
    # (collectors/scrape/discovery.py)
    engine_discovery: bool = False
    # The kubelet's pod-resources socket (collectors/attribution/); None: not asked
    pod_resources_socket: Path | None = field(default_factory=default_socket)
    # exporter-toolkit's web-config file: TLS, basic auth (daemon/web_config.py, tls.py)
    web_config_file: Path | None = None
    # The `node` label on every series the daemon exports and answers (a Prometheus
    # external label of the daemon's own): the DaemonSet gives the Kubernetes node's name
    node_name: str = field(default_factory=default_node_name)

    def __post_init__(self) -> None:
        self.node_name = check_node_name(self.node_name)
        self.telemetry_root = Path(self.telemetry_root)
        names = [name for name, _ in self.engine_endpoints]
        if len(set(names)) != len(names):
            raise ValueError("two engine endpoints have one name: give each its own "
                             "(name=URL)")
        if (self.engine_endpoints or self.engine_discovery) and \
                "scrape" not in self.collectors:
            self.collectors = (*self.collectors, "scrape")
        if self.interval_seconds <= 0 or self.window_seconds < self.interval_seconds:
            raise ValueError("interval must be > 0 and the window at least one interval")
        if self.max_series < 1:
            raise ValueError("--max-series must be at least 1")
        if self.history_retention_seconds < 3600:
            raise ValueError("history retention must be at least an hour")
        if self.token is not None:
            self.token = self.token.strip()  # as a presented token is read
            if not self.token:
                raise ValueError("the bearer token is empty or blank: it would let anyone in")
        # Off loopback with no token, the web-config file must guard every route (basic
        # auth or verified client certificates): daemon/tls.py refuses one that does not.
        if not is_loopback(self.host) and not self.token and self.web_config_file is None:
            raise ValueError(f"binding {self.host} exposes the daemon beyond this host: "
                             "set a bearer token (--token or AC_OBSERVE_TOKEN), or basic "
                             "auth or client certificates in --web-config-file")
