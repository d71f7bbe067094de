"""The `ac-observe` command line (typer). Torch-free: engine code loads only in `engine`/`up`."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from ac_observe import __version__
from ac_observe.auth import FAULT_TOKEN_ENV
from ac_observe.metrics import DEFAULT_DAEMON_PORT, DEFAULT_ENGINE_PORT, LOW_LATENCY, THROUGHPUT

# Click's plain help: rich's panels cut long option names ("--gpu-memory-utiliz…") and env
# var names at 80 columns, the very text a user copies; click's wraps, whole.
PLAIN_HELP = {"rich_markup_mode": None}


def _whole_words_in_help() -> None:
    """Click's wrapper breaks words at hyphens (--gpu-memory-⏎utilization, ac-⏎observe in
    a description): wrap at spaces only. (typer carries its own click.)"""
    try:  # wrap_text imports the class from here at each call
        from typer._click import _textwrap
    except ImportError:  # a typer without its own click: click's defaults stand
        return
    base = _textwrap.TextWrapper

    class NoHyphenBreaks(base):
        def __init__(self, *args, **kwargs):
            kwargs["break_on_hyphens"] = False
            super().__init__(*args, **kwargs)
    _textwrap.TextWrapper = NoHyphenBreaks


_whole_words_in_help()
app = typer.Typer(add_completion=False, no_args_is_help=False, **PLAIN_HELP,
                  help="Kernel-level observability for self-hosted LLM inference.")


DEFAULT_DAEMON_URL = f"http://127.0.0.1:{DEFAULT_DAEMON_PORT}"


def daemon_address(url: str) -> str:
    """--daemon as typed: host:port alone means http://host:port."""
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context,
         metric: str = typer.Option(None, "--metric", "-m",
                                    help="Friendly metric name, e.g. cuda_stream_utilization."),
         window: str = typer.Option("60s", "--window", "-w", help="Look-back window: 30s, 5m, 1h."),
         labels: str = typer.Option("", "--labels", "-l", help="Filter: k=v[,k=v]."),
         as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
         watch: bool = typer.Option(False, "--watch", help="Refresh until Ctrl-C."),
         at: str = typer.Option(None, "--at", help="Answer as of this time (unix seconds or "
                                "ISO 8601): the window ends there."),
         list_metrics: bool = typer.Option(False, "--list", help="List the friendly names."),
         daemon_url: str = typer.Option(None, "--daemon", envvar="AC_OBSERVE_URL",
                                        help=f"Daemon URL (default {DEFAULT_DAEMON_URL})."),
         token: str = typer.Option(None, "--token", envvar="AC_OBSERVE_TOKEN",
                                   help="Bearer token for a daemon bound off loopback."),
         token_file: Path = typer.Option(None, "--token-file",
                                         help="File holding the bearer token."),
         version: bool = typer.Option(False, "--version", help="Print the version.")) -> None:
    try:
        token = _read_token(token, token_file)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    ctx.obj = {"url": daemon_address(daemon_url or DEFAULT_DAEMON_URL), "token": token}
    if version:
        typer.echo(f"ac-observe {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is not None:
        return
    from ac_observe.daemon import cli_query
    if list_metrics:
        raise typer.Exit(cli_query.list_metrics(ctx.obj, as_json))
    if metric:
        if at is not None and watch:
            typer.echo("error: --at names one instant; --watch follows the present", err=True)
            raise typer.Exit(2)
        if at is not None:  # read here: a clock time is this terminal's, not the daemon's
            from ac_observe.daemon.query import parse_instant
            try:
                at = repr(parse_instant(at))
            except ValueError as exc:
                typer.echo(f"error: --at: {exc}", err=True)
                raise typer.Exit(2)
        raise typer.Exit(cli_query.show_metric(ctx.obj, metric, window, labels, as_json, watch,
                                               at))
    typer.echo(ctx.get_help())


@app.command()
def status(ctx: typer.Context,
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Collectors and engines the daemon sees: up or down, and why."""
    from ac_observe.daemon import cli_query
    raise typer.Exit(cli_query.show_status(ctx.obj, as_json))


@app.command()
def top(ctx: typer.Context,
        window: str = typer.Option("60s", help="Window of the figures: 30s, 60s, 5m, 15m, "
                                               "1h (w cycles through them).")) -> None:
    """One live screen per engine and lane: TTFT, ITL, KV hit rate, stream use, queue."""
    from ac_observe.daemon.cli_top import run_top
    raise typer.Exit(run_top(ctx.obj, window))


@app.command()
def daemon(
    host: str = typer.Option("127.0.0.1", help="Interface to bind; off loopback needs a token."),
    port: int = typer.Option(DEFAULT_DAEMON_PORT, help="HTTP port (dcgm-exporter has 9400)."),
    token: str = typer.Option(None, envvar="AC_OBSERVE_TOKEN", show_envvar=True,
                              help="Bearer token (prefer --token-file or the environment: "
                                   "a command line is readable by every local user)."),
    token_file: Path = typer.Option(None, help="File holding the bearer token."),
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
    engine_stale: str = typer.Option("5s", help="Heartbeat age after which an engine is gone."),
    engine_grace: str = typer.Option("30s", help="How long a gone engine's series remain."),
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
    log_level: str = typer.Option("info"),
) -> None:
    """Run the daemon: collectors, /metrics, the query API, drift alerts and webhooks."""
    import logging

    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.http_api import make_server
    from ac_observe.daemon.query import parse_duration
    from sqlalchemy.exc import SQLAlchemyError

    from ac_observe.daemon.service import Daemon, tune_interpreter
    from ac_observe.telemetry_format import default_telemetry_root

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs URLs: webhook secrets
    try:
        config = DaemonConfig(
            host=host, port=port, token=_read_token(token, token_file),
            interval_seconds=parse_duration(interval), window_seconds=parse_duration(window),
            collectors=tuple(c.strip() for c in collectors.split(",") if c.strip()),
            collector_timeout_seconds=parse_duration(collector_timeout),
            telemetry_root=telemetry_root or default_telemetry_root(),
            engine_stale_seconds=parse_duration(engine_stale),
            engine_grace_seconds=parse_duration(engine_grace),
            ebpf_probes=_names(ebpf_probes), ebpf_comm=ebpf_comm,
            ebpf_pids=tuple(int(p) for p in _names(ebpf_pids)),
            alerting_file=alerting, store_url=store, state_dir=state_dir,
            alert_interval_seconds=parse_duration(alert_interval), history=history,
            history_retention_seconds=parse_duration(history_retention),
            grafana_url=grafana_url or None,
            grafana_token=_read_token(os.environ.get("GRAFANA_TOKEN") or None,
                                      grafana_token_file) if grafana_url else None)
        service = Daemon(config)
    except (ValueError, OSError, SQLAlchemyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    server = make_server(service, host, port, config.token, max_requests)
    tune_interpreter()

    def serving() -> None:
        service.start()
        typer.echo(f"ac-observe daemon: http://{host}:{server.port}/metrics  "
                   f"telemetry root {config.telemetry_root}", err=True)

    try:
        server.run(on_ready=serving)
    except OSError as exc:  # the port is taken, the address is not ours, ...
        typer.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2)
    finally:
        service.close()


alerts_app = typer.Typer(
    **PLAIN_HELP, help="Drift alerts: what is pending and firing, history, test deliveries.")
app.add_typer(alerts_app, name="alerts")


@alerts_app.callback(invoke_without_command=True)
def alerts_list(ctx: typer.Context,
                history: bool = typer.Option(False, "--history",
                                             help="Also the latest transitions."),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Alerts pending and firing now, with value and baseline."""
    if ctx.invoked_subcommand is None:
        from ac_observe.daemon import cli_query
        raise typer.Exit(cli_query.show_alerts(ctx.obj, history, as_json))


@alerts_app.command("defaults")
def alerts_defaults() -> None:
    """Print the shipped rules (what `rules: defaults` in an alerting file stands for)."""
    from ac_observe.daemon.alerts import DEFAULT_RULES
    typer.echo("rules:\n" + "".join(f"  {line}\n" for line in DEFAULT_RULES.splitlines()),
               nl=False)


@alerts_app.command("test")
def alerts_test(
    alerting: Path = typer.Option(..., help="Alerting file (YAML) naming the receivers."),
    receiver: str = typer.Option("", help="Only this receiver (default: all)."),
    store: str = typer.Option(None, envvar="AC_OBSERVE_STORE", help="Store URL (default: "
                              "SQLite in the state directory)."),
    state_dir: Path = typer.Option(None, help="State directory."),
    wait: float = typer.Option(15.0, help="Seconds to wait for the receivers' answers."),
) -> None:
    """Send a signed test delivery to each receiver through the outbox; print what each
    answered. One still failing stays in the outbox for the daemon to retry."""
    import socket
    import time

    from sqlalchemy.exc import SQLAlchemyError

    from ac_observe.daemon.store import PENDING, Store
    from ac_observe.daemon.webhooks import WebhookSender, load_alerting

    try:
        receivers = load_alerting(alerting)
        if receiver:
            if receiver not in receivers:
                raise ValueError(f"{alerting}: no receiver named {receiver!r}")
            receivers = {receiver: receivers[receiver]}
        if not receivers:
            raise ValueError(f"{alerting}: no receivers")
        outbox = Store(store, state_dir)
    except (ValueError, OSError, SQLAlchemyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    sender = WebhookSender(outbox, receivers)
    try:
        ids = dict(zip(receivers, sender.send_test(host=socket.gethostname())))
        deadline = time.monotonic() + wait
        rows = {}
        while True:
            sender.run_once(only=list(ids.values()))  # the daemon's own deliveries stay its
            rows = {name: outbox.delivery(i) for name, i in ids.items()}
            if all(r["state"] != PENDING or r["attempts"] for r in rows.values()) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = 0
        for name, row in rows.items():
            answer = row["last_status"] or row["last_error"] or "no answer yet"
            typer.echo(f"{name}: {row['state']} ({answer}) webhook-id {row['id']}")
            failed += row["state"] != "delivered"
    finally:
        sender.stop()
        outbox.close()
    raise typer.Exit(1 if failed else 0)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _read_token(token: str | None, token_file: Path | None) -> str | None:
    if token_file is None:
        return token
    try:
        return token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {token_file}: {exc}") from None


@app.command()
def up(
    engine_port: int = typer.Option(DEFAULT_ENGINE_PORT, help="Engine HTTP port."),
    daemon_port: int = typer.Option(DEFAULT_DAEMON_PORT, help="Daemon HTTP port."),
    model: str = typer.Option("tiny", help="'tiny' or a local Hugging Face folder."),
    demo_load: bool = typer.Option(False, "--demo-load", help="Send demo traffic."),
    demo_drift: bool = typer.Option(False, "--demo-drift",
                                    help="With demo traffic, slow the engine down now and "
                                         "then so a drift alert fires and resolves "
                                         "(ac-observe alerts)."),
    demo_drift_schedule: str = typer.Option("150s,90s", help="--demo-drift's calm and "
                                                             "slowed phases."),
    telemetry_root: str = typer.Option("", help="Telemetry root shared by engine and daemon."),
    engine_arg: list[str] = typer.Option([], "--engine-arg", help="Extra `engine` option."),
    daemon_arg: list[str] = typer.Option([], "--daemon-arg", help="Extra `daemon` option."),
) -> None:
    """Start an engine and a daemon on the embedded defaults; Ctrl-C stops both."""
    from ac_observe.daemon.query import parse_duration
    from ac_observe.daemon.supervisor import run_up
    schedule = None
    if demo_drift:
        try:
            calm, slowed = (parse_duration(p) for p in demo_drift_schedule.split(","))
        except ValueError as exc:
            typer.echo(f"error: --demo-drift-schedule {demo_drift_schedule!r}: use CALM,SLOWED "
                       f"such as 150s,90s ({exc})", err=True)
            raise typer.Exit(2)
        schedule = (calm, slowed)
    raise typer.Exit(run_up(engine_port, daemon_port, model, demo_load, telemetry_root,
                            engine_arg, daemon_arg, schedule))


@app.command()
def skeleton(source: str = typer.Argument(..., metavar="FILE|-",
                                          help="A prompt file, a JSON request body, or - for stdin."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Print a prompt's structural skeleton and its depth (the skeleton_complexity)."""
    from ac_observe.engine.skeleton import skeleton_of_request, skeleton_of_text

    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        typer.echo(f"error: cannot read {source}: {exc.strerror}", err=True)
        raise typer.Exit(2)
    text = raw.decode("utf-8", errors="replace")
    request = _as_request(text)
    result = (skeleton_of_request(request.get("system"), request["messages"])
              if request else skeleton_of_text(text))
    if as_json:
        typer.echo(json.dumps({"depth": result.depth, "nodes": result.node_count,
                               "skeleton_id": result.skeleton_id,
                               "truncated": result.truncated, "tree": result.render()}))
        return
    typer.echo(result.render())
    typer.echo(f"depth: {result.depth}  nodes: {result.node_count}  "
               f"id: {result.skeleton_id}" + ("  (truncated)" if result.truncated else ""))


@app.command()
def engine(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (loopback by default)."),
    port: int = typer.Option(DEFAULT_ENGINE_PORT, help="HTTP port."),
    model: str = typer.Option("tiny", help="'tiny' (built-in random preset) or a local "
                                           "Hugging Face folder. Nothing is downloaded."),
    engine_name: str = typer.Option("", help="The `engine` label (default engine-PORT)."),
    model_name: str = typer.Option("", help="The `model` label (default: the model's name)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16 | float64"),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    kv_blocks: int = typer.Option(0, help="KV pool size in blocks (0: from --kv-memory-mb)."),
    kv_memory_mb: int = typer.Option(0, help="KV pool size in MiB when --kv-blocks is 0 (0: "
                                             "256 on CPU; on CUDA what "
                                             "--gpu-memory-utilization leaves)."),
    gpu_memory_utilization: float = typer.Option(0.9, help="Share of the GPU's memory this "
                                                           "engine may hold (weights, KV)."),
    max_model_len: int = typer.Option(0, help="Context limit (0: the model's)."),
    cuda_graphs: str = typer.Option("auto", help="auto (on for CUDA) | on | off: decode steps "
                                                 "replay CUDA graphs captured at start-up."),
    cuda_graph_max_len: int = typer.Option(8192, help="Longest context a CUDA graph covers; "
                                                      "longer decode steps run eagerly."),
    cpu_packed_weights: str = typer.Option("auto", help="auto (on for CPU float32 with "
                                                        "oneDNN) | on | off: projections on "
                                                        "oneDNN with pre-packed weights (a "
                                                        "second copy of them)."),
    evicted_hash_memory: int = typer.Option(0, help="Evicted KV block hashes remembered to "
                                                    "tell evicted misses from new traffic "
                                                    "(16-32 bytes each; 0: 4x the pool, at "
                                                    "least 262144)."),
    kernel_sample_steps: int = typer.Option(200, help="Run every Nth step of each lane and "
                                                      "phase under the profiler for "
                                                      "ac_kernel_seconds (0: off)."),
    kernel_sample_budget: float = typer.Option(0.005, help="Most of wall time kernel "
                                                           "sampling may cost (a share)."),
    max_waiting: int = typer.Option(256, help="Waiting queue limit; beyond it requests get 429."),
    low_latency_seqs: int = typer.Option(4, help="Batch limit of the low_latency lane."),
    throughput_seqs: int = typer.Option(64, help="Batch limit of the throughput lane."),
    max_body_mb: int = typer.Option(8, help="Largest accepted request body (413 beyond)."),
    telemetry_dir: str = typer.Option("", help="Telemetry directory (default: "
                                                "$AC_OBSERVE_TELEMETRY_DIR/<engine name>)."),
    demo_load: bool = typer.Option(False, "--demo-load", envvar="AC_OBSERVE_DEMO_LOAD",
                                   help="Send demo traffic to itself."),
    fault_injection: bool = typer.Option(False, "--fault-injection",
                                         help="Serve /admin/faults (loopback only, with the "
                                              "fault token): an added per-step delay, forced "
                                              "prefix-cache misses."),
    fault_token_file: Path = typer.Option(None, "--fault-token-file",
                                          help="File holding /admin/faults' bearer token "
                                               "(or $AC_OBSERVE_FAULT_TOKEN)."),
    instrumentation: bool = typer.Option(True, "--instrumentation/--no-instrumentation",
                                         help="Off: no telemetry, statistics, step timers, "
                                              "kernel samples or skeleton parsing (what "
                                              "observing costs is measured against it)."),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve the bundled engine: Anthropic Messages and OpenAI Chat Completions APIs."""
    import logging
    import threading

    import uvicorn

    from ac_observe.daemon.demo_load import run_demo_load, wait_healthy
    from ac_observe.engine.config import EngineConfig, LaneConfig
    from ac_observe.engine.server import EngineService, create_app
    from ac_observe.auth import header_token_ok
    from ac_observe.engine.http_middleware import arrival_stamping_protocol
    from ac_observe.telemetry_format import default_telemetry_root, open_engine_dir

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the demo client's per-request lines
    name = engine_name or f"engine-{port}"
    telemetry = (telemetry_dir or str(default_telemetry_root() / name)) if instrumentation \
        else None
    if telemetry_dir and not instrumentation:
        typer.echo("error: --telemetry-dir and --no-instrumentation: an engine without "
                   "instrumentation writes no telemetry", err=True)
        raise typer.Exit(2)
    try:
        fault_token = _read_token((os.environ.get(FAULT_TOKEN_ENV) or "").strip() or None,
                                  fault_token_file)
        if fault_injection and not fault_token:
            raise ValueError(f"--fault-injection needs a token (${FAULT_TOKEN_ENV} or "
                             f"--fault-token-file): a port forwarded over ssh or kubectl "
                             f"reaches loopback routes too")
        if fault_token and not header_token_ok(fault_token):
            raise ValueError("the fault token must be printable ASCII without spaces (it "
                             "travels in an Authorization header)")
        config = EngineConfig(
            model=model, model_name=model_name, engine_name=name, device=device, dtype=dtype,
            block_size=block_size, num_kv_blocks=kv_blocks,
            kv_cache_memory_bytes=kv_memory_mb << 20, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            cuda_graphs=cuda_graphs, cuda_graph_max_len=cuda_graph_max_len,
            cpu_packed_weights=cpu_packed_weights, evicted_hash_memory=evicted_hash_memory,
            kernel_sample_steps=kernel_sample_steps, kernel_sample_budget=kernel_sample_budget,
            fault_injection=fault_injection, fault_token=fault_token,
            max_waiting=max_waiting, telemetry_dir=telemetry, api_address=f"http://{host}:{port}",
            lanes=(LaneConfig(LOW_LATENCY, low_latency_seqs),
                   LaneConfig(THROUGHPUT, throughput_seqs)), instrumentation=instrumentation)
        if telemetry is not None:
            os.close(open_engine_dir(telemetry, wait_seconds=2))  # refuse unsafe or taken dirs
    except (ValueError, OSError) as exc:  # UnsafeDirectory is an OSError
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    app_ = create_app(EngineService(config), max_body_bytes=max_body_mb << 20)
    # httptools and uvloop where it exists (the engine extra): the h11/asyncio pair costs
    # ~0.4 ms more between a first token and its bytes on the wire, which no figure counts.
    server = uvicorn.Server(uvicorn.Config(app_, host=host, port=port, log_level=log_level,
                                           http=arrival_stamping_protocol(), loop="auto",
                                           timeout_graceful_shutdown=5))
    stop = threading.Event()
    if demo_load:
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

        def demo() -> None:
            if wait_healthy(base):
                run_demo_load(base, stop)

        threading.Thread(target=demo, daemon=True, name="demo-load").start()
    typer.echo(f"ac-observe engine {name}: http://{host}:{port}  model={model}  "
               f"telemetry={telemetry}", err=True)
    try:
        server.run()
    finally:
        stop.set()


def _as_request(text: str) -> dict | None:
    """A Messages / Chat Completions request body, if that is what the file holds."""
    stripped = text.lstrip()
    if not stripped.startswith("{"):
        return None
    try:
        body = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return body
    return None


def main() -> None:
    app()


if __name__ == "__main__":
    main()


dashboards_app = typer.Typer(
    **PLAIN_HELP, help="Grafana dashboards and Prometheus rules generated from the metric "
                       "contract.")
app.add_typer(dashboards_app, name="dashboards")


@dashboards_app.command("generate")
def dashboards_generate(
    out: Path = typer.Option(Path("."), "--root", help="The repository's root (dashboards/ "
                             "and deploy/kubernetes/ are written under it)."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if any "
                               "generated file is missing or differs."),
) -> None:
    """Write the dashboards' JSON, Grafana provisioning, Prometheus rules and the
    Kubernetes PrometheusRule."""
    from ac_observe.dashboards import generate
    if check:
        stale = generate.stale(out)
        for path in stale:
            typer.echo(f"stale: {out / path}", err=True)
        raise typer.Exit(1 if stale else 0)
    for path in generate.write(out):
        typer.echo(f"wrote {out / path}")


@dashboards_app.command("push")
def dashboards_push(
    grafana_url: str = typer.Option(..., envvar="GRAFANA_URL", help="Grafana's URL."),
    token: str = typer.Option(None, envvar="GRAFANA_TOKEN", help="A service account token "
                              "(Editor); the environment is safer than the command line."),
    folder: str = typer.Option("ac-observe", help="Folder to put the dashboards in."),
    datasource_uid: str = typer.Option("", help="Uid of the Prometheus datasource to point "
                                       "the dashboards at (default: the stack's own)."),
) -> None:
    """Upload the dashboards to a Grafana that is not file-provisioned (Grafana Cloud)."""
    from ac_observe.dashboards import push
    try:
        for line in push.push(grafana_url, token, folder, datasource_uid or None):
            typer.echo(line)
    except push.PushError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)


rules_app = typer.Typer(**PLAIN_HELP, help="The drift rules for other evaluators.")
app.add_typer(rules_app, name="rules")


@rules_app.command("export")
def rules_export(
    fmt: str = typer.Option("prometheus", "--format", help="prometheus (a rule file)."),
    alerting: Path = typer.Option(None, help="Alerting file whose rules to export "
                                  "(default: the shipped rules)."),
) -> None:
    """Print the drift rules as a Prometheus rule file: one source, two evaluators."""
    import yaml

    from ac_observe.daemon.alerts import default_rules, load_alerting_config
    from ac_observe.dashboards import promql
    if fmt != "prometheus":
        typer.echo(f"error: unknown format {fmt!r}; use prometheus", err=True)
        raise typer.Exit(2)
    try:
        rules = default_rules() if alerting is None else load_alerting_config(alerting)[1]
        document = promql.alert_groups(rules)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(yaml.safe_dump(document, sort_keys=False, width=100), nl=False)
