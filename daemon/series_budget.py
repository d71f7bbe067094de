"""The daemon's budget of series: at most `limit` of the collectors' series are exported and
windowed; past it, new series are refused (left out of /metrics, the windows and the
history) and counted, so a label that explodes (a pid per request, a runaway engine name)
costs a bounded amount of memory instead of growing without end.

A series held keeps its place while it is reported; one that leaves frees its place from
the next cycle. A refused series is tried again every cycle and admitted once there is
room. The engine collector's families come as blocks whose keys tuple stays the same
object while an engine's layout holds: a block seen whole last cycle is admitted without
looking at its keys, so the budget costs a few dict lookups a cycle, not one a series.
"""
from __future__ import annotations

import logging
import time

from prometheus_client.core import Metric

from ac_observe import metrics as m
from ac_observe.collectors.base import new_counter, new_gauge

log = logging.getLogger("ac_observe.daemon")

LOG_EVERY_SECONDS = 600.0  # a refusal is logged once, then at most this often


def _sample_key(sample) -> tuple:
    return sample.name, tuple(sample.labels.items())


class _Cycle:
    """What one cycle admitted and refused so far."""
    __slots__ = ("room", "blocks", "loose", "refused", "changed")

    def __init__(self, room: int):
        self.room = room
        self.blocks: dict = {}    # id(keys) -> keys, admitted whole
        self.loose: set = set()   # the other series admitted
        self.refused: set = set()
        self.changed = False      # a block not seen whole last cycle


class SeriesBudget:
    """NOTE: called on the collection thread only."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("the series budget (--max-series) must be at least 1")
        self.limit = limit
        self.held = 0
        self.refused_total = 0
        self._blocks: dict = {}        # id(keys) -> keys, of the blocks admitted whole
        self._block_keys: set = set()  # their keys
        self._loose: set = set()       # the other series held after the last cycle
        self._refused: set = set()     # the series refused in the last cycle
        self._logged = -float("inf")

    def admit(self, families: list[Metric]) -> None:
        """Leaves the refused series out of `families` (in place: a family keeps its
        object, with fewer series)."""
        cycle = _Cycle(self.limit - self.held)
        for family in families:
            if getattr(family, "blocks", None) is not None:
                self._admit_blocks(family, cycle)
            else:
                self._admit_samples(family, cycle)
        blocks = cycle.blocks
        if cycle.changed or blocks.keys() != self._blocks.keys():
            self._block_keys = set()
            for block in blocks.values():
                self._block_keys.update(block)
        self._blocks, self._loose = blocks, cycle.loose
        self.held = len(self._block_keys) + len(self._loose)
        refused = cycle.refused
        if refused:
            fresh = len(refused - self._refused)
            self.refused_total += fresh
            self._log(refused, fresh)
        self._refused = refused

    def _admit_blocks(self, family, cycle: _Cycle) -> None:
        """The engine collector's (keys tuple, values) blocks: one seen whole last cycle
        is held whole; in another, the new keys take what room is left."""
        turned: set = set()
        for keys, _ in family.blocks:
            if self._blocks.get(id(keys)) is keys:
                cycle.blocks[id(keys)] = keys
                continue
            cycle.changed = True
            new = [key for key in keys if not self._holds(key)]
            if len(new) <= cycle.room:
                cycle.room -= len(new)
                cycle.blocks[id(keys)] = keys
            else:  # held in part: looked at again next cycle
                turned.update(new[cycle.room:])
                cycle.room = 0
                cycle.loose.update(key for key in keys if key not in turned)
        if turned:
            family.refuse(turned)
            cycle.refused |= turned

    def _admit_samples(self, family, cycle: _Cycle) -> None:
        kept = []
        for sample in family.samples:
            key = _sample_key(sample)
            held = self._holds(key)
            if held or cycle.room > 0:
                cycle.room -= not held
                cycle.loose.add(key)
                kept.append(sample)
            else:
                cycle.refused.add(key)
        if len(kept) != len(family.samples):
            family.samples = kept

    def _holds(self, key) -> bool:
        return key in self._block_keys or key in self._loose

    def _log(self, refused: set, fresh: int) -> None:
        now = time.monotonic()
        if now - self._logged < LOG_EVERY_SECONDS:
            return
        self._logged = now
        families = sorted({key[0] for key in refused})
        log.warning("the series budget is full (--max-series %d): %d series refused this "
                    "cycle (%d new; %d since start), of %s; they are neither exported nor "
                    "kept (ac_daemon_series_refused_total counts them; this is said again "
                    "at most every %d minutes)", self.limit, len(refused), fresh,
                    self.refused_total, ", ".join(families[:5])
                    + (f" and {len(families) - 5} more" if len(families) > 5 else ""),
                    LOG_EVERY_SECONDS // 60)

    def metrics(self) -> list[Metric]:
        series = new_gauge(m.SERIES)
        series.add_metric([], self.held)
        refused = new_counter(m.SERIES_REFUSED)
        refused.add_metric([], self.refused_total)
        return [series, refused]
