"""`ac-observe top`: one live screen of the headline figures per engine and lane, every
second, from the daemon's query API (so it works over the token-protected API too).

Keys: w cycles the window, q quits; Ctrl-C quits. It leaves the terminal as it found it,
and when the daemon goes away it says so in one line. Without a terminal it prints one
snapshot and exits.
"""
from __future__ import annotations

import os
import select
import sys
import time

import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ac_observe.daemon.cli.app import EXIT_OK, EXIT_USAGE, app
from ac_observe.daemon.cli.client import DaemonError, get_json
from ac_observe.daemon.cli.render import alert_state, alerts_table, human

WINDOWS = ("30s", "60s", "5m", "15m", "1h")
# (key in a snapshot, friendly name, statistic)
FIGURES = (
    ("ttft_p50", "inference_latency_ns", "p50"), ("ttft_p95", "inference_latency_ns", "p95"),
    ("itl_p95", "inter_token_latency_ms", "p95"), ("util", "cuda_stream_utilization", "mean"),
    ("running", "requests_running", "last"), ("waiting", "requests_waiting", "last"),
    ("hit", "kv_cache_hit_rate", "mean"), ("usage", "kv_cache_usage", "last"),
    ("skeleton", "skeleton_complexity", "p50"),
    ("gpu_util", "gpu_utilization", "last"), ("sm", "gpu_sm_occupancy", "last"),
)


@app.command()
def top(ctx: typer.Context,
        window: str = typer.Option("60s", help="Window of the figures: 30s, 60s, 5m, 15m, "
                                               "1h (w cycles through them).")) -> None:
    """One live screen per engine and lane: TTFT, ITL, KV hit rate, stream use, queue."""
    if window not in WINDOWS:  # w cycles through these: another has no place in the cycle
        typer.echo(f"error: --window {window!r}: use one of {', '.join(WINDOWS)}", err=True)
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(run_top(ctx.obj, window))


LANE_COLUMNS = ("lane", "TTFT p50", "TTFT p95", "ITL p95", "stream", "run", "wait")
LANE_FIGURES = {"TTFT p50": "ttft_p50", "TTFT p95": "ttft_p95", "ITL p95": "itl_p95",
                "stream": "util", "run": "running", "wait": "waiting"}
_MEASURE = Console(width=10_000, color_system=None)  # measures tables; prints nothing


def snapshot(obj: dict, window: str) -> dict:
    """{figure: {(engine, lane) | engine | gpu: formatted value}}, plus collectors.

    Every figure is asked as of the same cycle (the newest when the snapshot starts), so a
    screen never mixes two cycles, and `--metric … --at <as_of>` answers exactly what it
    shows."""
    status = get_json(obj, "/api/v1/status", "collectors")
    as_of = status.get("as_of")
    pinned = {"at": repr(as_of)} if as_of else {}
    figures = {}
    for key, metric, stat in FIGURES:
        answer = get_json(obj, "/api/v1/query", "series", metric=metric, window=window,
                          **pinned)
        by = {}
        for series in answer["series"]:
            labels = series["labels"]
            where = labels.get("gpu") or (labels.get("engine"), labels.get("stream"))
            if where == (labels.get("engine"), None):
                where = labels.get("engine")
            by[where] = human(series[stat], answer["unit"])
        figures[key] = by
    alerts = get_json(obj, "/api/v1/alerts", "alerts")
    return {"figures": figures, "collectors": status["collectors"],
            "engines": status["engines"], "window": window, "as_of": as_of,
            "alerts": alerts}


def _lanes_table(figures: dict, engine: str, lanes: list[str], columns) -> Table:
    table = Table(title=Text(f"lanes of {engine}"), title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, justify="left" if column == "lane" else "right",
                         no_wrap=True)
    for lane in lanes:
        table.add_row(Text(lane), *(figures[LANE_FIGURES[c]].get((engine, lane), "-")
                                    for c in columns[1:]))
    return table


def render(snap: dict, url: str, width: int | None = None) -> Group:
    figures = snap["figures"]
    as_of = (time.strftime("%H:%M:%S", time.localtime(snap["as_of"])) if snap["as_of"]
             else "no cycle yet")
    title = Text(f"ac-observe top  as of {as_of}  window {snap['window']}  "
                 f"[w] window [q] quit\n{url}", style="bold")
    keys = sorted(k for k in set().union(*(figures[f] for f in ("ttft_p50", "util",
                                                                 "running")))
                  if isinstance(k, tuple))
    # One lanes table per engine, its name in the title: seven columns fit 80 even with
    # wide figures (1.50k req, 12.3 s), and a long engine name wraps as a title, uncut.
    # Narrower than it needs, an engine's lanes take two tables (latency, then load)
    # rather than cut a number.
    lane_tables: list[Table | Text] = []
    for engine in sorted({engine for engine, _ in keys}):
        lanes = [lane for e, lane in keys if e == engine]
        table = _lanes_table(figures, engine, lanes, LANE_COLUMNS)
        if width is not None and \
                Measurement.get(_MEASURE, _MEASURE.options, table).maximum > width:
            lane_tables += [_lanes_table(figures, engine, lanes, LANE_COLUMNS[:4]),
                            _lanes_table(figures, engine, lanes, LANE_COLUMNS[:1] +
                                         LANE_COLUMNS[4:])]
        else:
            lane_tables.append(table)
    if not lane_tables:
        lane_tables.append(Text("lanes: no engine has reported a figure in this window"))
    engines = Table(title="engines", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("engine", "KV hit", "KV used", "skeleton p50", "state"):
        engines.add_column(column, justify="left" if column in ("engine", "state")
                           else "right", overflow="fold", min_width=len(column))
    for e in snap["engines"]:
        name = str(e.get("engine"))
        state = "bad: " + e["error"] if e.get("error") else ("alive" if e["alive"] else "gone")
        engines.add_row(Text(name), figures["hit"].get(name, "-"),  # names as text, not markup
                        figures["usage"].get(name, "-"), figures["skeleton"].get(name, "-"),
                        Text(state))
    parts: list[RenderableType] = [title, *lane_tables, engines]
    gpus = sorted(set(figures["gpu_util"]) | set(figures["sm"]))
    if gpus:
        table = Table(title="GPUs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("gpu", "utilisation", "SM occupancy"):
            table.add_column(column, justify="right")
        for gpu in gpus:
            table.add_row(Text(str(gpu)), figures["gpu_util"].get(gpu, "-"),
                          figures["sm"].get(gpu, "-"))
        parts.append(table)
    parts.append(_alerts(snap.get("alerts") or {"alerts": [], "rules": 0}, width or 80))
    collectors = "  ".join(f"{c['name']} {'up' if c['up'] else 'down'}"
                           for c in snap["collectors"])
    parts.append(Text(f"collectors: {collectors}"))
    return Group(*parts)


def run_top(obj: dict, window: str) -> int:
    console = Console()
    try:
        if not console.is_terminal or not sys.stdin.isatty():
            console.print(render(snapshot(obj, window), obj["url"], console.width))
            return EXIT_OK
        return _live(console, obj, window)
    except KeyboardInterrupt:
        return EXIT_OK
    except DaemonError as exc:  # printed after the screen is given back
        Console(stderr=True, soft_wrap=True).print(
            f"ac-observe top: {exc}", highlight=False, markup=False)
        return exc.exit_code


def _live(console: Console, obj: dict, window: str) -> int:
    import termios  # POSIX terminals only: the rest of the CLI starts without them
    import tty
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)  # keys arrive one by one, unechoed
    try:
        with Live(console=console, screen=True, auto_refresh=False) as live:
            due = 0.0
            while True:
                now = time.monotonic()
                if now >= due:
                    live.update(render(snapshot(obj, window), obj["url"], console.width),
                                refresh=True)
                    due = now + 1.0
                ready, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()))
                if ready:
                    key = os.read(fd, 1).lower()
                    if key == b"q":
                        return EXIT_OK
                    if key == b"w":
                        window = WINDOWS[(WINDOWS.index(window) + 1) % len(WINDOWS)]
                        due = 0.0
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _alerts(body: dict, width: int = 80):
    """The drift alerts pending or firing, each value and baseline in its metric's unit."""
    rules = body["rules"]
    if not rules:
        return Text("alerts: no rules (daemon --alerting FILE)")
    if not body["alerts"]:
        return Text(f"alerts: none pending or firing ({rules} rules)")
    return alerts_table(f"alerts ({rules} rules)", body["alerts"], width,
                        lead=(("state", alert_state),), hide_labels=("model",))

