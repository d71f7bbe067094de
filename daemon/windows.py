"""In-memory windows: the last N collection cycles of every watched series.

One ring of cycle timestamps is shared by all series; their values go in blocks of
BLOCK_CYCLES cycles. The open block is dense, a float64 column per series (NaN where it
was absent) in chunks of CHUNK columns, so a cycle is stored row by row (one NaN fill and
one indexed store a chunk, not a store per series). A full block is packed
(window_blocks.PackedBlock: only the series present in it, a still one as one value, a
counter as small steps) and dropped once the window has moved past it, so memory follows
the samples the window holds: a series that lived 40 cycles costs at most two blocks of
it, not a whole window, and one gone a whole window is dropped at the next block's end
(its column reused: new series take the lowest free columns). Only families a friendly
name reads are kept.

A cycle arrives as a `Frame`: blocks of (keys, values) whose keys tuple a collector keeps
from cycle to cycle while its series stay the same (the engine collector's, one block per
engine and family), and loose samples (a dict, the other collectors'). `Columns` maps
keys to columns and remembers each block's columns while its keys object lives, so a
cycle of 10,000 series costs a few array operations, not a dict lookup each.

NOTE: not thread-safe by itself; the daemon appends and takes views under one lock. A
query computes on a `WindowView` (copies of what it needs, inside its window, read back
from the blocks with array operations) after the lock is released, so a long query never
stalls a cycle.
"""
from __future__ import annotations

import bisect
import ctypes
import heapq
import math
from array import array
from collections import deque

import numpy as np

from ac_observe.daemon.window_blocks import PackedBlock

NAN = float("nan")
SeriesKey = tuple  # (sample name, ((label, value), ...))
CHUNK = 256  # columns a chunk of the open block holds
# Cycles a block holds: a series that lived 40 cycles costs at most two blocks of it, and
# the open block (dense) stays small: 64 x 8 bytes a live series.
BLOCK_CYCLES = 64


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def give_back_memory() -> None:
    """Hand the heap's free pages back to the system: glibc keeps them otherwise, and the
    RSS would stay at its peak after a spike of series has gone."""
    if _TRIM is not None:
        _TRIM(0)


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
        # The open block: its cycles as rows, a slot (column) for each series present in
        # it or in the block before, [block_cycles, CHUNK] a chunk of slots. A series
        # gone keeps its column number (the packed blocks know it by that) but no slot.
        self.block_cycles = min(BLOCK_CYCLES, capacity)
        self._chunks: list[np.ndarray] = []
        self._open_first = 0  # the open block's first cycle
        self._slot_of = np.zeros(0, dtype=np.int64)   # each column's slot (-1: none)
        self._column_of = np.zeros(0, dtype=np.int64)  # each slot's column (-1: none)
        self._packed: deque[PackedBlock] = deque()  # closed blocks, oldest first
        self._last_present = np.zeros(0, dtype=np.int64)  # each column's last cycle seen
        self.by_sample: dict[str, set[SeriesKey]] = {}
        self.first_seen: dict[SeriesKey, float] = {}

    @property
    def series(self) -> dict[SeriesKey, int]:
        """The series held (key -> its column)."""
        return self.columns.column

    @property
    def nbytes(self) -> int:
        """Bytes the values take: the open block and the packed ones."""
        return (sum(chunk.nbytes for chunk in self._chunks)
                + sum(block.nbytes for block in self._packed))

    def append(self, timestamp: float, samples, preexisting=()) -> None:
        """One cycle's samples (a Frame, or a dict {key: value}). A new series in
        `preexisting` had a past before it was watched: it is never taken as born inside a
        window (no zero before its first point), so its first value is a base, not an
        increase."""
        self.times[self.cycle % self.capacity] = timestamp
        columns, values, new = self.columns.place(Frame.of(samples))
        for key in new:
            self.by_sample.setdefault(key[0], set()).add(key)
            self.first_seen[key] = -math.inf if key in preexisting else timestamp
        width = -(-len(self.columns.key_of) // CHUNK) * CHUNK
        self._last_present = grown(self._last_present, width, -1)
        self._last_present[columns] = self.cycle
        slots = self._slots(columns)
        row = np.full(len(self._chunks) * CHUNK, NAN)  # absent: NaN
        row[slots] = values
        index = self.cycle - self._open_first
        for k, chunk in enumerate(self._chunks):
            chunk[index] = row[k * CHUNK:(k + 1) * CHUNK]
        self.cycle += 1
        if self.cycle - self._open_first == self.block_cycles:
            self._drop_absent()
            self._close_block()

    def _slots(self, columns: np.ndarray) -> np.ndarray:
        """The open block's slots of `columns`; one without a slot takes the next."""
        self._slot_of = grown(self._slot_of, len(self._last_present), -1)
        slots = self._slot_of[columns]
        missing = slots < 0
        if not missing.any():
            return slots
        taken = len(self._column_of)
        slots[missing] = np.arange(taken, taken + np.count_nonzero(missing))
        self._slot_of[columns[missing]] = slots[missing]
        self._column_of = np.concatenate([self._column_of, columns[missing]])
        while len(self._chunks) * CHUNK < len(self._column_of):
            self._chunks.append(np.full((self.block_cycles, CHUNK), NAN))
        return slots

    def _drop_absent(self) -> None:
        """Series absent for a whole window leave it; their columns go to new series."""
        horizon = self.cycle - self.capacity
        stale = np.flatnonzero((self._last_present >= 0) & (self._last_present < horizon))
        gone = [self.columns.key_of[at] for at in stale.tolist()]
        if not gone:
            return
        self._last_present[stale] = -1
        for key in gone:
            del self.first_seen[key]
            self.by_sample[key[0]].discard(key)
        self.columns.release(gone)
        # Absent from the whole open block too: a slot left holds no value.
        slots = self._slot_of[stale]
        self._column_of[slots[slots >= 0]] = -1
        self._slot_of[stale] = -1
        width = -(-len(self.columns.key_of) // CHUNK) * CHUNK
        self._last_present = self._last_present[:width]
        self._slot_of = self._slot_of[:width]
        give_back_memory()

    def _close_block(self) -> None:
        """Pack the open block, drop the blocks the window has moved past, and open the
        next block."""
        present = np.zeros(0, dtype=np.int64)
        if self._chunks:
            dense = np.concatenate(self._chunks, axis=1)[:, :len(self._column_of)]
            present = np.flatnonzero(~np.isnan(dense).all(axis=0) & (self._column_of >= 0))
            if len(present):
                columns = self._column_of[present]
                order = np.argsort(columns)
                self._packed.append(PackedBlock(self._open_first, dense[:, present[order]],
                                                columns[order]))
        self._open_first = self.cycle
        horizon = self.cycle - self.capacity  # the oldest cycle held
        while self._packed and self._packed[0].first + self._packed[0].rows <= horizon:
            self._packed.popleft()
        # The next block's slots: the series present in this one, in their order; the
        # chunks a spike of series took go back once it has gone.
        self._slot_of[:] = -1
        self._column_of = self._column_of[present]
        self._slot_of[self._column_of] = np.arange(len(self._column_of))
        kept = -(-len(self._column_of) // CHUNK)
        if kept < len(self._chunks):
            del self._chunks[kept:]
            give_back_memory()
        for chunk in self._chunks:
            chunk.fill(NAN)

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
        keys = [key for name in sample_names for key in self.by_sample.get(name, ())]
        series = {}
        if first < last and keys:
            values = self._read(keys, first, last)
            for j, key in enumerate(keys):
                series[key] = array("d", values[j].tobytes())
        else:
            series = {key: array("d") for key in keys}
        return WindowView(times, series, {k: self.first_seen[k] for k in series},
                          self.earliest_time)

    def _read(self, keys: list[SeriesKey], first: int, last: int) -> np.ndarray:
        """[len(keys), last - first]: the series' values over those cycles (NaN: absent)."""
        column = self.columns.column
        wanted = np.fromiter((column[key] for key in keys), np.int64, len(keys))
        out = np.full((len(keys), last - first), NAN)
        for block in self._packed:
            lo, hi = max(first, block.first), min(last, block.first + block.rows)
            if lo < hi:
                block.read(wanted, lo - block.first, hi - block.first, out, lo - first)
        lo = max(first, self._open_first)
        if lo < last:
            rows = slice(lo - self._open_first, last - self._open_first)
            slots = self._slot_of[wanted]
            chunk_of = np.where(slots >= 0, slots // CHUNK, -1)
            for k in np.unique(chunk_of[chunk_of >= 0]).tolist():
                mine = np.flatnonzero(chunk_of == k)
                out[mine, lo - first:] = self._chunks[k][rows, slots[mine] % CHUNK].T
        return out

    def _slice(self, ring, first: int, last: int):
        """ring's values from cycle `first` up to `last` (excluded), oldest first (C-speed
        copies)."""
        if first >= last:
            return ring[:0]
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
        return [(t, v) for t, v in zip(self.times, values, strict=False) if not math.isnan(v)]
