"""In-memory windows: the last N collection cycles of every watched series.

One ring of cycle timestamps is shared by all series; each series keeps a parallel ring
of float64 values (NaN where it was absent), so a cycle costs one store per series and
memory is 8 bytes x cycles x series. Only families a friendly name reads are kept.
"""
from __future__ import annotations

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
        self._last_seen: dict[SeriesKey, int] = {}

    def append(self, timestamp: float, samples: dict[SeriesKey, float]) -> None:
        index = self.cycle % self.capacity
        self.times[index] = timestamp
        for key, ring in self.series.items():
            if key not in samples:
                ring[index] = NAN
        for key, value in samples.items():
            ring = self.series.get(key)
            if ring is None:
                ring = self.series[key] = array("d", [NAN]) * self.capacity
            ring[index] = value
            self._last_seen[key] = self.cycle
        self.cycle += 1
        if self.cycle % self.capacity == 0:  # drop series absent for a whole window
            horizon = self.cycle - self.capacity
            for key in [k for k, seen in self._last_seen.items() if seen < horizon]:
                del self.series[key], self._last_seen[key]

    @property
    def earliest_time(self) -> float:
        """Timestamp of the oldest cycle still held (NaN before the first)."""
        return self.times[self.cycle % self.capacity if self.cycle > self.capacity else 0]

    def keys(self, sample_name: str) -> list[SeriesKey]:
        return [key for key in self.series if key[0] == sample_name]

    def points(self, key: SeriesKey, since: float) -> list[tuple[float, float]]:
        """(timestamp, value) pairs at or after `since`, oldest first, absent cycles skipped."""
        ring = self.series.get(key)
        if ring is None:
            return []
        count = min(self.cycle, self.capacity)
        start = self.cycle - count
        out = []
        for cycle in range(start, self.cycle):
            index = cycle % self.capacity
            t, v = self.times[index], ring[index]
            if t >= since and not math.isnan(v):
                out.append((t, v))
        return out
