"""The `ac-observe` command line (typer). Torch-free: engine code loads only in `engine`/`up`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from daemon import __version__

app = typer.Typer(add_completion=False, no_args_is_help=False,
                  help="Kernel-level observability for self-hosted LLM inference.")


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context,
         version: bool = typer.Option(False, "--version", help="Print the version.")) -> None:
    if version:
        typer.echo(f"ac-observe {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


@app.command()
def skeleton(source: str = typer.Argument(..., metavar="FILE|-",
                                          help="A prompt file, a JSON request body, or - for stdin."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Print a prompt's structural skeleton and its depth (the skeleton_complexity)."""
    from engine.skeleton import skeleton_of_request, skeleton_of_text

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
    port: int = typer.Option(8000, help="HTTP port."),
    model: str = typer.Option("tiny", help="'tiny' (built-in random preset) or a local "
                                           "Hugging Face folder. Nothing is downloaded."),
    engine_name: str = typer.Option("", help="The `engine` label (default engine-PORT)."),
    model_name: str = typer.Option("", help="The `model` label (default: the model's name)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16 | float64"),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    kv_blocks: int = typer.Option(0, help="KV pool size in blocks (0: from --kv-memory-mb)."),
    kv_memory_mb: int = typer.Option(256, help="KV pool size in MiB when --kv-blocks is 0."),
    max_model_len: int = typer.Option(0, help="Context limit (0: the model's)."),
    max_waiting: int = typer.Option(256, help="Waiting queue limit; beyond it requests get 429."),
    low_latency_seqs: int = typer.Option(4, help="Batch limit of the low_latency lane."),
    throughput_seqs: int = typer.Option(64, help="Batch limit of the throughput lane."),
    max_body_mb: int = typer.Option(8, help="Largest accepted request body (413 beyond)."),
    telemetry_dir: str = typer.Option("", help="Telemetry directory (default: "
                                                "$AC_OBSERVE_TELEMETRY_DIR/<engine name>)."),
    demo_load: bool = typer.Option(False, "--demo-load", help="Send demo traffic to itself."),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve the bundled engine: Anthropic Messages and OpenAI Chat Completions APIs."""
    import logging
    import threading

    import uvicorn

    from daemon.demo_load import run_demo_load, wait_healthy
    from engine.config import EngineConfig, LaneConfig, default_telemetry_root
    from engine.server import EngineService, create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = engine_name or f"engine-{port}"
    telemetry = telemetry_dir or str(default_telemetry_root() / name)
    try:
        config = EngineConfig(
            model=model, model_name=model_name, engine_name=name, device=device, dtype=dtype,
            block_size=block_size, num_kv_blocks=kv_blocks,
            kv_cache_memory_bytes=kv_memory_mb << 20, max_model_len=max_model_len,
            max_waiting=max_waiting, telemetry_dir=telemetry, api_address=f"http://{host}:{port}",
            lanes=(LaneConfig("low_latency", low_latency_seqs),
                   LaneConfig("throughput", throughput_seqs)))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    app_ = create_app(EngineService(config), max_body_bytes=max_body_mb << 20)
    server = uvicorn.Server(uvicorn.Config(app_, host=host, port=port, log_level=log_level,
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
