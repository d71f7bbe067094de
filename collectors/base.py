"""What a collector is, and the registry that names them (node_exporter style).

A collector yields freshly built metric families on every `collect()` call, so a source
that vanished takes its series with it. It signals "cannot run here" by raising
`CollectorUnavailable` with a reason a user can act on; any other exception is an error.
Families are built from the metric contract (`new_counter`, `new_gauge`, `new_histogram`:
each refuses a spec of another type), never declared by hand.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ac_observe.metrics import COUNTER, GAUGE, HISTOGRAM, MetricSpec

REGISTRY: dict[str, Callable[..., Collector]] = {}
BUILTIN = ("engine", "nvml", "ebpf", "scrape")
_FAMILY_CLASSES = {COUNTER: CounterMetricFamily, GAUGE: GaugeMetricFamily,
                   HISTOGRAM: HistogramMetricFamily}
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)


class CollectorUnavailable(RuntimeError):
    """The source is not present (no GPU, no driver, no privileges): down, with a reason."""


class Collector:
    name: str = ""
    timeout_seconds: float = 2.0

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError

    def counted_before_seen(self) -> list[dict[str, str]]:
        """Label sets (each a subset of a series' labels) of the series new in the last
        collect() that counted before this collector could see them: their counters' first
        values are bases, not increases from zero. (A collector's first cycle up, and its
        first after an outage, count so whole; the daemon sees to that.)"""
        return []

    def close(self) -> None:
        pass


def new_family(spec: MetricSpec) -> Metric:
    """An empty family of the contract, of its type (new_counter & co. to fill one)."""
    return _FAMILY_CLASSES[spec.type](spec.family, spec.help, labels=spec.labels)


def _typed_family(spec: MetricSpec, cls: type[Family]) -> Family:
    if _FAMILY_CLASSES[spec.type] is not cls:
        raise TypeError(f"{spec.family} is a {spec.type}, not a {cls.__name__}")
    return cls(spec.family, spec.help, labels=spec.labels)


def new_counter(spec: MetricSpec) -> CounterMetricFamily:
    """An empty counter of the contract, to fill with `add_metric(labels, value)`."""
    return _typed_family(spec, CounterMetricFamily)


def new_gauge(spec: MetricSpec) -> GaugeMetricFamily:
    """An empty gauge of the contract, to fill with `add_metric(labels, value)`."""
    return _typed_family(spec, GaugeMetricFamily)


def new_histogram(spec: MetricSpec) -> HistogramMetricFamily:
    """An empty histogram of the contract, to fill with `add_metric(labels, buckets,
    sum_value)`."""
    return _typed_family(spec, HistogramMetricFamily)


def register(name: str):
    """Class decorator: make a collector constructible by name (`--collectors`)."""
    def wrap(factory):
        factory.name = name
        REGISTRY[name] = factory
        return factory
    return wrap


def build(names: Iterable[str], **options) -> list[Collector]:
    for module in BUILTIN:  # registration side effects
        importlib.import_module(f"ac_observe.collectors.{module}")
    collectors_ = []
    for name in names:
        if name not in REGISTRY:
            raise ValueError(f"unknown collector {name!r}; known: {', '.join(sorted(REGISTRY))}")
        collectors_.append(REGISTRY[name](**options))
    return collectors_
