"""History: per-minute aggregates of every watched series, kept in the store for days.

The in-memory windows hold the last hour at the collection interval. Each cycle also
folds its samples into the current minute's aggregate (`MinuteAggregator`); a finished
minute goes to the store by the writer's own thread (`HistoryWriter`), so a slow or
unreachable store never stalls a collection cycle, and minutes not yet written are kept
(and still read by queries) until it is back.

What a minute holds, per series:
- a counter (rate and ratio sources, a histogram's buckets, sum and count): its increase
  over the cycles that ended in the minute (a drop is a reset, as `increase()` reads it),
  and how many intervals that was;
- a gauge: sample count, sum, min, max and last.

That is enough to recompute, over any span of minutes, exactly what the in-memory query
computes over cycles for: a rate's mean, a ratio (Σ increases / Σ increases), a
histogram's quantiles, mean and shares (bucket increases add up), and a gauge's mean,
min, max and last. Per-point statistics (a gauge's or a rate's p50/p95/p99, a ratio's
spread) are taken over one-minute points instead of cycles: the answer says so
(`source: history`, `resolution_seconds: 60`). A span longer than MAX_POINTS minutes is
read as groups of minutes folded by the database (`resolution_seconds` says how many):
sums stay exact, per-point statistics are over the groups.

NOTE: minutes are Unix minutes (`floor(t / 60)`); an increase belongs to the minute its
interval ended in. A minute is written by merging (sums add, extremes widen, last wins),
so a daemon restarted within a minute adds to what it wrote, and two daemons on one store
reading the same engines would count twice: give each its own state directory.
"""
from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
import time

import numpy as np

from ac_observe.daemon.store import StoreUnavailable
from ac_observe.daemon.windows import NAN, Columns, Frame, SeriesKey, WindowView, grown
from ac_observe.friendly import FRIENDLY

log = logging.getLogger("ac_observe.daemon.history")

COUNTER, GAUGE = "counter", "gauge"
MINUTE = 60.0
DEFAULT_RETENTION_SECONDS = 8 * 86400.0
# A counter unseen for this long is forgotten: when it returns it counts as new.
FORGET_AFTER_MINUTES = 60
# Points a history answer reads per series at most: a longer span reads groups of minutes
# folded by the database (sums stay exact; a gauge's p50/p95 are over the groups' means).
MAX_POINTS = 1440
# Minutes kept in memory while the store cannot take them (then the oldest are dropped).
MAX_UNWRITTEN_MINUTES = 24 * 60
# At shutdown, how long minutes the store cannot take yet are retried before they are lost
# (within systemd's TimeoutStopSec and Kubernetes' grace period: deploy/).
SHUTDOWN_RETRY_SECONDS = 20.0

Row = list  # [n, total, min, max, last]; min/max/last are None for a counter


def sample_kinds() -> dict[str, str]:
    """Every sample name a friendly name reads -> counter or gauge."""
    kinds = {}
    for friendly in FRIENDLY.values():
        for name in friendly.sample_names():
            kinds[name] = GAUGE if friendly.kind == "gauge" else COUNTER
    return kinds


class MinuteAggregator:
    """Folds each cycle's watched samples into the current minute's rows.

    The rows are kept as columns (numpy arrays, one slot per series: see
    windows.Columns), so a cycle of 10,000 series is a few array operations; a finished
    minute is handed over as {key: row}.

    NOTE: called on the collection thread under the daemon's lock (queries read
    `current()` under the same lock)."""

    def __init__(self, kinds: dict[str, str] | None = None):
        self.kinds = sample_kinds() if kinds is None else kinds
        self.minute: int | None = None
        self.last_time = NAN  # the latest cycle's timestamp
        self.columns = Columns()
        self._kind = np.zeros(0, np.int8)     # _COUNTER, _GAUGE, or 0: not kept
        self._n = np.zeros(0, np.int64)       # samples this minute (0: no row)
        self._total = np.zeros(0)             # a counter's increase, a gauge's sum
        self._min = np.zeros(0)
        self._max = np.zeros(0)
        self._last = np.zeros(0)
        self._previous = np.zeros(0)          # a counter's last value (NaN: none known)
        self._previous_minute = np.zeros(0, np.int64)  # the minute it was last seen in
        self._seen_minute = np.zeros(0, np.int64)      # the minute a series was last in
        self._cycles = 0

    def _grow(self, width: int) -> None:
        size = len(self._n)
        if width <= size:
            return
        width = max(width, 2 * size, 64)
        for name, fill in (("_kind", 0), ("_n", 0), ("_total", 0.0), ("_min", 0.0),
                           ("_max", 0.0), ("_last", 0.0), ("_previous", NAN),
                           ("_previous_minute", 0), ("_seen_minute", 0)):
            setattr(self, name, grown(getattr(self, name), width, fill))

    def add(self, timestamp: float, samples, preexisting=()) -> tuple | None:
        """Fold one cycle in (a windows.Frame, or a dict {key: value}); returns the
        (minute, rows) it finished, if any. A counter first seen in `preexisting` (its
        collector's first cycle up) is a base only."""
        minute = int(timestamp // MINUTE)
        finished = None
        if self.minute is not None and minute != self.minute:
            finished = self.flush()
        self.minute, self.last_time = minute, timestamp
        columns, values, new = self.columns.place(Frame.of(samples))
        self._grow(len(self.columns.key_of))
        if new:
            kinds, column = self.kinds, self.columns.column
            at = np.fromiter((column[key] for key in new), np.intp, len(new))
            # (a column given back had no row and nothing to remember: n 0, total 0, NaN)
            self._kind[at] = [_KIND_CODES.get(kinds.get(key[0], ""), 0) for key in new]
        self._seen_minute[columns] = minute
        kind = self._kind[columns]
        kept = (kind != 0) & np.isfinite(values)
        columns, values, kind = columns[kept], values[kept], kind[kept]
        n, total = self._n, self._total
        # Counters: an unchanged one (most buckets) only counts the interval.
        counter = kind == _COUNTER
        at, value = columns[counter], values[counter]
        before = self._previous[at]
        known = ~np.isnan(before)
        unchanged = known & (before == value) & (n[at] > 0)
        n[at[unchanged]] += 1
        moved = ~unchanged
        at, value, before, known = at[moved], value[moved], before[moved], known[moved]
        self._previous[at] = value
        self._previous_minute[at] = minute
        # One first seen counted from zero if born while watched; its history before the
        # daemon (or its collector) came is unknown: then it is only a base.
        counts = known.copy()
        if self._cycles:
            born = np.flatnonzero(~known)
            if len(born):
                key_of = self.columns.key_of
                counts[born] = [key_of[a] not in preexisting for a in at[born].tolist()]
        rise = np.where(known & (value < before), value, value - np.where(known, before, 0.0))
        at = at[counts]
        n[at] += 1
        total[at] += rise[counts]
        # Gauges: count, sum, min, max and last.
        gauge = kind == _GAUGE
        at, value = columns[gauge], values[gauge]
        first = n[at] == 0
        n[at] += 1
        total[at] += value
        self._min[at] = np.where(first, value, np.minimum(self._min[at], value))
        self._max[at] = np.where(first, value, np.maximum(self._max[at], value))
        self._last[at] = value
        self._cycles += 1
        return finished

    def _rows(self) -> dict[SeriesKey, Row]:
        at = np.flatnonzero(self._n > 0)
        key_of = self.columns.key_of
        rows = {}
        for a, kind, n, total, low, high, last in zip(
                at.tolist(), self._kind[at].tolist(), self._n[at].tolist(),
                self._total[at].tolist(), self._min[at].tolist(), self._max[at].tolist(),
                self._last[at].tolist(), strict=False):
            rows[key_of[a]] = [n, total, None, None, None] if kind == _COUNTER else \
                [n, total, low, high, last]
        return rows

    def flush(self) -> tuple | None:
        """Hand over the current minute (shutdown, or the minute turned)."""
        if self.minute is None or not self._n.any():
            return None
        finished = (self.minute, self._rows())
        self._n[:] = 0
        self._total[:] = 0.0
        # A counter unseen for FORGET_AFTER_MINUTES is forgotten; a series absent all
        # minute with nothing to remember gives its column back.
        forgotten = self._previous_minute < self.minute - FORGET_AFTER_MINUTES
        self._previous[forgotten] = NAN
        key_of = self.columns.key_of
        held = slice(0, len(key_of))
        gone = np.flatnonzero((self._seen_minute[held] < self.minute) &
                              np.isnan(self._previous[held]))
        gone_keys = [key_of[a] for a in gone.tolist() if key_of[a] is not None]
        if gone_keys:
            self.columns.release(gone_keys)
        return finished

    def current(self) -> tuple | None:
        """(minute, a copy of its rows, the latest cycle's time) of the minute in progress,
        for queries."""
        if self.minute is None or not self._n.any():
            return None
        return self.minute, self._rows(), self.last_time


_COUNTER, _GAUGE = 1, 2
_KIND_CODES = {COUNTER: _COUNTER, GAUGE: _GAUGE}


class HistoryWriter:
    """Writes finished minutes to the store on its own thread, and prunes old history
    (and old alert transitions and finished deliveries) once an hour."""

    def __init__(self, store, retention_seconds: float = DEFAULT_RETENTION_SECONDS):
        self.store = store
        self.retention_seconds = retention_seconds
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.io_lock = threading.Lock()  # a write and its dequeue, against history reads
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_prune = -math.inf
        self.failing = ""  # why the last write failed ("" when it did not)
        self._dropping = False  # minutes are being dropped over the cap (said once)

    def submit(self, finished: tuple | None) -> None:
        if finished is None:
            return
        with self._lock:
            self._queue.append(finished)
            while len(self._queue) > MAX_UNWRITTEN_MINUTES:
                self._queue.popleft()  # the oldest unwritten minute is lost
                if not self._dropping:
                    self._dropping = True
                    log.error("history: %d minutes held in memory while the store is "
                              "unreachable; the oldest are lost from now on",
                              MAX_UNWRITTEN_MINUTES)
        self._wake.set()

    def unwritten(self) -> list[tuple]:
        with self._lock:
            return list(self._queue)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ac-history", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=60.0)
            self._wake.clear()
            self.write_pending()
            if not self.failing and time.time() - self._last_prune >= 3600.0:
                self.prune(time.time())
            if self.failing:
                self._stop.wait(5.0)  # the store is down: retry, keeping what is queued

    def write_pending(self, timeout: float = -1) -> None:
        """Everything queued, in one transaction (after an outage, too)."""
        if not self.io_lock.acquire(timeout=timeout):
            log.warning("history: %d minutes not written (a query held the store past "
                        "the shutdown)", len(self._queue))
            return
        try:
            self._write_pending()
        finally:
            self.io_lock.release()

    def _write_pending(self) -> None:
        with self._lock:
            batch = list(self._queue)
        if not batch:
            return
        try:
            self.store.write_minutes(batch)
        except StoreUnavailable as exc:  # an outage, told once by the store: keep them
            self.failing = str(exc)
            return
        except Exception as exc:  # a bug: keep the minutes, try again later
            if not self.failing:
                log.exception("cannot write history to the store; keeping it in memory "
                              "and retrying")
            self.failing = type(exc).__name__
            return
        if self.failing and len(batch) > 1:
            log.info("history: the %d minutes kept in memory are written", len(batch))
        self.failing = ""
        self._dropping = False
        written = {id(item) for item in batch}  # alive in `batch`: ids are unique
        with self._lock:  # (some may have been dropped over the cap meanwhile)
            while self._queue and id(self._queue[0]) in written:
                self._queue.popleft()

    def prune(self, now: float) -> None:
        self._last_prune = now
        try:
            removed = self.store.prune(now - self.retention_seconds)
        except StoreUnavailable:  # told by the store; pruned when it is back (an hour on)
            return
        except Exception:
            log.exception("pruning the store failed")
            return
        if any(removed.values()):
            log.info("pruned history older than %.0f days: %s",
                     self.retention_seconds / 86400, removed)

    def stop(self, last: tuple | None = None) -> None:
        self.submit(last)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        # What is left: retried for a while if the store cannot take it yet (a disk just
        # freed, a database restarting), then its loss is said.
        deadline = time.monotonic() + SHUTDOWN_RETRY_SECONDS
        self.write_pending(timeout=10.0)
        while self.failing and self._queue and time.monotonic() < deadline:
            time.sleep(1.0)
            self.write_pending(timeout=10.0)
        if self._queue:
            minutes = [item[0] for item in self.unwritten()]
            log.error("history: %d minutes (%s to %s UTC) could not be written before "
                      "exit and are lost: %s", len(minutes), _clock(min(minutes)),
                      _clock(max(minutes) + 1), self.failing or "the store was busy")


def _clock(minute: int) -> str:
    return time.strftime("%H:%M", time.gmtime(minute * MINUTE))


class HistoryView(WindowView):
    """A WindowView built from minutes: one point per minute (at its end), counters as
    running sums of their increases from 0 one minute before their first, gauges as each
    minute's mean; `gauges` keeps each gauge's exact (n, sum, min, max, last) over the
    span and its per-minute (end, sum, n) for the trend; `coverage` is the share of the
    span's points (minutes, or groups of them) that hold any data, `key_coverage` that
    share for each series (each point counted by the series' cycles in it over the most
    cycles any series read has there: one seen for 3 of a minute's 60 covers 5 % of it,
    whatever the interval of the daemon that wrote it)."""
    __slots__ = ("gauges", "coverage", "key_coverage", "resolution_seconds")

    def __init__(self, times, series, gauges, coverage, key_coverage=None,
                 resolution_seconds: float = MINUTE):
        super().__init__(times, series, {k: -math.inf for k in series}, -math.inf)
        self.gauges, self.coverage = gauges, coverage
        self.key_coverage = key_coverage or {}
        self.resolution_seconds = resolution_seconds


def history_step(span_seconds: float) -> int:
    """Minutes per point for a window: 1 up to MAX_POINTS minutes (24 h), then as many as
    keep its whole minutes at most MAX_POINTS points (a week: 7). A window that does not
    start on a minute touches one minute more than it holds: that does not count."""
    return max(1, -(-int(span_seconds // MINUTE) // MAX_POINTS))


def group_minute(minute: int, first_minute: int, step: int) -> int:
    """The first minute of the group of `step` minutes that holds `minute`."""
    return first_minute + (minute - first_minute) // step * step


def build_view(minutes: dict[SeriesKey, list[tuple]], kinds: dict[str, str],
               first_minute: int, last_minute: int,
               in_progress: tuple[int, float] | None = None, step: int = 1) -> HistoryView:
    """minutes: series -> [(minute, n, total, min, max, last), ...] in minute order, one
    row per group of `step` minutes (its first minute) when step > 1.
    in_progress: (minute, time of its latest cycle): that minute's point sits at that time,
    not at the minute's end, so its rate is over the time it covers."""
    from array import array
    count = (last_minute - first_minute) // step + 1  # points (groups of `step` minutes)
    end = (last_minute + 1) * MINUTE
    times = array("d", [min(end, (first_minute + step * i) * MINUTE)
                        for i in range(count + 1)])
    times[count] = end
    if in_progress is not None and first_minute <= in_progress[0] <= last_minute:
        index = (in_progress[0] - first_minute) // step + 1
        times[index] = max(times[index - 1] + 1e-3, min(times[index], in_progress[1]))
    series: dict[SeriesKey, array] = {}
    gauges: dict[SeriesKey, tuple] = {}  # (n, total, min, max, last, trend events)
    used: set[int] = set()  # the points (minute groups) any series has data in
    key_coverage: dict[SeriesKey, float] = {}
    minutes = {key: [r for r in rows if first_minute <= r[0] <= last_minute]
               for key, rows in minutes.items()}
    cycles: dict[int, int] = {}  # point -> the most cycles any series has in it
    for rows in minutes.values():
        for row in rows:
            cycles[row[0]] = max(cycles.get(row[0], 0), row[1])
    for key, rows in minutes.items():
        values = array("d", [NAN]) * (count + 1)
        if not rows:
            continue
        if kinds.get(key[0]) == COUNTER:
            running = 0.0
            values[(rows[0][0] - first_minute) // step] = 0.0
            for minute, _n, total, *_ in rows:
                running += total
                values[(minute - first_minute) // step + 1] = running
        else:
            n_all = sum_all = 0.0
            low, high = math.inf, -math.inf
            trend = []
            for minute, n, total, vmin, vmax, _last in rows:
                index = (minute - first_minute) // step + 1
                values[index] = total / n
                n_all += n
                sum_all += total
                low, high = min(low, vmin), max(high, vmax)
                trend.append((times[index], total, n))
            gauges[key] = (int(n_all), sum_all, low, high, rows[-1][5], trend)
        used.update(r[0] for r in rows)
        series[key] = values
        key_coverage[key] = sum(row[1] / cycles[row[0]] for row in rows) / count
    return HistoryView(times, series, gauges, len(used) / count if count > 0 else 0.0,
                       key_coverage, MINUTE * step)


def merge_minutes(into: dict[SeriesKey, list[tuple]], minute: int,
                  rows: dict[SeriesKey, Row], wanted: set[str]) -> None:
    """Adds an unwritten (or in-progress) minute's rows to rows read from the store."""
    for key, row in rows.items():
        if key[0] not in wanted:
            continue
        existing = into.setdefault(key, [])
        if not existing or existing[-1][0] < minute:  # the usual case: a later minute
            existing.append((minute, *row))
            continue
        i = bisect.bisect_left(existing, minute, key=lambda r: r[0])
        if i < len(existing) and existing[i][0] == minute:
            # partly written before a restart: merge as the store does
            existing[i] = merge_row(existing[i], (minute, *row))
        else:
            existing.insert(i, (minute, *row))


def merge_row(old: tuple, new: tuple) -> tuple:
    minute, n, total, vmin, vmax, last = old
    _, n2, total2, vmin2, vmax2, last2 = new
    if vmin is None or vmin2 is None:
        return minute, n + n2, total + total2, vmin, vmax, last2
    return minute, n + n2, total + total2, min(vmin, vmin2), max(vmax, vmax2), last2
