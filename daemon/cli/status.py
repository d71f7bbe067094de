"""`ac-observe status`: the collectors and engines the daemon sees, up or down, and why."""
from __future__ import annotations

import json

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ac_observe.daemon.cli.app import EXIT_OK, app
from ac_observe.daemon.cli.client import DaemonError, get_json
from ac_observe.daemon.cli.render import fitted, print_error


@app.command()
def status(ctx: typer.Context,
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Collectors and engines the daemon sees: up or down, and why."""
    raise typer.Exit(show_status(ctx.obj, as_json))


def show_status(obj: dict, as_json: bool) -> int:
    console = Console()
    try:
        status = get_json(obj, "/api/v1/status", "collectors")
    except DaemonError as exc:
        print_error(str(exc))
        return exc.exit_code
    if as_json:
        print(json.dumps(status))
        return EXIT_OK
    node = f"  node {escape(status['node'])}" if status.get("node") else ""
    console.print(f"ac-observe daemon {status['version']} at {obj['url']}{node}  "
                  f"interval {status['interval_seconds']:g}s  window {status['window_seconds']:g}s")
    # Names and addresses whole on one line (what a user types next); reasons wrap.
    table = Table(title="collectors", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("collector", "state", "reason", "errors", "last run"):
        table.add_column(column, no_wrap=column != "reason", overflow="fold",
                         min_width=12 if column == "reason" else None)
    for c in status["collectors"]:
        table.add_row(escape(c["name"]), "[green]up[/green]" if c["up"] else "[red]down[/red]",
                      escape(c["reason"]), str(c["errors_total"]),
                      f"{c['duration_seconds'] * 1e3:.1f} ms")
    console.print(table)
    if "attribution" in status:
        console.print(_attribution_line(status["attribution"]))
    rows = [_engine_row(e) for e in status["engines"]]

    def engines_table(first_width: int, fits: bool) -> Table:
        scraped = any(e.get("endpoint") for e in status["engines"])
        where = f"engines under {status['telemetry_root']}" + \
            (" and scraped endpoints" if scraped else "")
        table = Table(title=escape(where),
                      title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("engine, model, api", overflow="fold", width=first_width)
        table.add_column("pid", no_wrap=fits, overflow="fold")
        table.add_column("state", overflow="fold", max_width=24)  # reasons wrap
        table.add_column("heartbeat", no_wrap=fits, overflow="fold")
        for row in rows:
            table.add_row(*row)
        if not rows:
            table.caption = "no engine found"
        return table
    table = fitted(engines_table, [row[0] for row in rows], console.width)
    console.print(table)
    return EXIT_OK


def _attribution_line(a: dict) -> Text:
    """Which source names per-process series' containers and pods, and why not a better one."""
    line = Text.from_markup(f"processes named by: [bold]{escape(a['source'])}[/bold] "
                            f"({a['containers']} container(s) among {a['processes']} "
                            f"process(es), {a['named_containers']} named by the kubelet)")
    if a.get("reason"):
        line.append(f"\n  {a['reason']}", style="dim")
    return line


def _engine_row(e: dict) -> tuple:
    """An engine's row: name (model, API address under it), pid, state, heartbeat."""
    # The engine's name, then its model and API address under it (whole: what a user
    # types next).
    name = Text(str(e["engine"]) + (f" ({e['kind']})" if e.get("kind") else ""))
    name.append(f"\n{e['model']}" + (f"\n{e['api_address']}" if e["api_address"] else ""),
                style="dim")
    if e.get("error") and e.get("endpoint"):  # a scraped engine: its URL is above
        state = Text.from_markup(f"[red]down[/red]: {escape(e['error'])}")
    elif e.get("error"):  # an engine directory that does not read
        state = Text.from_markup(f"[red]bad[/red]: {escape(e['error'])} "
                                 f"({escape(e['directory'])})")
    else:
        state = Text.from_markup("[green]alive[/green]" if e["alive"]
                                 else "[yellow]gone[/yellow]")
        if e.get("restarts"):
            state.append(f", {e['restarts']} restart" + ("s" if e["restarts"] > 1 else ""))
        if e.get("warning"):
            state.append(f" ({e['warning']})")
    age = e.get("heartbeat_age_seconds")
    return (name, "-" if e["pid"] is None else str(e["pid"]), state,
            "-" if age is None else f"{age}s ago")
