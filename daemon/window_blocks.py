"""A closed block of the windows' cycles, packed: only the series present in it, each in
the narrowest form that reads back bit for bit.

The windows (daemon/windows.py) write each cycle into an open block, dense (a row a cycle,
a column a series). Once its last cycle is in, the block is packed:
- a series absent from the whole block takes nothing (an engine gone, a pid exited);
- present in every cycle with one value (an idle counter, a still gauge, the buckets no
  request reached): that value, 8 bytes for the block;
- present in every cycle, whole numbers moving by steps that fit 8, 16 or 32 bits
  (counters, bucket counts, block counts): its first value and the steps, 1-4 bytes a
  cycle, summed back in float64 (exact: whole numbers under 2^52);
- anything else (fractions, gaps, a reset too large): 8 bytes a cycle, as written.
Each series present also costs 8 bytes a block for its index.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# Whole numbers below this add up exactly in float64 (their differences too).
EXACT = float(2 ** 52)
_STEP_TYPES = (np.int8, np.int16, np.int32)
_CONSTANT, _STEPS, _DENSE = 0, 1, 2


class PackedBlock:
    """Cycles `first` .. `first + rows - 1` of the series in `columns` (sorted column
    numbers). `parts`: (kind, first row, end row, data) with data a value per series
    (_CONSTANT), (first values, steps as [rows - 1, k] integers) (_STEPS) or [rows, k]
    float64 (_DENSE) over the part's rows; `part` and `index` say where each column's
    values are. A series born or gone inside the block (present in one run of its rows)
    is packed over that run only."""
    __slots__ = ("first", "rows", "columns", "part", "index", "parts")

    def __init__(self, first: int, dense: np.ndarray, columns: np.ndarray):
        """`dense`: [rows, len(columns)], the block's values (NaN: absent) of `columns`,
        each present in one cycle at least."""
        self.first, self.rows = first, dense.shape[0]
        self.columns = columns.astype(np.int32)
        self.part = np.zeros(len(columns), np.int16)  # up to 5 parts a run of rows
        self.index = np.zeros(len(columns), np.int32)
        self.parts: list[tuple[int, int, int, Any]] = []
        present = ~np.isnan(dense)
        begin = np.argmax(present, axis=0)
        end = self.rows - np.argmax(present[::-1], axis=0)
        one_run = (end - begin) == present.sum(axis=0)
        runs = begin * (self.rows + 1) + end
        for run in np.unique(runs[one_run]).tolist():
            at = np.flatnonzero(one_run & (runs == run))
            r0, r1 = divmod(run, self.rows + 1)
            self._pack(dense[r0:r1, at], at, r0, r1)
        gaps = np.flatnonzero(~one_run)  # absent in between: as written
        if len(gaps):
            self._add(_DENSE, gaps, 0, self.rows, np.ascontiguousarray(dense[:, gaps]))

    def _pack(self, values: np.ndarray, at: np.ndarray, r0: int, r1: int) -> None:
        """Columns `at`, present in every one of rows r0..r1-1 (`values`)."""
        bits = values.view(np.int64)  # bit for bit: a -0.0 is not a 0.0
        constant = (bits == bits[0]).all(axis=0)
        self._add(_CONSTANT, at[constant], r0, r1, values[0, constant].copy())
        left = ~constant
        if r1 - r0 > 1 and left.any():
            whole = left & ((values == np.rint(values)) & (np.abs(values) < EXACT)
                            & ~((values == 0) & np.signbit(values))).all(axis=0)
            steps = np.diff(values, axis=0)
            low, high = steps.min(axis=0), steps.max(axis=0)
            for step_type in _STEP_TYPES:
                info = np.iinfo(step_type)
                fits = whole & (low >= info.min) & (high <= info.max)
                if fits.any():
                    self._add(_STEPS, at[fits], r0, r1, (values[0, fits].copy(),
                                                         steps[:, fits].astype(step_type)))
                    whole &= ~fits
                    left &= ~fits
        if left.any():
            self._add(_DENSE, at[left], r0, r1, np.ascontiguousarray(values[:, left]))

    def _add(self, kind: int, at: np.ndarray, r0: int, r1: int, data) -> None:
        if not len(at):
            return
        self.part[at] = len(self.parts)
        self.index[at] = np.arange(len(at), dtype=np.int32)
        self.parts.append((kind, r0, r1, data))

    @property
    def nbytes(self) -> int:
        total = self.columns.nbytes + self.part.nbytes + self.index.nbytes
        for kind, _, _, data in self.parts:
            total += sum(a.nbytes for a in data) if kind == _STEPS else data.nbytes
        return total

    def read(self, wanted: np.ndarray, lo: int, hi: int, out: np.ndarray, at: int) -> None:
        """Rows `lo`..`hi - 1` of the block into out[j, at:at + hi - lo] for each column
        wanted[j] the block holds (the others are left as they are)."""
        if not len(self.columns):
            return
        position = np.minimum(np.searchsorted(self.columns, wanted), len(self.columns) - 1)
        held = self.columns[position] == wanted
        rows = np.flatnonzero(held)
        position = position[held]
        part, index = self.part[position], self.index[position]
        for number, (kind, r0, r1, data) in enumerate(self.parts):
            start, stop = max(lo, r0), min(hi, r1)
            if start >= stop:
                continue
            mine = part == number
            if not mine.any():
                continue
            j, i = rows[mine], index[mine]
            span = slice(at + start - lo, at + stop - lo)
            if kind == _CONSTANT:
                out[j, span] = data[i][:, None]
            elif kind == _DENSE:
                out[j, span] = data[start - r0:stop - r0, i].T
            else:
                first, steps = data
                running = np.zeros((r1 - r0, len(i)))
                np.cumsum(steps[:, i], axis=0, dtype=np.float64, out=running[1:])
                out[j, span] = (first[i] + running[start - r0:stop - r0]).T
