"""Prometheus text format (0.0.4) for the daemon's snapshot, fast enough for 10k series.

Each series' `name{labels} ` prefix is escaped once and cached across cycles, so a render
costs one value format per sample. Output is prometheus_client's `generate_latest`
format (labels in the collector's order, `le` last), after the daemon's own labels.

NOTE: the daemon's own labels (`node`) are added here, once, to every series, as
Prometheus adds its external labels: no collector carries them, and one a collector gave
of the same name is replaced.
"""
from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class Renderer:
    def __init__(self, own_labels: dict[str, str] | None = None):
        self.own_labels = dict(own_labels or {})
        self._own = ",".join(f'{k}="{_escape_label(v)}"' for k, v in self.own_labels.items())
        self._prefixes: dict[tuple, str] = {}
        # The last render's lines by the Sample they came from: a collector that hands
        # over the same Sample object for a series that did not move (the engine
        # collector) gets its line back with one lookup. The Sample is held with its line,
        # so its id cannot be reused while the entry stands.
        self._lines: dict[int, tuple] = {}

    def render(self, families: list[Metric]) -> bytes:
        prefixes, lines = self._prefixes, self._lines
        # Label churn (engines, pids come and go): once most prefixes are of series gone,
        # start over rather than hold every series ever seen.
        if len(prefixes) > max(2 * len(lines), 10_000):
            prefixes.clear()
        kept: dict[int, tuple] = {}
        out: list[str] = []
        # Two collectors may give one family (the bundled engine's and a scraped vLLM's
        # ac_inference_latency_seconds): one HELP and TYPE, then both's samples.
        by_name: dict[str, list[Metric]] = {}
        for family in families:
            by_name.setdefault(family.name, []).append(family)
        for same in by_name.values():
            family = same[0]
            name = family.name + "_total" if family.type == "counter" else family.name
            out.append(f"# HELP {name} {_escape_help(family.documentation)}\n"
                       f"# TYPE {name} {family.type}\n")
            for sample in (s for f in same for s in f.samples):
                made = lines.get(id(sample))
                if made is not None and made[0] is sample:
                    line = made[1]
                else:
                    key = (sample.name, tuple(sample.labels.items()))
                    prefix = prefixes.get(key)
                    if prefix is None:
                        prefix = prefixes[key] = self._prefix(sample.name, sample.labels)
                    line = prefix + floatToGoString(sample.value) + "\n"
                    made = (sample, line)
                kept[id(sample)] = made
                out.append(line)
        self._lines = kept
        return "".join(out).encode("utf-8")

    def _prefix(self, name: str, labels: dict) -> str:
        own = self.own_labels
        parts = [self._own] if own else []
        parts += [f'{k}="{_escape_label(str(v))}"' for k, v in labels.items() if k not in own]
        return f"{name}{{{','.join(parts)}}} " if parts else f"{name} "
