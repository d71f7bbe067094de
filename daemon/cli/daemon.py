"""`ac-observe daemon`: the collectors, /metrics, the query API, drift alerts and webhooks,
served until Ctrl-C or SIGTERM; SIGHUP reloads the alerting file, the token file and the
web-config file (TLS, basic auth)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_USAGE, app, configure_logging, read_token
from ac_observe.daemon.config import DEFAULT_MAX_SERIES, DEFAULT_POD_RESOURCES_SOCKET
from ac_observe.metrics import DEFAULT_DAEMON_PORT


@app.command()
def daemon(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Interface to bind; off loopback needs a token."),
    port: int = typer.Option(DEFAULT_DAEMON_PORT, help="HTTP port (dcgm-exporter has 9400)."),
    token: str = typer.Option(None, envvar="AC_OBSERVE_TOKEN", show_envvar=True,
                              help="Bearer token (prefer --token-file or the environment: "
                                   "a command line is readable by every local user)."),
    token_file: Path = typer.Option(None, help="File holding the bearer token."),
    web_config_file: Path = typer.Option(
        None, envvar="AC_OBSERVE_WEB_CONFIG_FILE", show_envvar=True,
        help="Prometheus exporter-toolkit's web-config file: TLS (tls_server_config) and "
             "basic auth (basic_auth_users, bcrypt), beside the bearer token. Its "
             "certificates are read again when they change."),
    interval: str = typer.Option("1s", help="Collection interval."),
    window: str = typer.Option("1h", help="In-memory window (every cycle) for queries; "
                                          "longer ones come from per-minute history."),
    collectors: str = typer.Option("engine,nvml,ebpf", envvar="AC_OBSERVE_COLLECTORS",
                                   show_envvar=True,
                                   help="Enabled collectors, comma-separated."),
    ebpf_probes: str = typer.Option("", help="eBPF probe groups (default all): launch, graph, "
                                             "sync, memcpy, launch_latency."),
    ebpf_pids: str = typer.Option("", help="eBPF: only these pids (default every CUDA "
                                           "process)."),
    ebpf_comm: str = typer.Option("", help="eBPF: only processes whose name matches this "
                                           "regex."),
    collector_timeout: str = typer.Option("2s", help="A collector slower than this is down."),
    telemetry_root: str = typer.Option("", help="Where engines write telemetry "
                                                "(default $AC_OBSERVE_TELEMETRY_DIR)."),
    telemetry_owner: str = typer.Option(
        None, envvar="AC_OBSERVE_TELEMETRY_OWNER", show_envvar=True,
        help="The user (uid or name) non-root engines run as: their telemetry root and "
             "directories are read too (beside root's and this user's). Directories "
             "anyone else owns, or others can write, stay refused."),
    engine_stale: str = typer.Option("5s", help="Heartbeat age after which an engine is gone."),
    engine_grace: str = typer.Option("30s", help="How long a gone engine's series remain."),
    max_series: int = typer.Option(DEFAULT_MAX_SERIES,
                                   help="Series the daemon exports and keeps at most; past "
                                        "it new ones are refused and counted "
                                        "(ac_daemon_series_refused_total)."),
    max_requests: int = typer.Option(40, help="HTTP requests handled at once; more wait "
                                              "(up to 10 s) or get 503."),
    alerting: Path = typer.Option(None, help="Alerting file (YAML): drift rules and their "
                                                  "receivers."),
    store: str = typer.Option(None, envvar="AC_OBSERVE_STORE", help="Store URL, e.g. "
                              "postgresql+psycopg://user@host/db (default: SQLite in the "
                              "state directory)."),
    state_dir: Path = typer.Option(None, help="State directory (default "
                                              "$AC_OBSERVE_STATE_DIR, else "
                                              "$XDG_STATE_HOME/ac-observe)."),
    alert_interval: str = typer.Option("5s", help="How often alert rules are evaluated."),
    history: bool = typer.Option(True, "--history/--no-history",
                                 help="Keep per-minute history in the store, so windows "
                                      "longer than the in-memory one (24h, 7d) and "
                                      "same_hour_yesterday baselines can be answered."),
    history_retention: str = typer.Option("8d", help="How long history, alert "
                                                      "transitions and finished deliveries "
                                                      "are kept."),
    grafana_url: str = typer.Option(None, envvar="AC_OBSERVE_GRAFANA_URL", show_envvar=True,
                                    help="A Grafana to mark alert transitions in, as "
                                         "annotations (a receiver named 'grafana')."),
    grafana_token_file: Path = typer.Option(None, envvar="AC_OBSERVE_GRAFANA_TOKEN_FILE",
                                            show_envvar=True,
                                            help="File holding that Grafana's service "
                                                 "account token (Editor); else "
                                                 "$GRAFANA_TOKEN."),
    engine_endpoint: list[str] = typer.Option(
        None, "--engine-endpoint", help="A vLLM or SGLang server's /metrics to read, as "
        "[name=]URL (repeatable; also $AC_OBSERVE_ENGINE_ENDPOINTS, comma-separated)."),
    discover_engines: bool = typer.Option(
        False, "--discover-engines", envvar="AC_OBSERVE_DISCOVER_ENGINES", show_envvar=True,
        help="Find vLLM and SGLang server processes on the node (by command line and "
             "listening socket, a pod's in its own network namespace) and read them."),
    pod_resources_socket: str = typer.Option(
        str(DEFAULT_POD_RESOURCES_SOCKET), envvar="AC_OBSERVE_POD_RESOURCES_SOCKET",
        show_envvar=True, help="The kubelet's pod-resources socket, for per-process series' "
        "namespace, pod and container ('' to switch it off; without it: container id and "
        "pod UID from the cgroup)."),
    node_name: str = typer.Option(None, envvar="AC_OBSERVE_NODE_NAME", show_envvar=True,
                                  help="The node label on every series (default the host "
                                       "name; a DaemonSet gives spec.nodeName)."),
    log_level: str = typer.Option("info"),
) -> None:
    """Run the daemon: collectors, /metrics, the query API, drift alerts and webhooks."""
    from sqlalchemy.exc import SQLAlchemyError

    from ac_observe.daemon import sd_notify
    from ac_observe.daemon.config import (
        DaemonConfig,
        default_node_name,
        is_loopback,
        parse_endpoint,
        parse_owner,
    )
    from ac_observe.daemon.http_api import make_server
    from ac_observe.daemon.reload import ConfigReloader, ReloadFailed
    from ac_observe.daemon.service import Daemon, tune_interpreter
    from ac_observe.daemon.tls import WebSettings
    from ac_observe.durations import parse_duration
    from ac_observe.telemetry_format import default_telemetry_root

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not fatal while starting; then: reload
    configure_logging(log_level)
    try:
        endpoints = tuple(parse_endpoint(text) for text in [
            *(engine_endpoint or []),
            *_names(os.environ.get("AC_OBSERVE_ENGINE_ENDPOINTS", ""))])
        owner = parse_owner(telemetry_owner)
        # Click reads an empty variable as unset (the default path): '' is off, as said.
        # (The source by name: typer's click is a copy of its own.)
        source = ctx.get_parameter_source("pod_resources_socket")
        if os.environ.get("AC_OBSERVE_POD_RESOURCES_SOCKET") == "" and \
                getattr(source, "name", None) == "DEFAULT":
            pod_resources_socket = ""
        config = DaemonConfig(
            host=host, port=port, token=read_token(token, token_file),
            interval_seconds=parse_duration(interval), window_seconds=parse_duration(window),
            collectors=tuple(c.strip() for c in collectors.split(",") if c.strip()),
            collector_timeout_seconds=parse_duration(collector_timeout),
            telemetry_root=Path(telemetry_root) if telemetry_root else default_telemetry_root(),
            telemetry_owner=owner,
            engine_stale_seconds=parse_duration(engine_stale),
            engine_grace_seconds=parse_duration(engine_grace), max_series=max_series,
            ebpf_probes=_names(ebpf_probes), ebpf_comm=ebpf_comm,
            ebpf_pids=tuple(int(p) for p in _names(ebpf_pids)),
            alerting_file=alerting, store_url=store, state_dir=state_dir,
            alert_interval_seconds=parse_duration(alert_interval), history=history,
            history_retention_seconds=parse_duration(history_retention),
            grafana_url=grafana_url or None, engine_endpoints=endpoints,
            engine_discovery=discover_engines,
            pod_resources_socket=Path(pod_resources_socket) if pod_resources_socket else None,
            web_config_file=web_config_file,
            node_name=default_node_name() if node_name is None else node_name,
            grafana_token=read_token(os.environ.get("GRAFANA_TOKEN") or None,
                                      grafana_token_file) if grafana_url else None)
        # Read before the daemon opens its store: a bad field is told at once.
        web = WebSettings(web_config_file, must_authenticate=not config.token and
                          not is_loopback(host)) if web_config_file is not None else None
        service = Daemon(config)
    except (ValueError, OSError, SQLAlchemyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    reloader = ConfigReloader(service, token_file, web)
    server = make_server(service, host, port, config.token, max_requests, reloader, web)
    tune_interpreter()
    scheme = "https" if web is not None and web.tls else "http"

    def serving() -> None:
        service.start()
        typer.echo(f"ac-observe daemon: {scheme}://{host}:{server.port}/metrics  "
                   f"telemetry root {config.telemetry_root}", err=True)
        sd_notify.notify("READY=1", f"STATUS=serving {scheme}://{host}:{server.port}")

    def hangup() -> None:
        try:
            reloader.reload()
        except ReloadFailed:  # logged, and the gauge says so
            pass

    try:
        server.run(on_ready=serving, on_hangup=hangup)
    except OSError as exc:  # the port is taken, the address is not ours, ...
        typer.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    finally:
        sd_notify.notify("STOPPING=1")
        service.close()


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())
