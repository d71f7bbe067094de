"""How the CLI shows figures: numbers scaled for reading, sparklines, and tables that fit
any terminal from 60 columns up without cutting a number or a label.

NOTE: output goes through a rich Console, so NO_COLOR and pipes (no terminal) give plain
text without escape codes; `--json` never comes here and stays raw.
"""
from __future__ import annotations

import math
import time

from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"
STAT_COLUMNS = ("min", "mean", "p50", "p95", "max", "last")
HISTOGRAM_COLUMNS = ("min_bucket_le", "mean", "p50", "p95", "max_bucket_le", "last")
COLUMN_TITLES = {"min_bucket_le": "min≤", "max_bucket_le": "max≤"}
_TIME_STEPS = ((1e9, "s"), (1e6, "ms"), (1e3, "µs"), (1.0, "ns"))
_TIME_IN_NS = {"ns": 1.0, "ms": 1e6, "s": 1e9}
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_SHORT_UNITS = {"levels": "lvl", "requests": "req"}  # cells stay narrow
_COUNTS = {"requests"}  # a whole count shows as one (3 req); a mean keeps 3 digits


def _three(value: float) -> str:
    """Three significant digits, never in exponent form for the ranges shown here."""
    if value == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    text = f"{value:.{digits}f}"
    if float(text) >= 1000 and digits == 0:  # rounding crossed into four digits
        return f"{value:.0f}"
    return text


def human(value, unit: str) -> str:  # noqa: C901 - one branch per kind of unit
    """A figure in its metric's unit, scaled for reading: 9.87 ms, 41.2%, 1.50 GiB."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    if unit in _TIME_IN_NS:
        ns = value * _TIME_IN_NS[unit]
        for size, name in _TIME_STEPS:
            if abs(ns) >= size or name == "ns":
                return f"{_three(ns / size)} {name}"
    if unit == "%":
        return f"{_three(value)}%"
    if unit == "B":
        for name in _BINARY:
            if abs(value) < 1024 or name == _BINARY[-1]:
                return f"{_three(value)} {name}"
            value /= 1024
    if unit == "Hz":
        for size, prefix in _DECIMAL:
            if abs(value) >= size:
                return f"{_three(value / size)} {prefix}Hz"
        return f"{_three(value)} Hz"
    if unit in _COUNTS and float(value).is_integer() and abs(value) < 1000:
        return f"{int(value)} {_SHORT_UNITS.get(unit, unit)}"  # 3 req, not 3.00 req
    unit = _SHORT_UNITS.get(unit, unit)
    for size, prefix in _DECIMAL:
        if abs(value) >= size:
            return f"{_three(value / size)}{prefix} {unit}".rstrip()
    return f"{_three(value)} {unit}".rstrip()


def sparkline(values: list, width: int | None = None) -> str:
    """Block characters from the lowest value to the highest; a gap where there was none.
    With `width` the slots are merged (averaged) down to that many characters."""
    if width is not None and width < len(values):
        per = len(values) / width
        merged = []
        for i in range(width):
            part = [v for v in values[int(i * per):int((i + 1) * per)] if v is not None]
            merged.append(sum(part) / len(part) if part else None)
        values = merged
    present = [v for v in values if v is not None and math.isfinite(v)]
    if not present:
        return " " * len(values)
    low, high = min(present), max(present)
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif high == low:  # flat: at the bottom when nothing happened, else midway
            out.append(SPARK[0] if high == 0 else SPARK[len(SPARK) // 2])
        else:
            out.append(SPARK[round((v - low) / (high - low) * (len(SPARK) - 1))])
    return "".join(out)


def metric_table(result: dict, width: int) -> Text:
    """A query answer as lines of at most `width` columns (60 and up): one line per series
    when its labels fit beside the numbers, else the labels (and trend) on a line of their
    own above them. Numbers are never cut, labels never abbreviated."""
    unit, series_list = result["unit"], result["series"]
    columns = HISTOGRAM_COLUMNS if result["kind"] == "histogram" else STAT_COLUMNS
    common = dict(series_list[0]["labels"]) if series_list else {}
    for series in series_list[1:]:
        common = {k: v for k, v in common.items() if series["labels"].get(k) == v}
    out = Text()
    out.append(f"{result['metric']} over {result['window_seconds']:g}s", style="bold")
    out.append(f"  (unit {unit}, scaled for reading)\n" if unit else "\n", style="dim")
    if result.get("history"):
        out.append(f"from the store's history: 1-minute points, "
                   f"{100 * result.get('coverage', 0):.0f} % of the window covered\n",
                   style="dim")
    if common:
        out.append(" ".join(f"{k}={v}" for k, v in sorted(common.items())) + "\n")
    # An engine whose kind never exports the figure (a vLLM's stream utilisation): said.
    missing = Text("".join(f"{e['engine']} ({e['kind']}): {e['reason']}\n"
                           for e in result.get("not_exported") or []), style="dim")
    if not series_list:
        if not missing:
            out.append("no data in this window yet\n", style="dim")
        return out + missing
    # What a ratio is counted in, where engines differ (blocks, tokens, the engine's gauge).
    basis = any(series.get("basis") for series in series_list)
    rows = []
    for series in series_list:
        label = ",".join(f"{k}={v}" for k, v in sorted(series["labels"].items())
                         if k not in common) or "all"
        cells = [human(series.get(c), unit) for c in columns] + [str(series["samples"])]
        cells += [series.get("basis") or ""] if basis else []
        rows.append((label, cells, series.get("trend") or []))
    titles = [COLUMN_TITLES.get(c, c) for c in columns] + ["n"] + (["basis"] if basis else [])
    widths = [max(len(t), *(len(cells[i]) for _, cells, _ in rows))
              for i, t in enumerate(titles)]
    sep = "  " if sum(widths) + 2 * (len(widths) - 1) <= width else " "
    numbers = sum(widths) + len(sep) * (len(widths) - 1)
    label_width = max(len("series"), *(len(label) for label, _, _ in rows))
    spark = 24 if numbers + label_width + 28 <= width else 12
    one_line = label_width + 2 + numbers + 2 + spark <= width

    def number_line(cells) -> str:
        return sep.join(cell.rjust(w) for cell, w in zip(cells, widths, strict=False))

    header = number_line(titles)
    if one_line:
        out.append(f"{'series'.ljust(label_width)}  {header}  {'trend'}\n", style="bold")
        for label, cells, values in rows:
            out.append(f"{label.ljust(label_width)}  {number_line(cells)}  ")
            out.append(sparkline(values, spark) + "\n", style="cyan")
        return out + missing
    out.append(f"{header}\n", style="bold")
    for label, cells, values in rows:
        out.append(label, style="bold")  # whole: the terminal wraps it, never cuts it
        gap = width - len(label) - spark
        out.append(" " * gap if gap >= 2 else "\n")
        out.append(sparkline(values, spark) + "\n", style="cyan")
        out.append(f"{number_line(cells)}\n")
    return out + missing


def _alert_unit(entry: dict) -> str:
    """The unit of an alert's value and baseline: its statistic's, in its metric's unit."""
    from ac_observe.friendly import FRIENDLY
    friendly = FRIENDLY.get(entry.get("metric", ""))
    return friendly.statistic_unit(entry.get("statistic", "")) if friendly else ""


def alert_state(alert: dict) -> Text:
    """pending or firing (and "no data"), in yellow or red."""
    return Text(alert["state"] + ("\n(no data)" if alert["no_data"] else ""),
                style="red" if alert["state"] == "firing" else "yellow")


def alerts_table(title: str, entries: list[dict], width: int, lead: tuple = (),
                 trail: tuple = (), hide_labels: tuple = ()):
    """Alerts (or their transitions) as a table: the rule with its labels on the lines
    under it, the `lead` columns ((title, cell of an entry) pairs), the value and baseline
    in the metric's unit, then the `trail` columns. Figures never wrap; the rule column
    gets what the others leave of `width`, so rule names and label sets (two alerts of one
    rule differ only there) are whole at 80 columns, and narrower they fold rather than
    any figure being cut (past the rule's minimum, the trailing columns go first)."""
    from rich import box
    from rich.table import Table
    rows = []
    for entry in entries:
        unit = _alert_unit(entry)
        rule = Text(entry["rule"])
        labels = " ".join(f"{k}={v}" for k, v in sorted(entry["labels"].items())
                          if k not in hide_labels)
        if labels:
            rule.append("\n" + labels, style="dim")
        rows.append((rule, [cell(entry) for _, cell in lead],
                     [human(entry["value"], unit), human(entry["baseline"], unit)],
                     [cell(entry) for _, cell in trail]))

    def table_for(rule_width: int, fits: bool):
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        table.add_column("rule, labels", overflow="fold", width=rule_width)
        for name, _ in lead:
            table.add_column(name, overflow="fold", no_wrap=fits)
        for name in ("value", "baseline"):
            table.add_column(name, justify="right", no_wrap=True)
        for name, _ in trail:
            table.add_column(name, overflow="fold", no_wrap=fits)
        for rule, first, figures, last in rows:
            table.add_row(rule, *first, *figures, *last)
        return table
    return fitted(table_for, [r[0] for r in rows], width)


def fitted(table_for, first_cells: list, width: int):
    """A table whose first column (as wide as its longest line among `first_cells` at most)
    takes what the other columns leave of `width`: table_for(first column's width,
    whether the others fit unwrapped). The room is measured by rich itself; left to
    share, rich shrinks columns in proportion and cuts the last ones. Below 12 columns of
    room the others wrap too."""
    import io

    from rich.console import Console
    longest = max([12] + [len(line) for cell in first_cells for line in str(cell).split("\n")])
    probe = Console(width=10_000, file=io.StringIO()).measure(table_for(1, True)).maximum
    room = width - (probe - 1)
    return table_for(max(12, min(longest, room)), room >= 12)


def print_error(message: str) -> None:
    """`error: MESSAGE` on stderr: one line, never wrapped."""
    from rich.console import Console
    from rich.markup import escape
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}",
                                               highlight=False)


def clock(at: float | None, layout: str) -> str:
    """A unix time as local clock time in `layout`; empty for none."""
    return time.strftime(layout, time.localtime(at)) if at else ""
