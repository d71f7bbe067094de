"""In-memory windows: the last N collection cycles of every watched series.

One ring of cycle timestamps is shared by all series; each series keeps a parallel ring
of float64 values (NaN where it was absent), so a cycle costs one store per series and
memory is 8 bytes x cycles x series. Only families a friendly name reads are kept.

NOTE: not thread-safe by itself; the daemon appends and takes views under one lock. A
query computes on a `WindowView` (copies of the rings it needs, inside its window, made
with array slices) after the lock is released, so a long query never stalls a cycle.
"""
from __future__ import annotations

import bisect
import math
from array import array

NAN = float("nan")
SeriesKey = tuple  # (sample name, ((label, value), ...))


class Windows:
    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError("a window needs at least two cycles")
        self.capacity = capacity
        self.times = array("d", [NAN]) * capacity
        self.cycle = 0  # cycles recorded so far
        self.series: dict[SeriesKey, array] = {}
        self.by_sample: dict[str, set[SeriesKey]] = {}
        self.first_seen: dict[SeriesKey, float] = {}
        self._absent_since: dict[SeriesKey, int] = {}  # series missing since that cycle

    def append(self, timestamp: float, samples: dict[SeriesKey, float],
               preexisting=()) -> None:
        """One cycle's samples. A new series in `preexisting` had a past before it was
        watched: it is never taken as born inside a window (no zero before its first
        point), so its first value is a base, not an increase."""
        index = self.cycle % self.capacity
        self.times[index] = timestamp
        series, absent_since, cycle = self.series, self._absent_since, self.cycle
        # Presence changes are set operations (in C); a series present now costs one store.
        for key in series.keys() - samples.keys():  # absent this cycle
            series[key][index] = NAN
            absent_since.setdefault(key, cycle)
        if absent_since:
            for key in absent_since.keys() & samples.keys():  # back
                del absent_since[key]
        for key, value in samples.items():
            ring = series.get(key)
            if ring is None:
                ring = series[key] = array("d", [NAN]) * self.capacity
                self.by_sample.setdefault(key[0], set()).add(key)
                self.first_seen[key] = -math.inf if key in preexisting else timestamp
            ring[index] = value
        self.cycle += 1
        if self.cycle % self.capacity == 0:  # drop series absent for a whole window
            horizon = self.cycle - self.capacity
            for key in [k for k, since in absent_since.items() if since <= horizon]:
                del self.series[key], absent_since[key], self.first_seen[key]
                self.by_sample[key[0]].discard(key)

    @property
    def earliest_time(self) -> float:
        """Timestamp of the oldest cycle still held (NaN before the first)."""
        return self.times[self.cycle % self.capacity if self.cycle > self.capacity else 0]

    @property
    def latest_time(self) -> float | None:
        """Timestamp of the newest cycle (None before the first)."""
        return self.times[(self.cycle - 1) % self.capacity] if self.cycle else None

    def view(self, sample_names, since: float, until: float | None = None) -> "WindowView":
        """Copies of the series of `sample_names` over the cycles at or after `since` (and
        at or before `until`, when given: a window that ended in the past)."""
        count = min(self.cycle, self.capacity)
        start = self.cycle - count
        # Cycle times only grow: find the window's first and last cycles by bisection.
        ordered = _Ordered(self.times, start, count, self.capacity)
        first = start + bisect.bisect_left(ordered, since)
        last = self.cycle if until is None else start + bisect.bisect_right(ordered, until)
        times = self._slice(self.times, first, last)
        series = {key: self._slice(self.series[key], first, last)
                  for name in sample_names for key in self.by_sample.get(name, ())}
        return WindowView(times, series, {k: self.first_seen[k] for k in series},
                          self.earliest_time)

    def _slice(self, ring: array, first: int, last: int) -> array:
        """ring's values from cycle `first` up to `last` (excluded), oldest first (C-speed
        copies)."""
        if first >= last:
            return array("d")
        begin, end = first % self.capacity, last % self.capacity
        if begin < end:
            return ring[begin:end]
        return ring[begin:] + ring[:end]


class _Ordered:
    """The ring's cycle times, oldest first, as a sequence bisect can search."""
    __slots__ = ("times", "start", "count", "capacity")

    def __init__(self, times, start, count, capacity):
        self.times, self.start, self.count, self.capacity = times, start, count, capacity

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> float:
        return self.times[(self.start + i) % self.capacity]


class WindowView:
    """A query's own copy of the windows: what it reads, frozen."""
    __slots__ = ("times", "series", "first_seen", "earliest_time")

    def __init__(self, times: array, series: dict, first_seen: dict, earliest_time: float):
        self.times, self.series = times, series
        self.first_seen, self.earliest_time = first_seen, earliest_time

    def keys(self, sample_name: str) -> list[SeriesKey]:
        return [key for key in self.series if key[0] == sample_name]

    def points(self, key: SeriesKey) -> list[tuple[float, float]]:
        """(timestamp, value) pairs in the window, oldest first, absent cycles skipped."""
        values = self.series.get(key)
        if values is None:
            return []
        return [(t, v) for t, v in zip(self.times, values) if not math.isnan(v)]
