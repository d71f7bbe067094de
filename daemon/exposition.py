"""Prometheus text format (0.0.4) for the daemon's snapshot, fast enough for 10k series.

Each series' `name{labels} ` prefix is escaped once and cached across cycles, so a render
costs one value format per sample. Output is prometheus_client's `generate_latest`
format (labels in the collector's order, `le` last).
"""
from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class Renderer:
    def __init__(self):
        self._prefixes: dict[tuple, str] = {}

    def render(self, families: list[Metric]) -> bytes:
        prefixes = self._prefixes
        if len(prefixes) > 200_000:  # label churn: start over rather than grow forever
            prefixes.clear()
        out: list[str] = []
        for family in families:
            name = family.name + "_total" if family.type == "counter" else family.name
            out.append(f"# HELP {name} {_escape_help(family.documentation)}\n"
                       f"# TYPE {name} {family.type}\n")
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                prefix = prefixes.get(key)
                if prefix is None:
                    if sample.labels:
                        labels = ",".join(f'{k}="{_escape_label(str(v))}"'
                                          for k, v in sample.labels.items())
                        prefix = f"{sample.name}{{{labels}}} "
                    else:
                        prefix = f"{sample.name} "
                    prefixes[key] = prefix
                out.append(prefix + floatToGoString(sample.value) + "\n")
        return "".join(out).encode("utf-8")
