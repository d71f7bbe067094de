"""The series plan: how one engine's file entries become its exposed series.

Laid out once for the keys its files hold (rebuilt only when an entry or a file is
added), so a cycle is a few array operations over the files' values, whatever the number
of series: the entries are summed into one slot per series, the slots are gathered into
the exposition's order (a histogram's buckets made cumulative), and each family's share
of the result is known with the keys the daemon's windows file its series under.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import numpy as np
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ac_observe.collectors.engine.keys import CheckedKey, SeriesKey, check_key
from ac_observe.metrics import ENGINE_METRICS, HISTOGRAM

# Every bound of each histogram family, +Inf last: a series exposes all of them (the
# writer stores only the buckets that were hit; Prometheus' histogram_quantile answers NaN
# for a series without its +Inf bucket).
_BOUNDS = {spec.family: sorted({float(b) for b in spec.buckets} | {math.inf})
           for spec in ENGINE_METRICS if spec.type == HISTOGRAM}
_FAMILY_ORDER = {spec.family: i for i, spec in enumerate(ENGINE_METRICS)}
_SAMPLE_REST = (None,) * (len(Sample._fields) - 3)  # timestamp, exemplar, ... all None
_SCALARS = 0  # the part of the computed values the scalars are (a row has 2 columns or more)


class FamilySegment(NamedTuple):
    """Where one family's series sit in an engine's exposed values."""
    family: str
    start: int
    end: int
    series_keys: tuple[SeriesKey, ...]  # of exposed[start:end]; one object while the plan
    # lives, so the daemon's windows remember their columns by it


@dataclass(slots=True)
class _Buckets:
    """One label set of a histogram: a bucket's checked key, and each bound's slot."""
    key: CheckedKey
    slot_of_bound: dict[float, int] = field(default_factory=dict)


@dataclass(slots=True)
class _FamilySlots:
    """One family's series by their slots in the totals."""
    scalars: list[int] = field(default_factory=list)  # its own samples (a histogram's _sum)
    histograms: dict[tuple, _Buckets] = field(default_factory=dict)  # by label set


class _ComputedAt(NamedTuple):
    """Where an exposed value is computed: in the scalars (part _SCALARS) or in the
    cumulative rows of `part` columns, at index `at` of that part (rows flattened)."""
    part: int
    at: int


class SeriesPlan:
    """How one engine's files become its exposed series, laid out once for the keys its
    files hold (rebuilt only when an entry or a file is added).

    A cycle: the files' values, concatenated, are summed into one slot per series
    (`np.bincount`: the files of several pids add up, as MultiProcessCollector adds them,
    and so does a key written twice); a histogram's buckets are made cumulative, +Inf
    and `_count` included, with one `cumsum` per bucket count. `Sample`s are made when
    asked for, and only for series whose value moved since the last were made (the
    exposition's renderer reuses the line of a Sample it has seen).
    """

    def __init__(self, layout: tuple, file_keys: list[tuple], checked: dict,
                 expected: dict[str, str]):
        """`file_keys`: each file's keys, in the order its values come to `evaluate`;
        `checked`: every key checked so far, with its result (added to here);
        `expected`: the label values engine.json gives."""
        self.layout = layout
        series, self._sources, skipped = _sum_slots(file_keys, checked, expected)
        self._zero = len(series)  # a slot that is always 0.0 (skipped entries are summed there)
        self.warning = (f"{len(skipped)} entries skipped, e.g. {next(iter(skipped.values()))}"
                        if skipped else "")
        exposition = _Exposition(series)
        for family, slots in _by_family(series):
            exposition.add_family(family, slots)
        self.segments: list[FamilySegment] = exposition.segments
        self._scalars = np.array(exposition.scalar_slots, dtype=np.intp)
        self._rows = [np.array(rows, dtype=np.intp)
                      for rows in exposition.rows_by_width.values()]
        self._order = _gather_order(exposition.computed_at, len(exposition.scalar_slots),
                                    self._rows)
        self._identity = bool(np.array_equal(self._order, np.arange(len(self._order))))
        self._names, self._labels = exposition.names, exposition.labels
        self._samples: list[Sample | None] = [None] * len(self._names)
        self._held = np.full(len(self._names), np.nan)  # the values _samples hold (NaN: none)
        self._lock = threading.Lock()  # samples are asked for by a render and a cycle

    def evaluate(self, values: list[np.ndarray]) -> np.ndarray:
        """The exposed values of one cycle, from each file's values (in `file_keys` order)."""
        raw = values[0] if len(values) == 1 else np.concatenate(values) if values else \
            np.zeros(0)
        totals = np.bincount(self._sources, weights=raw, minlength=self._zero + 1)
        totals[self._zero] = 0.0
        parts = [totals[self._scalars]]
        parts += [np.cumsum(totals[rows], axis=1).ravel() for rows in self._rows]
        exposed = np.concatenate(parts)
        if not self._identity:
            exposed = exposed[self._order]
        return exposed

    def samples(self, exposed: np.ndarray, start: int, end: int) -> list[Sample]:
        """The Samples of exposed[start:end] (one cycle's values): each series' last one
        while its value holds, a new one where it moved (NaN != NaN: made anew, rightly)."""
        with self._lock:
            samples, held = self._samples, self._held
            moved = np.flatnonzero(exposed[start:end] != held[start:end]) + start
            names, labels, new_sample = self._names, self._labels, tuple.__new__
            for i, value in zip(moved.tolist(), exposed[moved].tolist(), strict=False):
                # Sample(name, labels, value), without its Python __new__ (half the time)
                samples[i] = new_sample(Sample, (names[i], labels[i], value) + _SAMPLE_REST)
            held[moved] = exposed[moved]
            # None no more: a slot without a Sample holds NaN, so it moved and got one.
            return cast(list[Sample], samples[start:end])


def _sum_slots(file_keys: list[tuple], checked: dict,
               expected: dict[str, str]) -> tuple[list[CheckedKey], np.ndarray, dict]:
    """(the series, one slot each in the totals, in the order first met; each file
    entry's slot, in the files' order; the skipped keys and why). Entries of one series
    share its slot; a skipped one goes to the slot after the last series."""
    slot_of: dict[SeriesKey, int] = {}
    series: list[CheckedKey] = []
    skipped: dict[str, str] = {}
    sources = []
    for keys in file_keys:
        for key in keys:
            entry = checked.get(key)
            if entry is None:
                entry = checked[key] = check_key(key, expected)
            if isinstance(entry, str):
                skipped[key] = entry
                sources.append(-1)
                continue
            slot = slot_of.get(entry.series_key)
            if slot is None:
                slot = slot_of[entry.series_key] = len(series)
                series.append(entry)
            sources.append(slot)
    zero = len(series)
    return series, np.array([zero if s < 0 else s for s in sources], dtype=np.intp), skipped


def _by_family(series: list[CheckedKey]) -> list[tuple[str, _FamilySlots]]:
    """The series' slots family by family, in the contract's order."""
    families: dict[str, _FamilySlots] = {}
    for slot, entry in enumerate(series):
        slots = families.setdefault(entry.family, _FamilySlots())
        if entry.le is None:
            slots.scalars.append(slot)
        else:
            slots.histograms.setdefault(entry.labels, _Buckets(entry)) \
                .slot_of_bound[entry.le] = slot
    return sorted(families.items(), key=lambda item: _FAMILY_ORDER[item[0]])


class _Exposition:
    """The exposition laid out series by series, and where each exposed value is
    computed: a scalar is its slot's total; a histogram's label set is a row of slots,
    one a bound and one for its `_count` (the always-0 slot: a cumulative sum makes it
    the +Inf bucket's count), made cumulative with the other rows of its width."""

    def __init__(self, series: list[CheckedKey]):
        self.series = series
        self.zero = len(series)
        self.names: list[str] = []
        self.labels: list[dict] = []
        self.series_keys: list[SeriesKey] = []
        self.segments: list[FamilySegment] = []
        self.scalar_slots: list[int] = []
        self.rows_by_width: dict[int, list[list[int]]] = {}
        self.computed_at: list[_ComputedAt] = []

    def add_family(self, family: str, slots: _FamilySlots) -> None:
        """The family's own samples (a histogram's _sum), then each label set's buckets,
        bound by bound, and its _count."""
        start = len(self.names)
        for slot in slots.scalars:
            entry = self.series[slot]
            self.computed_at.append(_ComputedAt(_SCALARS, len(self.scalar_slots)))
            self.scalar_slots.append(slot)
            self._add(entry.sample, entry.sample_labels, entry.series_key)
        for buckets in slots.histograms.values():
            self._add_histogram(family, buckets)
        self.segments.append(FamilySegment(family, start, len(self.names),
                                           tuple(self.series_keys[start:])))

    def _add_histogram(self, family: str, buckets: _Buckets) -> None:
        bounds = _BOUNDS[family]
        width = len(bounds) + 1
        rows = self.rows_by_width.setdefault(width, [])
        first = len(rows) * width  # the row's first index in its part
        rows.append([buckets.slot_of_bound.get(bound, self.zero) for bound in bounds]
                    + [self.zero])
        count_labels = buckets.key.count_labels
        for column, bound in enumerate(bounds):
            sample_labels = {**count_labels, "le": floatToGoString(bound)}
            self.computed_at.append(_ComputedAt(width, first + column))
            self._add(f"{family}_bucket", sample_labels,
                      (f"{family}_bucket", tuple(sample_labels.items())))
        self.computed_at.append(_ComputedAt(width, first + len(bounds)))
        self._add(f"{family}_count", count_labels,
                  (f"{family}_count", tuple(count_labels.items())))

    def _add(self, name: str, labels: dict, series_key: SeriesKey) -> None:
        self.names.append(name)
        self.labels.append(labels)
        self.series_keys.append(series_key)


def _gather_order(computed_at: list[_ComputedAt], scalar_count: int,
                  rows: list[np.ndarray]) -> np.ndarray:
    """Each exposed value's index in the computed ones: the scalars, then each width's
    rows flattened, in the order `rows` has them."""
    part_start, where = {_SCALARS: 0}, scalar_count
    for part in rows:
        part_start[part.shape[1]] = where
        where += part.size
    return np.array([part_start[part] + at for part, at in computed_at], dtype=np.intp)
