"""ScrapeCollector: vLLM and SGLang servers read over HTTP, each endpoint's families put
into the contract's names by the mapping table (collectors/scrape/table.py).

NOTE: each endpoint is read on its own, all at once, and judged whole: one that fails in
any way (timeout, not Prometheus text, a body too big, a family of the wrong type, NaN, a
histogram whose buckets go down) is down with the reason in `status` and exports nothing
this cycle; the other endpoints' series are untouched. Histograms keep the engine's own
bucket edges; counters are passed on as the engine counts them, so a restart (a counter
going back) is a reset the daemon's windows and Prometheus both read as such.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from ac_observe import metrics as m
from ac_observe.collectors.base import Collector, CollectorUnavailable, register
from ac_observe.collectors.scrape.discovery import FoundEngine, discover
from ac_observe.collectors.scrape.fetch import ScrapeFailed, fetch_text, parse_text
from ac_observe.collectors.scrape.table import MODEL_LABEL, RANK_LABEL, TABLES, Row, kind_of
from ac_observe.outage import Outage

log = logging.getLogger(__name__)

OUT_LABELS = ("engine", "model", m.KIND_LABEL, m.PID_LABEL)
MAX_SERIES_PER_ENDPOINT = 5000


@dataclass(slots=True)
class EndpointState:
    name: str
    url: str
    kind: str = ""
    model: str = ""
    up: bool = False
    reason: str = "not scraped yet"
    last_ok: float | None = None
    # The log's account: one line when it goes away, a reminder, one when it is back.
    outage: Outage = field(init=False)

    def __post_init__(self) -> None:
        self.outage = Outage(f"engine endpoint {self.name}",
                             "its series are left out until it answers", log)


# (contract family, (engine, model, kind, pid)) -> a gauge's or counter's value, or a
# histogram's ({le: count}, sum). pid is "" where the daemon does not know it (a listed
# endpoint): that series has no pid label.
Values = dict[tuple[str, tuple[str, str, str, str]], object]


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise ScrapeFailed(f"{what} is {value}")
    return value


def _series_labels(name: str, kind: str, labels: dict, pid: str) -> tuple[str, str, str, str]:
    rank = labels.get(RANK_LABEL, "")
    engine = name if rank in ("", "0") else f"{name}/{rank}"
    return engine, labels.get(MODEL_LABEL, ""), kind, pid


def map_families(name: str, families: dict[str, Metric], pid: str = "") -> tuple[str, Values]:
    """(kind, the endpoint's values in the contract's families, with `pid` where the
    daemon knows the server's process); ScrapeFailed when the families are not a vLLM's
    or an SGLang's, or any mapped one is malformed."""
    kind = kind_of(families)
    if kind is None:
        raise ScrapeFailed("no vllm: or sglang: families (not a vLLM or SGLang /metrics)")
    values: Values = {}
    fed: set[str] = set()
    counts: dict[tuple, int] = {}  # how many source series a ratio gauge averages
    for row in TABLES[kind]:
        family = families.get(row.source)
        if family is None or row.target.name in fed:
            continue
        if family.type != row.type:
            raise ScrapeFailed(f"{row.source} is a {family.type}, not a {row.type}")
        fed.add(row.target.name)
        if row.type == m.HISTOGRAM:
            _add_histogram(name, kind, row, family, values, pid)
        else:
            _add_scalar(name, kind, row, family, values, counts, pid)
    if len(values) > MAX_SERIES_PER_ENDPOINT:
        raise ScrapeFailed(f"over {MAX_SERIES_PER_ENDPOINT} series")
    for key, n in counts.items():
        values[key] = values[key] / n  # type: ignore[operator]
    return kind, values


def _add_scalar(name: str, kind: str, row: Row, family: Metric, values: Values,
                counts: dict, pid: str) -> None:
    suffix = "_total" if row.type == m.COUNTER else ""
    for sample in family.samples:
        if sample.name != row.source + suffix:
            continue  # a counter's _created
        value = _finite(sample.value, f"{sample.name}")
        if row.negative_is_absent and value < 0:
            continue
        if row.type == m.COUNTER and value < 0:
            raise ScrapeFailed(f"{sample.name} is negative")
        key = (row.target.name, _series_labels(name, kind, sample.labels, pid))
        values[key] = values.get(key, 0.0) + value  # type: ignore[operator]
        if row.target.unit == "ratio":  # a share: the ranks' mean, not their sum
            counts[key] = counts.get(key, 0) + 1


def _add_histogram(name: str, kind: str, row: Row, family: Metric, values: Values,
                   pid: str) -> None:
    per_series: dict[tuple, tuple[dict[float, float], list[float]]] = {}
    for sample in family.samples:
        if sample.name not in (row.source + "_bucket", row.source + "_sum"):
            continue
        labels = dict(sample.labels)
        le = labels.pop("le", None)
        key = (row.target.name, _series_labels(name, kind, labels, pid))
        buckets, total = per_series.setdefault(key, ({}, [0.0]))
        value = _finite(sample.value, sample.name)
        if sample.name.endswith("_sum"):
            total[0] += value
            continue
        try:
            bound = float(le)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ScrapeFailed(f"{sample.name} has a bad le {str(le)[:20]!r}") from None
        if math.isnan(bound):
            raise ScrapeFailed(f"{sample.name} has le NaN")
        buckets[bound] = buckets.get(bound, 0.0) + value
    for key, (buckets, total) in per_series.items():
        edges = sorted(buckets)
        if not edges or not math.isinf(edges[-1]):
            raise ScrapeFailed(f"{row.source} has no +Inf bucket")
        counts = [buckets[e] for e in edges]
        if any(b < a for a, b in zip(counts, counts[1:], strict=False)) or counts[0] < 0:
            raise ScrapeFailed(f"{row.source}'s buckets are not cumulative")
        values[key] = (dict(zip(edges, counts, strict=True)), total[0])


def _labels(labels: tuple[str, ...]) -> dict[str, str]:
    """A series' labels; no pid label where it is not known."""
    return {k: v for k, v in zip(OUT_LABELS, labels, strict=True)
            if v or k != m.PID_LABEL}


def _families(values: Values) -> list[Metric]:
    out: dict[str, Metric] = {}
    for (target, labels), value in sorted(values.items()):
        spec = m.BY_NAME[target]
        family = out.get(target)
        if family is None:
            family = out[target] = Metric(spec.family, spec.help, spec.type)
        series = _labels(labels)
        if spec.type == m.HISTOGRAM:
            buckets, total = cast(tuple[dict[float, float], float], value)
            for le, count in buckets.items():
                family.add_sample(spec.family + "_bucket",
                                  {**series, "le": floatToGoString(le)}, count)
            family.add_sample(spec.family + "_count", series, buckets[math.inf])
            family.add_sample(spec.family + "_sum", series, total)
        else:
            suffix = "_total" if spec.type == m.COUNTER else ""
            family.add_sample(spec.family + suffix, series, cast(float, value))
    return list(out.values())


@register("scrape")
class ScrapeCollector(Collector):
    def __init__(self, config, proc: Path = Path("/proc")):
        self.listed: tuple[tuple[str, str], ...] = tuple(config.engine_endpoints)
        self.endpoints = self.listed
        self.discovery = config.engine_discovery
        self.proc = proc
        # Each endpoint within its own deadline, inside the collector's.
        self.scrape_timeout = max(0.05, 0.8 * config.collector_timeout_seconds)
        self.timeout_seconds = config.collector_timeout_seconds
        self.states = {name: EndpointState(name, url) for name, url in self.endpoints}
        self.pids: dict[str, int] = {}  # a discovered engine's process
        self.found: dict[str, FoundEngine] = {}  # a discovered engine's processes
        workers = 16 if self.discovery else max(1, min(16, len(self.endpoints)))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ac-scrape")
        self._back: list[dict[str, str]] = []
        self._in_flight: dict[str, Future] = {}  # each endpoint's latest scrape

    def _discover(self) -> None:
        """The listed endpoints and the server processes found now; a process that
        exited is dropped, its series with it."""
        found = {f.name: f for f in discover(self.proc)}
        self.pids = {name: f.pid for name, f in found.items()}
        self.found = dict(found)
        listed = {name for name, _ in self.listed}
        self.endpoints = self.listed + tuple((name, f.url) for name, f in found.items()
                                             if name not in listed)
        current = {name for name, _ in self.endpoints}
        for name in list(self.states):
            if name not in current:
                del self.states[name]
        for name, url in self.endpoints:
            if name not in self.states or self.states[name].url != url:
                self.states[name] = EndpointState(name, url)

    def counted_before_seen(self) -> list[dict[str, str]]:
        return self._back

    def _scrape(self, url: str):
        return parse_text(fetch_text(url, self.scrape_timeout))

    def collect(self) -> list[Metric]:
        if self.discovery:
            self._discover()
        elif not self.endpoints:
            raise CollectorUnavailable("no engine endpoints (--engine-endpoint URL)")
        # An endpoint whose last scrape is still out (its headers dripping in) gets no
        # new one: it holds one worker at most, and the others are answered in time.
        deadline = time.monotonic() + self.scrape_timeout + 0.1 * self.timeout_seconds
        for name, url in self.endpoints:
            previous = self._in_flight.get(name)
            if previous is None or previous.done():
                self._in_flight[name] = self._pool.submit(self._scrape, url)
        current = {name for name, _ in self.endpoints}
        self._in_flight = {n: f for n, f in self._in_flight.items() if n in current}
        values: Values = {}
        up = Metric(m.ENGINE_UP.family, m.ENGINE_UP.help, m.GAUGE)
        self._back = []
        now = time.time()
        for name, future in self._in_flight.items():
            state = self.states[name]
            was_up = state.up
            pid = str(self.pids.get(name, ""))
            try:
                families = future.result(timeout=max(0.0, deadline - time.monotonic()))
                kind, mine = map_families(name, families, pid)
            except FutureTimeout:
                state.up = False
                state.reason = f"timed out after {self.scrape_timeout:g}s"
            except ScrapeFailed as exc:
                state.up, state.reason = False, str(exc)
            except Exception as exc:  # a parser surprise is this endpoint's alone
                state.up, state.reason = False, f"not Prometheus text: {type(exc).__name__}"
            else:
                state.outage.ok()
                models = sorted({labels[1] for _, labels in mine if labels[1]})
                state.up, state.reason, state.kind = True, "", kind
                state.model, state.last_ok = ", ".join(models), now
                values.update(mine)
                if not was_up:  # back after an outage: its counters have a past
                    self._back.append({"engine": name})
            if not state.up:
                state.outage.failed(state.reason)
            up.add_sample(m.ENGINE_UP.family,
                          _labels((name, state.model, state.kind, pid)), 1.0 if state.up else 0.0)
        processes = [self._processes()] if self.discovery else []
        return [*_families(values), up, *processes]

    def _processes(self) -> Metric:
        """ac_engine_process: each discovered server's pid and its descendants'."""
        family = Metric(m.ENGINE_PROCESS.family, m.ENGINE_PROCESS.help, m.GAUGE)
        for name, found in sorted(self.found.items()):
            for role, pids in (("server", (found.pid,)), ("child", found.children)):
                for pid in pids:
                    family.add_sample(family.name, {"engine": name, "kind": found.kind,
                                                    "pid": str(pid), "role": role}, 1.0)
        return family

    def status(self) -> list[dict]:
        return [{"engine": s.name, "model": s.model, "kind": s.kind or None,
                 "pid": self.pids.get(s.name),
                 "api_address": s.url, "endpoint": s.url, "alive": s.up,
                 "error": s.reason if not s.up else "", "warning": "",
                 "restarts": 0, "heartbeat_age_seconds":
                     round(time.time() - s.last_ok, 1) if s.last_ok else None,
                 "directory": s.url}
                for s in self.states.values()]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
