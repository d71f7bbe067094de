"""`ac-observe gateway --upstream URL`: the pass-through gateway that measures what clients
see of any OpenAI- or Anthropic-compatible server (ac_observe.gateway, imported inside
the command; it never imports torch)."""
from __future__ import annotations

import os
from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_USAGE, app, configure_logging


@app.command()
def gateway(
    upstream: str = typer.Option(..., help="The server relayed to, e.g. http://127.0.0.1:8000."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind (loopback by default)."),
    port: int = typer.Option(8080, help="HTTP port."),
    name: str = typer.Option("", help="The `engine` label of its telemetry (default "
                                      "gateway-PORT)."),
    upstream_name: str = typer.Option("", help="The `upstream` label (default: the engine "
                                               "serving that address beside this gateway's "
                                               "telemetry, else host:port)."),
    model_name: str = typer.Option("any", help="The `model` label of its telemetry."),
    max_body_mb: int = typer.Option(8, help="Largest request body relayed (413 beyond)."),
    connect_timeout: float = typer.Option(5.0, help="Seconds to connect to the upstream "
                                                    "(502 beyond)."),
    read_timeout: float = typer.Option(600.0, help="Seconds the upstream may stay silent "
                                                   "(504 before its answer; a stream ends)."),
    max_connections: int = typer.Option(256, help="Upstream connections at most (pooled, "
                                                  "kept alive)."),
    pool_timeout: float = typer.Option(1.0, help="Seconds a request waits for a free "
                                                 "upstream connection (503 beyond)."),
    upstream_ca_file: str = typer.Option(
        None, envvar="AC_OBSERVE_UPSTREAM_CA_FILE", show_envvar=True,
        help="PEM file of the CA certificates an https upstream's certificate is checked "
             "against (default: the system's)."),
    telemetry_dir: str = typer.Option("", help="Telemetry directory (default: "
                                               "<telemetry root>/NAME)."),
    log_level: str = typer.Option("info"),
) -> None:
    """Relay an OpenAI/Anthropic API unchanged and measure it as clients see it."""
    from ac_observe.gateway.proxy import GatewayConfig
    from ac_observe.gateway.serve import build, check_ca_file, check_upstream, serve
    from ac_observe.telemetry_format import default_telemetry_root, open_engine_dir

    configure_logging(log_level)
    label = name or f"gateway-{port}"
    telemetry = telemetry_dir or str(default_telemetry_root() / label)
    root = Path(telemetry).parent  # the daemon's root: the engines beside the gateway
    try:
        if min(max_body_mb, max_connections) < 1 or min(connect_timeout, read_timeout,
                                                         pool_timeout) <= 0:
            raise ValueError("limits and timeouts must be positive")
        if len(upstream_name) > 256 or not upstream_name.isprintable():
            raise ValueError("--upstream-name: at most 256 printable characters")
        config = GatewayConfig(check_upstream(upstream), max_body_bytes=max_body_mb << 20,
                               connect_timeout=connect_timeout, read_timeout=read_timeout,
                               max_connections=max_connections, pool_timeout=pool_timeout,
                               upstream_ca_file=check_ca_file(upstream_ca_file, upstream))
        os.close(open_engine_dir(telemetry, wait_seconds=2))  # refuse unsafe or taken dirs
        app_ = build(config, label, model_name, telemetry, root, f"http://{host}:{port}",
                     upstream_name)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(f"ac-observe gateway {label}: http://{host}:{port} -> {config.upstream}  "
               f"telemetry={telemetry}", err=True)
    serve(app_, host, port)
