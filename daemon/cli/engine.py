"""`ac-observe engine`: the bundled engine's HTTP server.

NOTE: engine code (torch) is imported inside the command only: the CLI never imports torch
when it starts, so `pip install ac-observe` without the engine extra runs every other
command."""
from __future__ import annotations

import os
from pathlib import Path

import typer

from ac_observe.auth import FAULT_TOKEN_ENV
from ac_observe.daemon.cli.app import EXIT_USAGE, app, configure_logging, read_token
from ac_observe.metrics import DEFAULT_ENGINE_PORT, LOW_LATENCY, THROUGHPUT


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
    import threading

    import uvicorn

    from ac_observe.auth import header_token_ok
    from ac_observe.daemon.demo_load import run_demo_load, wait_healthy
    from ac_observe.engine.config import EngineConfig, LaneConfig
    from ac_observe.engine.http_middleware import arrival_stamping_protocol
    from ac_observe.engine.server import EngineService, create_app
    from ac_observe.telemetry_format import default_telemetry_root, open_engine_dir

    configure_logging(log_level)
    name = engine_name or f"engine-{port}"
    telemetry = (telemetry_dir or str(default_telemetry_root() / name)) if instrumentation \
        else None
    if telemetry_dir and not instrumentation:
        typer.echo("error: --telemetry-dir and --no-instrumentation: an engine without "
                   "instrumentation writes no telemetry", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        fault_token = read_token((os.environ.get(FAULT_TOKEN_ENV) or "").strip() or None,
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
        raise typer.Exit(EXIT_USAGE) from None
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
