"""In-memory windows: the last N collection cycles of every watched series.

One ring of cycle timestamps is shared by all series; each series is a column of float64
values (NaN where it was absent) in chunks of CHUNK columns x N cycles, so a cycle is
stored row by row (one NaN fill and one indexed store a chunk, not a store per series)
and memory is 8 bytes x cycles x columns, up to the last live series' column rounded up
to a chunk (new series take the lowest free columns). Only families a friendly
name reads are kept.

A cycle arrives as a `Frame`: blocks of (keys, values) whose keys tuple a collector keeps
from cycle to cycle while its series stay the same (the engine collector's, one block per
engine and family), and loose samples (a dict, the other collectors'). `Columns` maps
keys to columns and remembers each block's columns while its keys object lives, so a
cycle of 10,000 series costs a few array operations, not a dict lookup each.

NOTE: not thread-safe by itself; the daemon appends and takes views under one lock. A
query computes on a `WindowView` (copies of the rings it needs, inside its window, made
with array slices) after the lock is released, so a long query never stalls a cycle.
"""
from __future__ import annotations

import bisect
import heapq
import math
from array import array

import numpy as np

NAN = float("nan")
SeriesKey = tuple  # (sample name, ((label, value), ...))
CHUNK = 256  # columns a chunk of the windows holds


def grown(array: np.ndarray, width: int, fill) -> np.ndarray:
    """`array` extended to `width` entries (if shorter), the new ones `fill`."""
    if len(array) >= width:
        return array
    out = np.full(width, fill, dtype=array.dtype)
    out[:len(array)] = array
    return out


class Frame:
    """One cycle's watched series: `blocks` of (keys tuple, float64 array) and `loose`
    {key: value} samples. A key appears once in a frame."""
    __slots__ = ("blocks", "loose")

    def __init__(self, blocks: list | None = None, loose: dict | None = None):
        self.blocks: list[tuple[tuple, np.ndarray]] = [] if blocks is None else blocks
        self.loose: dict[SeriesKey, float] = {} if loose is None else loose

    @classmethod
    def of(cls, samples) -> Frame:
        return samples if isinstance(samples, Frame) else cls(loose=samples)

    def keys(self):
        for keys, _ in self.blocks:
            yield from keys
        yield from self.loose

    def items(self):
        for keys, values in self.blocks:
            yield from zip(keys, values.tolist(), strict=False)
        yield from self.loose.items()


class Columns:
    """Series key -> column number, the lowest free number reused first (so live series
    gather at the low end and the columns past the last live one can be given back).

    `place(frame)` gives the frame's columns and values as two arrays (blocks first, in
    order, then the loose samples) and the keys that got a column just now. A block's
    columns are remembered while its keys tuple is handed in cycle after cycle (the
    tuple is held, so its id cannot be reused), for the blocks of the last frame only.
    """

    def __init__(self):
        self.column: dict[SeriesKey, int] = {}
        self.key_of: list[SeriesKey | None] = []
        self._free: list[int] = []  # a heap
        self._blocks: dict[int, tuple[tuple, np.ndarray]] = {}
        self._frame: tuple = ((), None)  # (ids of the last frame's block keys, columns)

    def place(self, frame: Frame) -> tuple[np.ndarray, np.ndarray, list[SeriesKey]]:
        new: list[SeriesKey] = []
        layout = tuple(id(keys) for keys, _ in frame.blocks)
        if layout == self._frame[0] and layout:
            block_columns = self._frame[1]
        else:
            blocks = {}
            parts = []
            for keys, _ in frame.blocks:
                assigned = self._blocks.get(id(keys))
                if assigned is None or assigned[0] is not keys:
                    assigned = (keys, self._assign(keys, new))
                blocks[id(keys)] = assigned
                parts.append(assigned[1])
            self._blocks = blocks
            block_columns = np.concatenate(parts) if parts else np.zeros(0, np.intp)
            self._frame = (layout, block_columns)
        value_parts = [block_values for _, block_values in frame.blocks]
        if frame.loose:
            block_columns = np.concatenate([block_columns,
                                            self._assign(frame.loose.keys(), new)])
            value_parts.append(np.fromiter(frame.loose.values(), np.float64, len(frame.loose)))
        values = np.concatenate(value_parts) if value_parts else np.zeros(0)
        return block_columns, values, new

    def _assign(self, keys, new: list) -> np.ndarray:
        column, key_of, free = self.column, self.key_of, self._free
        out = []
        for key in keys:
            at = column.get(key)
            if at is None:
                if free:
                    at = heapq.heappop(free)
                    key_of[at] = key
                else:
                    at = len(key_of)
                    key_of.append(key)
                column[key] = at
                new.append(key)
            out.append(at)
        return np.array(out, dtype=np.intp)

    def release(self, keys) -> None:
        """Give the columns of `keys` back (their series are gone); remembered blocks are
        forgotten, since one may hold them. Free columns at the end are dropped: `key_of`
        ends with a live series' column."""
        key_of, free = self.key_of, self._free
        for key in keys:
            at = self.column.pop(key)
            key_of[at] = None
            heapq.heappush(free, at)
        while key_of and key_of[-1] is None:
            key_of.pop()
        self._free = [at for at in free if at < len(key_of)]  # none past the end
        heapq.heapify(self._free)
        self._blocks, self._frame = {}, ((), None)


class Windows:
    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError("a window needs at least two cycles")
        self.capacity = capacity
        self.times = array("d", [NAN]) * capacity
        self.cycle = 0  # cycles recorded so far
        self.columns = Columns()
        self._chunks: list[np.ndarray] = []  # [capacity, CHUNK] each
        self._last_present = np.zeros(0, dtype=np.int64)  # each column's last cycle seen
        self.by_sample: dict[str, set[SeriesKey]] = {}
        self.first_seen: dict[SeriesKey, float] = {}

    @property
    def series(self) -> dict[SeriesKey, int]:
        """The series held (key -> its column)."""
        return self.columns.column

    def append(self, timestamp: float, samples, preexisting=()) -> None:
        """One cycle's samples (a Frame, or a dict {key: value}). A new series in
        `preexisting` had a past before it was watched: it is never taken as born inside a
        window (no zero before its first point), so its first value is a base, not an
        increase."""
        index = self.cycle % self.capacity
        self.times[index] = timestamp
        columns, values, new = self.columns.place(Frame.of(samples))
        for key in new:
            self.by_sample.setdefault(key[0], set()).add(key)
            self.first_seen[key] = -math.inf if key in preexisting else timestamp
        width = len(self.columns.key_of)
        while len(self._chunks) * CHUNK < width:
            self._chunks.append(np.full((self.capacity, CHUNK), NAN))
        self._last_present = grown(self._last_present, len(self._chunks) * CHUNK, -1)
        self._last_present[columns] = self.cycle
        row = np.full(len(self._chunks) * CHUNK, NAN)  # absent: NaN
        row[columns] = values
        for k, chunk in enumerate(self._chunks):
            chunk[index] = row[k * CHUNK:(k + 1) * CHUNK]
        self.cycle += 1
        if self.cycle % self.capacity == 0:  # drop series absent for a whole window
            horizon = self.cycle - self.capacity
            stale = np.flatnonzero((self._last_present >= 0) &
                                   (self._last_present < horizon))
            gone = [self.columns.key_of[at] for at in stale.tolist()]
            if gone:
                self._last_present[stale] = -1
                for key in gone:
                    del self.first_seen[key]
                    self.by_sample[key[0]].discard(key)
                self.columns.release(gone)
                # Chunks past the last live column go back (a spike of series does not
                # hold its memory for good).
                kept = -(-len(self.columns.key_of) // CHUNK)
                del self._chunks[kept:]
                self._last_present = self._last_present[:kept * CHUNK]

    @property
    def earliest_time(self) -> float:
        """Timestamp of the oldest cycle still held (NaN before the first)."""
        return self.times[self.cycle % self.capacity if self.cycle > self.capacity else 0]

    @property
    def latest_time(self) -> float | None:
        """Timestamp of the newest cycle (None before the first)."""
        return self.times[(self.cycle - 1) % self.capacity] if self.cycle else None

    def view(self, sample_names, since: float, until: float | None = None) -> WindowView:
        """Copies of the series of `sample_names` over the cycles at or after `since` (and
        at or before `until`, when given: a window that ended in the past)."""
        count = min(self.cycle, self.capacity)
        start = self.cycle - count
        # Cycle times only grow: find the window's first and last cycles by bisection.
        ordered = _Ordered(self.times, start, count, self.capacity)
        first = start + bisect.bisect_left(ordered, since)
        last = self.cycle if until is None else start + bisect.bisect_right(ordered, until)
        times = self._slice(self.times, first, last)
        column = self.columns.column
        series = {}
        for name in sample_names:
            for key in self.by_sample.get(name, ()):
                at = column[key]
                ring = self._chunks[at // CHUNK][:, at % CHUNK]
                series[key] = array("d", self._slice(ring, first, last).tobytes()) \
                    if first < last else array("d")
        return WindowView(times, series, {k: self.first_seen[k] for k in series},
                          self.earliest_time)

    def _slice(self, ring, first: int, last: int):
        """ring's values from cycle `first` up to `last` (excluded), oldest first (C-speed
        copies)."""
        if first >= last:
            return ring[:0]
        begin, end = first % self.capacity, last % self.capacity
        if begin < end:
            return ring[begin:end]
        if isinstance(ring, np.ndarray):
            return np.concatenate([ring[begin:], ring[:end]])
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
        return [(t, v) for t, v in zip(self.times, values, strict=False) if not math.isnan(v)]
