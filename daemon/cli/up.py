"""`ac-observe up`: an engine and a daemon on the embedded defaults, supervised
(daemon/supervisor.py) until Ctrl-C."""
from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_USAGE, app
from ac_observe.metrics import DEFAULT_DAEMON_PORT, DEFAULT_ENGINE_PORT


class DriftCause(str, Enum):
    """--demo-drift-cause: daemon/demo_drift.py's CAUSES."""
    steps = "steps"
    load = "load"
    cache = "cache"
    prompts = "prompts"


@app.command()
def up(
    engine_port: int = typer.Option(DEFAULT_ENGINE_PORT, help="Engine HTTP port."),
    daemon_port: int = typer.Option(DEFAULT_DAEMON_PORT, help="Daemon HTTP port."),
    model: str = typer.Option("tiny", help="'tiny' or a local Hugging Face folder."),
    demo_load: bool = typer.Option(False, "--demo-load", help="Send demo traffic."),
    demo_drift: bool = typer.Option(False, "--demo-drift",
                                    help="With demo traffic, make the engine drift now and "
                                         "then so a drift alert fires and resolves "
                                         "(ac-observe alerts)."),
    demo_drift_schedule: str = typer.Option("150s,90s", help="--demo-drift's calm and "
                                                             "drifting phases."),
    demo_drift_cause: DriftCause = typer.Option(
        "steps", case_sensitive=False,
        help="What --demo-drift changes: steps (each engine step 300 ms slower), load (a "
             "burst: 24 demo clients instead of 3), cache (the prefix cache flushed every "
             "50 ms), prompts (each prompt's user text 24x longer)."),
    telemetry_root: str = typer.Option("", help="Telemetry root shared by engine and daemon."),
    engine_arg: list[str] = typer.Option([], "--engine-arg", help="Extra `engine` option."),
    daemon_arg: list[str] = typer.Option([], "--daemon-arg", help="Extra `daemon` option."),
    web_config_file: Path = typer.Option(None, help="The daemon's web-config file (TLS, "
                                                    "basic auth; docs/tls.md)."),
) -> None:
    """Start an engine and a daemon on the embedded defaults; Ctrl-C stops both."""
    from ac_observe.daemon.supervisor import run_up
    from ac_observe.durations import parse_duration
    schedule = None
    if demo_drift_cause is not DriftCause.steps and not demo_drift:
        typer.echo(f"error: --demo-drift-cause {demo_drift_cause.value} is --demo-drift's: "
                   "add --demo-drift", err=True)
        raise typer.Exit(EXIT_USAGE)
    if demo_drift:
        try:
            calm, slowed = (parse_duration(p) for p in demo_drift_schedule.split(","))
        except ValueError as exc:
            typer.echo(f"error: --demo-drift-schedule {demo_drift_schedule!r}: use CALM,SLOWED "
                       f"such as 150s,90s ({exc})", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        schedule = (calm, slowed)
    tls = False
    if web_config_file is not None:
        if demo_drift:
            typer.echo("error: --demo-drift follows the daemon's alerts over plain HTTP: "
                       "leave --web-config-file out for the demo", err=True)
            raise typer.Exit(EXIT_USAGE)
        from ac_observe.daemon.web_config import WebConfigError, read_web_config
        try:  # a file of basic-auth users only serves plain HTTP
            tls = read_web_config(web_config_file).tls
        except WebConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        daemon_arg = [*daemon_arg, "--web-config-file", str(web_config_file.resolve())]
    raise typer.Exit(run_up(engine_port, daemon_port, model, demo_load, telemetry_root,
                            engine_arg, daemon_arg, schedule,
                            daemon_scheme="https" if tls else "http",
                            demo_drift_cause=demo_drift_cause.value))
