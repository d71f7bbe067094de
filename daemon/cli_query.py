"""The CLI's read side: metric queries, the friendly-name list and status, via the daemon."""
from __future__ import annotations

import json
import time

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

STAT_COLUMNS = ("min", "mean", "p50", "p95", "max", "last")
HISTOGRAM_COLUMNS = ("min_bucket_le", "mean", "p50", "p95", "max_bucket_le", "last")
COLUMN_TITLES = {"min_bucket_le": "min≤", "max_bucket_le": "max≤"}


class DaemonUnreachable(RuntimeError):
    pass


def _get(obj: dict, path: str, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {obj['token']}"} if obj.get("token") else {}
    try:
        return httpx.get(obj["url"] + path, params=params, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise DaemonUnreachable(
            f"cannot reach the ac-observe daemon at {obj['url']} ({exc}); start one with "
            "`ac-observe daemon` or `ac-observe up`, or point --daemon / AC_OBSERVE_URL at it")


def _fail(console: Console, message: str) -> int:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    return 1


def format_value(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ns":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "ms":
        return f"{value:.3f}"
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or suffix == "TiB":
                return f"{value:.1f} {suffix}" if suffix != "B" else f"{value:.0f} B"
            value /= 1024
    return f"{value:.4g}"


def _table(result: dict) -> Table:
    unit = result["unit"]
    series_list = result["series"]
    # Labels shared by every series go in the title; the rows show only what differs.
    common = dict(series_list[0]["labels"]) if series_list else {}
    for series in series_list[1:]:
        common = {k: v for k, v in common.items() if series["labels"].get(k) == v}
    shared = " ".join(f"{k}={v}" for k, v in sorted(common.items()))
    table = Table(title=f"{result['metric']} ({unit}) over {result['window_seconds']:g}s"
                        + (f"\n{shared}" if shared else ""))
    # A histogram has no extremes, only the buckets that bound them.
    columns = HISTOGRAM_COLUMNS if result["kind"] == "histogram" else STAT_COLUMNS
    table.add_column("series")
    for key in columns:
        table.add_column(COLUMN_TITLES.get(key, key), justify="right")
    table.add_column("n", justify="right")
    for series in series_list:
        name = ",".join(f"{k}={v}" for k, v in sorted(series["labels"].items())
                        if k not in common) or "all"
        table.add_row(name, *(format_value(series[c], unit) for c in columns),
                      str(series["samples"]))
    if not result["series"]:
        table.caption = "no data in this window yet"
    return table


def show_metric(obj: dict, metric: str, window: str, labels: str, as_json: bool,
                watch: bool) -> int:
    console = Console()
    try:
        def fetch():
            response = _get(obj, "/api/v1/query", metric=metric, window=window, labels=labels)
            body = response.json()
            if response.status_code != 200:
                raise ValueError(body.get("error", response.text))
            return body

        if as_json:  # one JSON document per line, every 2 s with --watch
            while True:
                print(json.dumps(fetch()), flush=True)
                if not watch:
                    return 0
                time.sleep(2)
        if not watch:
            console.print(_table(fetch()))
            return 0
        with Live(_table(fetch()), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(2)
                live.update(_table(fetch()))
    except KeyboardInterrupt:
        return 0
    except (DaemonUnreachable, ValueError) as exc:
        message = str(exc)
        if "unknown metric" in message:
            message += " (see `ac-observe --list`)"
        return _fail(console, message)


def list_metrics(obj: dict, as_json: bool) -> int:
    console = Console()
    try:
        metrics = _get(obj, "/api/v1/metrics").json()["metrics"]
    except DaemonUnreachable:
        from ac_observe.daemon.query import describe_friendly  # known without a daemon
        metrics = describe_friendly()
    if as_json:
        print(json.dumps(metrics))
        return 0
    table = Table(title="metrics")
    for column in ("name", "unit", "kind", "source", "help"):
        table.add_column(column)
    for m in metrics:
        table.add_row(m["name"], m["unit"], m["kind"], m["source"], m["help"])
    console.print(table)
    return 0


def show_status(obj: dict, as_json: bool) -> int:
    console = Console()
    try:
        status = _get(obj, "/api/v1/status").json()
    except DaemonUnreachable as exc:
        return _fail(console, str(exc))
    if as_json:
        print(json.dumps(status))
        return 0
    console.print(f"ac-observe daemon {status['version']} at {obj['url']}  "
                  f"interval {status['interval_seconds']:g}s  window {status['window_seconds']:g}s")
    table = Table(title="collectors")
    for column in ("collector", "state", "reason", "errors", "last run"):
        table.add_column(column)
    for c in status["collectors"]:
        table.add_row(c["name"], "[green]up[/green]" if c["up"] else "[red]down[/red]",
                      c["reason"], str(c["errors_total"]), f"{c['duration_seconds'] * 1e3:.1f} ms")
    console.print(table)
    table = Table(title=f"engines under {status['telemetry_root']}")
    for column in ("engine", "model", "pid", "api", "state", "heartbeat"):
        table.add_column(column)
    for e in status["engines"]:
        table.add_row(str(e["engine"]), str(e["model"]), str(e["pid"]), str(e["api_address"]),
                      "[green]alive[/green]" if e["alive"] else "[yellow]gone[/yellow]",
                      f"{e['heartbeat_age_seconds']}s ago")
    if not status["engines"]:
        table.caption = "no engine found"
    console.print(table)
    return 0
