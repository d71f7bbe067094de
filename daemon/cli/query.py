"""The bare form, `ac-observe --metric NAME --window 60s` (the app's root callback): one
metric over a window from the daemon, once or `--watch`ed, and `--list` of the friendly
names. The callback also reads the options every command shares (--daemon, --token)."""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import typer
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ac_observe import __version__
from ac_observe.daemon.cli.app import (
    DEFAULT_DAEMON_URL,
    EXIT_OK,
    EXIT_USAGE,
    app,
    daemon_address,
    read_token,
)
from ac_observe.daemon.cli.client import DaemonError, client_tls, get_json
from ac_observe.daemon.cli.render import metric_table, print_error


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
         cacert: Path = typer.Option(None, "--cacert", envvar="AC_OBSERVE_CACERT",
                                     help="CA certificate(s) to trust for an https:// "
                                          "daemon (default: the system's)."),
         cert: Path = typer.Option(None, "--cert", envvar="AC_OBSERVE_CERT",
                                   help="Client certificate for a daemon that asks for one "
                                        "(mutual TLS)."),
         key: Path = typer.Option(None, "--key", envvar="AC_OBSERVE_KEY",
                                  help="The client certificate's key (default: in --cert)."),
         version: bool = typer.Option(False, "--version", help="Print the version.")) -> None:
    try:
        bearer = read_token(token, token_file)
        tls = client_tls(cacert, cert, key)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    ctx.obj = {"url": daemon_address(daemon_url or DEFAULT_DAEMON_URL), "token": bearer,
               "tls": tls}
    if version:
        typer.echo(f"ac-observe {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is not None:
        return
    if list_metrics:
        raise typer.Exit(show_list(ctx.obj, as_json))
    if metric:
        if at is not None and watch:
            typer.echo("error: --at names one instant; --watch follows the present", err=True)
            raise typer.Exit(EXIT_USAGE)
        from ac_observe.daemon.query import parse_labels
        from ac_observe.durations import parse_duration, parse_instant
        # A malformed value is this command line's mistake (2), told before any daemon is
        # asked; whether the metric has such a label is the daemon's to say (1).
        for option, parse, value in (("--window", parse_duration, window),
                                     ("--labels", parse_labels, labels)):
            try:
                parse(value)
            except ValueError as exc:
                typer.echo(f"error: {option}: {exc}", err=True)
                raise typer.Exit(EXIT_USAGE) from None
        if at is not None:  # read here: a clock time is this terminal's, not the daemon's
            try:
                at = repr(parse_instant(at))
            except ValueError as exc:
                typer.echo(f"error: --at: {exc}", err=True)
                raise typer.Exit(EXIT_USAGE) from None
        raise typer.Exit(show_metric(ctx.obj, metric, window, labels, as_json, watch, at))
    typer.echo(ctx.get_help())


def show_metric(obj: dict, metric: str, window: str, labels: str, as_json: bool,
                watch: bool, at: str | None = None) -> int:
    console = Console()

    def fetch() -> dict:
        return get_json(obj, "/api/v1/query", "series", metric=metric, window=window,
                        labels=labels, **({"at": at} if at else {}))

    try:
        if as_json:  # one JSON document per line, every 2 s with --watch
            return _print_json_lines(fetch, watch)
        if not watch:
            console.print(metric_table(fetch(), console.width), end="", soft_wrap=True)
            return EXIT_OK
        if not console.is_terminal:  # a pipe or a file: one plain frame after another
            _print_frames(console, fetch)
        _redraw_in_place(console, fetch)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `--watch | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return EXIT_OK
    except DaemonError as exc:
        message = str(exc)
        if "unknown metric" in message:
            message += " (see `ac-observe --list`)"
        print_error(message)
        return exc.exit_code


def _print_json_lines(fetch: Callable[[], dict], watch: bool) -> int:
    while True:
        print(json.dumps(fetch()), flush=True)
        if not watch:
            return EXIT_OK
        time.sleep(2)


def _print_frames(console: Console, fetch: Callable[[], dict]) -> NoReturn:
    while True:
        console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", highlight=False)
        console.print(metric_table(fetch(), console.width), end="", soft_wrap=True)
        console.file.flush()
        time.sleep(2)


def _redraw_in_place(console: Console, fetch: Callable[[], dict]) -> NoReturn:
    """Redrawn in place (no flicker), resized with the terminal."""
    with Live(metric_table(fetch(), console.width), console=console,
              refresh_per_second=4, auto_refresh=False) as live:
        while True:
            time.sleep(2)
            live.update(metric_table(fetch(), console.width), refresh=True)


def show_list(obj: dict, as_json: bool) -> int:
    """The friendly names: the daemon's list, else (no daemon, or not ours) the built-in
    one, so `--list` always answers."""
    console = Console()
    try:
        metrics = get_json(obj, "/api/v1/metrics", "metrics")["metrics"]
    except DaemonError:
        from ac_observe.daemon.query import describe_friendly  # known without a daemon
        metrics = describe_friendly()
    if as_json:
        print(json.dumps(metrics))
        return EXIT_OK
    # The name is what a user copies into --metric: whole on one line, whatever the width;
    # the help wraps. The source family takes a column only where there is room for it
    # (--json always has it).
    wide = console.width >= 120
    table = Table(title="metrics", box=box.SIMPLE_HEAD)
    table.add_column("name", no_wrap=True, min_width=max(len(m["name"]) for m in metrics))
    table.add_column("unit", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    if wide:
        table.add_column("source", no_wrap=True)
    table.add_column("help", ratio=1)
    for m in metrics:
        table.add_row(m["name"], m["unit"], m["kind"], *([m["source"]] if wide else []),
                      m["help"])
    console.print(table)
    return EXIT_OK
