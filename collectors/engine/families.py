"""The engines' metric families of a cycle, built from each engine's exposed values."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from prometheus_client.core import Metric

from ac_observe.collectors.engine.keys import SPECS
from ac_observe.collectors.engine.plan import FamilySegment, SeriesPlan


class _EngineShare(NamedTuple):
    """One engine's share of a family in a cycle."""
    plan: SeriesPlan
    values: np.ndarray       # the engine's exposed values of the cycle, all its families'
    segment: FamilySegment   # where this family's series sit in them


# Not a plain family filled by add_metric: that (a Sample per series a cycle) costs ~6x a cycle.
class EngineFamily(Metric):
    """A family of the engines' series, made from each engine's values of the cycle.

    It carries them as `blocks`: one (keys, values) pair per engine, the keys a tuple of
    the series' window keys (sample name, ((label, value), ...)) that stays the same
    object while the engine's files keep their layout, the values a float64 array of
    this cycle. The daemon's windows and history take a cycle from them with a few array
    operations (see daemon.windows.Frame) instead of a tuple and a dict entry per sample.
    `samples` are built on first use only (a render, not every cycle: under a Prometheus
    at 15 s, 14 cycles in 15 are never rendered), reusing each series' last `Sample`
    while its value holds (see SeriesPlan.samples)."""

    def __init__(self, spec):
        self._shares: list[_EngineShare] = []
        self._built_samples: list | None = None
        self._refused: set | frozenset = frozenset()
        super().__init__(spec.family, spec.help, spec.type)

    def add(self, plan: SeriesPlan, values: np.ndarray, segment: FamilySegment) -> None:
        self._shares.append(_EngineShare(plan, values, segment))

    def refuse(self, keys: set) -> None:
        """Leave the series of `keys` out of the blocks and the samples (the daemon's
        series budget refused them)."""
        self._refused = keys
        self._built_samples = None

    @property
    def blocks(self) -> list[tuple[tuple, np.ndarray]]:
        blocks = [(segment.series_keys, values[segment.start:segment.end])
                  for _, values, segment in self._shares]
        if self._refused:
            blocks = [self._kept(keys, values) for keys, values in blocks]
        return blocks

    def _kept(self, keys: tuple, values):
        kept = [key not in self._refused for key in keys]
        if all(kept):
            return keys, values
        return tuple(key for key, keep in zip(keys, kept, strict=True) if keep), values[kept]

    @property
    def samples(self) -> list:
        built = self._built_samples
        if built is None:  # two threads may both build them: the same samples, either way
            built = []
            for plan, values, segment in self._shares:
                samples = plan.samples(values, segment.start, segment.end)
                if self._refused:
                    samples = [sample for key, sample in zip(segment.series_keys, samples,
                                                             strict=True)
                               if key not in self._refused]
                built += samples
            self._built_samples = built
        return built

    @samples.setter
    def samples(self, value: list) -> None:  # Metric.__init__ sets an empty list
        self._built_samples = value or None


class EngineValues:
    """One engine's exposed values of one cycle, laid out by its plan."""
    __slots__ = ("plan", "values")

    def __init__(self, plan: SeriesPlan, values: np.ndarray):
        self.plan, self.values = plan, values

    def add_to(self, families: dict[str, EngineFamily]) -> None:
        """Adds this engine's share to each of its families (made if not there yet)."""
        plan, values = self.plan, self.values
        for segment in plan.segments:
            metric = families.get(segment.family)
            if metric is None:
                metric = families[segment.family] = EngineFamily(SPECS[segment.family])
            metric.add(plan, values, segment)
