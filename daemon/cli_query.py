"""The CLI's read side: metric queries, the friendly-name list and status, via the daemon."""
from __future__ import annotations

import json
import os
import sys
import time

import httpx
from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ac_observe.daemon.cli_render import alert_state, alerts_table, fitted, metric_table


class DaemonError(RuntimeError):
    """The daemon cannot answer: one line saying why and what to do."""


class DaemonUnreachable(DaemonError):
    pass


def get_json(obj: dict, path: str, expect: str, **params) -> dict:
    """GET a daemon route; its JSON body, which must hold the key `expect`."""
    url = obj["url"]
    headers = {}
    if obj.get("token"):
        headers["Authorization"] = b"Bearer " + obj["token"].encode("utf-8")
    try:
        response = httpx.get(url + path, params=params, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise DaemonUnreachable(
            f"cannot reach the ac-observe daemon at {url} ({type(exc).__name__}); start one "
            "with `ac-observe daemon` or `ac-observe up`, or point --daemon / AC_OBSERVE_URL "
            "at it") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 401:
        raise DaemonError(f"the daemon at {url} refused the token" if obj.get("token") else
                          f"the daemon at {url} wants a bearer token: pass --token-file, "
                          "or set AC_OBSERVE_TOKEN")
    if response.status_code == 403:
        raise DaemonError(f"the daemon at {url} refused access (HTTP 403)")
    ours = isinstance(body, dict) and (
        expect in body if response.status_code == 200 else isinstance(body.get("error"), str))
    if not ours:
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise DaemonError(f"{url} does not answer like an ac-observe daemon "
                          f"(HTTP {response.status_code}, {kind}); check --daemon")
    if response.status_code != 200:
        raise DaemonError(str(body.get("error", f"HTTP {response.status_code}")))
    return body


def _fail(console: Console, message: str) -> int:
    """One line on stderr, never wrapped."""
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}",
                                               highlight=False)
    return 1


def show_metric(obj: dict, metric: str, window: str, labels: str, as_json: bool,
                watch: bool, at: str | None = None) -> int:
    console = Console()
    try:
        def fetch():
            return get_json(obj, "/api/v1/query", "series", metric=metric, window=window,
                            labels=labels, **({"at": at} if at else {}))

        if as_json:  # one JSON document per line, every 2 s with --watch
            while True:
                print(json.dumps(fetch()), flush=True)
                if not watch:
                    return 0
                time.sleep(2)
        if not watch:
            console.print(metric_table(fetch(), console.width), end="", soft_wrap=True)
            return 0
        if not console.is_terminal:  # a pipe or a file: one plain frame after another
            while True:
                console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", highlight=False)
                console.print(metric_table(fetch(), console.width), end="", soft_wrap=True)
                console.file.flush()
                time.sleep(2)
        # Redrawn in place (no flicker), resized with the terminal.
        with Live(metric_table(fetch(), console.width), console=console,
                  refresh_per_second=4, auto_refresh=False) as live:
            while True:
                time.sleep(2)
                live.update(metric_table(fetch(), console.width), refresh=True)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `--watch | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return 0
    except DaemonError as exc:
        message = str(exc)
        if "unknown metric" in message:
            message += " (see `ac-observe --list`)"
        return _fail(console, message)


def list_metrics(obj: dict, as_json: bool) -> int:
    console = Console()
    try:
        metrics = get_json(obj, "/api/v1/metrics", "metrics")["metrics"]
    except DaemonError:
        from ac_observe.daemon.query import describe_friendly  # known without a daemon
        metrics = describe_friendly()
    if as_json:
        print(json.dumps(metrics))
        return 0
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
    return 0


def show_status(obj: dict, as_json: bool) -> int:
    console = Console()
    try:
        status = get_json(obj, "/api/v1/status", "collectors")
    except DaemonError as exc:
        return _fail(console, str(exc))
    if as_json:
        print(json.dumps(status))
        return 0
    console.print(f"ac-observe daemon {status['version']} at {obj['url']}  "
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
    rows = []
    for e in status["engines"]:
        # The engine's name, then its model and API address under it (whole: what a
        # user types next).
        name = Text(str(e["engine"]))
        name.append(f"\n{e['model']}" + (f"\n{e['api_address']}" if e["api_address"] else ""),
                    style="dim")
        if e.get("error"):
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
        rows.append((name, str(e["pid"]), state, "-" if age is None else f"{age}s ago"))

    def engines_table(first_width: int, fits: bool) -> Table:
        table = Table(title=escape(f"engines under {status['telemetry_root']}"),
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
    return 0


WAITING_SHOWN = 10  # series listed as waiting under the alerts table


def show_alerts(obj: dict, history: bool, as_json: bool) -> int:
    console = Console()
    try:
        body = get_json(obj, "/api/v1/alerts", "alerts", history="1" if history else "0")
    except DaemonError as exc:
        return _fail(console, str(exc))
    if as_json:
        print(json.dumps(body))
        return 0
    if not body["rules"]:
        console.print("no alert rules (start the daemon with --alerting FILE)")
        return 0
    console.print(alerts_table(
        f"alerts ({body['rules']} rules)", body["alerts"], console.width,
        lead=(("state", alert_state),),
        trail=(("severity", lambda a: a["severity"]),
               ("since", lambda a: _clock(a["firing_since"] or a["active_since"],
                                          "%H:%M:%S"))))
        if body["alerts"] else "no alert pending or firing")
    waiting = body.get("waiting", [])  # a rule that cannot fire yet says why
    for entry in waiting[:WAITING_SHOWN]:
        labels = ",".join(f"{k}={v}" for k, v in sorted(entry["labels"].items()))
        console.print(Text(f"{entry['rule']} {{{labels}}} waits: {entry['waiting_for']}",
                           style="dim"))
    if len(waiting) > WAITING_SHOWN:
        console.print(Text(f"and {len(waiting) - WAITING_SHOWN} more series waiting "
                           "(ac-observe alerts --json)", style="dim"))
    if history:
        console.print(alerts_table("latest transitions", body["history"], console.width,
                                   lead=(("at", lambda t: _clock(t["at"], "%m-%d %H:%M:%S")),
                                         ("change", lambda t: f"{t['from_state']} → "
                                                              f"{t['to_state']}"))))
    return 0



def _clock(at: float | None, layout: str) -> str:
    return time.strftime(layout, time.localtime(at)) if at else ""
