"""Engine collector: every engine under the telemetry root, read from its files.

Each engine directory holds `engine.json` (refreshed every second as a heartbeat) and
prometheus_client multiprocess `.db` files (`ac_observe.telemetry_format`). An engine
whose heartbeat stopped keeps its series for a grace period (a restart within it
continues its counters), then they vanish and, once its process is gone, its telemetry
files are removed (and its directory, if nothing else is in it).

NOTE: the directory is hostile input. Each engine is read on its own; a directory that
is not safe or not well formed is that engine's problem (reported in `status` with the
reason), never another's. Only families and labels of the metric contract are exported,
so a bad file cannot inject series, and reads never block, follow symlinks or grow
without bound.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ac_observe.collectors.base import (Collector, CollectorUnavailable, new_family,
                                        register)
from ac_observe.metrics import (COUNTER, ENGINE_METRICS, ENGINE_RESTARTS, ENGINE_UP,
                                HISTOGRAM, LABEL_VALUES)
from ac_observe.telemetry_format import (ENGINE_INFO_FILE, MAX_DB_BYTES, MAX_INFO_BYTES,
                                         UnsafeDirectory, open_dir_nofollow,
                                         open_trusted_dir, parse_db_file_name,
                                         parse_engine_info, parse_sample_key, pid_alive,
                                         read_regular_file, remove_engine_dir, scan_entries,
                                         used_size)

log = logging.getLogger("ac_observe.collectors.engine")

MAX_SERIES_PER_ENGINE = 50_000
MAX_ENTRIES_PER_ENGINE = 4 * MAX_SERIES_PER_ENGINE  # across the files of all its pids
MAX_LABEL_VALUE_CHARS = 256
MAX_ENGINE_DIRS = 1024
_FIRST_ENTRY_BYTES = 64
_SPECS = {spec.family: spec for spec in ENGINE_METRICS}
_ALLOWED_VALUES = {label: frozenset(values) for label, values in LABEL_VALUES.items()}


class BadEngine(ValueError):
    """An engine directory that cannot be read; the reason names what to fix."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """One checked key: where its value goes in the exposition, built once per key so a
    cycle only adds values (NOTE: the label dicts are shared; nobody mutates them)."""
    family: str
    sample: str
    labels: tuple              # in the contract's label order, without le
    le: float | None
    sample_labels: dict        # the sample's labels, le included for a bucket
    count_labels: dict         # a bucket's `_count` labels (its labels without le)
    watch_key: tuple           # (sample, labels as the exposition orders them): the
                               # series' key in the daemon's windows (one per series)


class _FileIndex:
    """Where the entries of one `.db` file sit, parsed once (the format only appends).

    A cycle reads the used part of the file in one bounded `pread` and takes every known
    value out of it with one numpy gather (no JSON parse, no Python per value): `read`
    gives the values in the order of `keys`.
    """
    __slots__ = ("identity", "used", "entries", "rejected", "keys", "layout", "_at")

    def __init__(self):
        self.identity: tuple = ()
        self.used = 8
        self.entries: list[tuple[int, str]] = []  # (value offset, key)
        self.rejected: tuple | None = None        # (file version, reason): not re-read
        self.keys: tuple[str, ...] = ()           # the entries' keys, as `read` gives values
        self.layout = 0  # changes whenever `keys` does (numbers are never reused)
        self._at: np.ndarray | None = None  # each value's index as a float64 of the file

    def read(self, dir_fd: int, name: str) -> np.ndarray | None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadEngine(f"{name} is not a regular file")
            header = os.pread(fd, 4, 0)
            # What the file is now: a rejection stands only while none of this changes
            # (the header too: on tmpfs, mmap writes leave size and mtime as they were).
            version = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, header)
            if self.rejected and self.rejected[0] == version:
                raise BadEngine(self.rejected[1])
            try:
                data = self._read_used(fd, info, header)
            except ValueError as exc:
                self.rejected = (version, f"{name}: {exc}")
                raise BadEngine(self.rejected[1]) from None
        finally:
            os.close(fd)
        self.rejected = None
        if not data:
            return None
        if len(self.entries) > MAX_SERIES_PER_ENGINE:
            raise BadEngine(f"{name} holds more than {MAX_SERIES_PER_ENGINE} series")
        if self._at is None:  # entries were added, or the file started over
            # Every value sits at a multiple of 8 (scan_entries pads keys so), as a double
            # in native byte order (the writer packs "d").
            self.keys = tuple(key for _, key in self.entries)
            self._at = np.fromiter((at >> 3 for at, _ in self.entries), dtype=np.intp,
                                   count=len(self.entries))
            self.layout = next(_LAYOUTS)
        return np.frombuffer(data, dtype=np.float64, count=len(data) >> 3)[self._at]

    def _read_used(self, fd: int, info: os.stat_result, header: bytes) -> bytes:
        if len(header) < 4 or header == b"\0\0\0\0":
            return b""  # created, not yet initialised by its writer: empty for now
        used = used_size(header)
        if used > min(info.st_size, MAX_DB_BYTES):
            raise ValueError(f"claims {used} bytes; it holds {info.st_size} (limit "
                             f"{MAX_DB_BYTES})")
        data = os.pread(fd, used, 0)
        if len(data) < used:  # truncated between fstat and pread
            raise ValueError(f"claims {used} bytes; {len(data)} could be read")
        # A new file under that name starts over (an inode number can be reused, so
        # another engine's file is also told apart by its first key).
        identity = (info.st_dev, info.st_ino, bytes(data[8:8 + _FIRST_ENTRY_BYTES]))
        if identity != self.identity or used < self.used:
            self.identity, self.used, self.entries = identity, 8, []
            self._at = None
        entries, self.used = scan_entries(data, self.used, len(data))
        if entries:
            self.entries.extend(entries)
            self._at = None
        return data


_LAYOUTS = itertools.count(1)


@dataclass(slots=True)
class EngineState:
    name: str                  # the directory's name under the root
    info: dict
    alive: bool
    last_heartbeat: float
    error: str = ""            # unusable: why (its series are not exported)
    warning: str = ""          # usable, but entries were skipped: why
    restarts: int = 0
    inherited: bool = False    # files of an earlier process: its counts carry on from them


@dataclass(slots=True)
class _EngineReader:
    """Everything remembered about one engine directory between cycles."""
    files: dict[str, _FileIndex] = field(default_factory=dict)
    keys: dict[str, _Entry | str] = field(default_factory=dict)  # str: why it is skipped
    identity: tuple = ()   # (engine_id, engine, model) the checked keys were checked against
    restarts: int = 0
    plan: "_Plan | None" = None  # how its files become series, while their keys hold
    refused: tuple = ()  # (layout, why) of files with too many keys: not counted again


GONE_KEEP_SECONDS = 3600.0  # a gone engine's ac_engine_up stays at 0 this long


@register("engine")
class EngineCollector(Collector):
    def __init__(self, config):
        self.root = Path(config.telemetry_root)
        self.stale_seconds = config.engine_stale_seconds
        self.grace_seconds = config.engine_grace_seconds
        self.engines: dict[str, EngineState] = {}
        self._readers: dict[str, _EngineReader] = {}
        self._last_seen: dict[str, tuple[str, float]] = {}  # engine -> (model, heartbeat)
        self._exported: set[str] = set()     # engines whose series the last collect gave
        # The start times of the last look and of the one before it (None: not yet).
        self._looks: tuple[float | None, float | None] = (None, None)
        self._seen_dirs: set[str] = set()   # directories the last look read as engines
        self._with_past: list[dict[str, str]] = []

    def with_past(self) -> list[dict[str, str]]:
        return self._with_past

    def _note_new_engines(self, served: dict[str, str], seen: dict, now: float) -> None:
        """An engine exported now and not last time brings counters with a past when the
        daemon did not watch them grow:
        - found at the daemon's first look, or started before it;
        - no (finite) start time;
        - files of an earlier process in its directory (its counts carry on from theirs);
        - back after a spell as a bad directory, a name clash or silence: started before
          the last look, which saw its directory and did not export it;
        - found late: started before the look before last, its directory unseen by the last.

        NOTE: an engine counts nothing before its engine.json exists, and the bundled one
        takes its start time just before writing that file (engine/telemetry.py); other
        writers may take it earlier. An engine started just before the last look whose
        file came just after it was unseen by that look, yet counted nothing the daemon
        missed: it counts from zero (its first requests are increases, not a base)."""
        self._with_past = []
        before_last, last = self._looks
        for engine, name in served.items():
            if engine in self._exported:
                continue
            state = seen[name]
            started = state.info.get("started_at")
            since = last if name in self._seen_dirs or before_last is None else before_last
            if last is None or state.inherited or not isinstance(started, (int, float)) or \
                    not math.isfinite(started) or started < since:
                self._with_past.append({"engine": engine})
        self._exported, self._looks, self._seen_dirs = set(served), (last, now), set(seen)

    def collect(self):
        now = time.time()
        try:
            # The daemon may run as root and removes gone engines' files: it reads a root
            # no other user can redirect (see open_trusted_dir), never one it was lured to.
            root_fd = open_trusted_dir(self.root, "telemetry root")
        except FileNotFoundError:
            self.engines, self._readers = {}, {}
            self._note_new_engines({}, {}, now)
            return []
        except UnsafeDirectory as exc:
            raise CollectorUnavailable(f"{exc}; point --telemetry-root at a directory "
                                       "owned by root or this user") from None
        try:
            root_owner = os.fstat(root_fd).st_uid
            families: dict[str, Metric] = {}
            seen: dict[str, EngineState] = {}
            served: dict[str, str] = {}  # engine label -> directory serving it
            for name in sorted(os.listdir(root_fd)):
                if len(seen) >= MAX_ENGINE_DIRS:
                    log.warning("more than %d engine directories: the rest are not read",
                                MAX_ENGINE_DIRS)
                    break
                reader = self._readers.setdefault(name, _EngineReader())
                try:
                    state, samples = self._read_engine(root_fd, root_owner, name, reader, now)
                except BadEngine as exc:
                    seen[name] = EngineState(name, {}, False, 0.0, str(exc), "",
                                             reader.restarts)
                    continue
                if state is None:
                    continue
                engine = state.info["engine"]
                if engine in served:
                    state.error = (f"engine name {engine!r} is already served by directory "
                                   f"{served[engine]!r}; its series are not exported")
                    seen[name] = state
                    continue
                served[engine] = name
                seen[name] = state
                samples.add_to(families)
            self.engines = seen
            self._note_new_engines(served, seen, now)
            self._readers = {n: r for n, r in self._readers.items() if n in seen}
            restarts = new_family(ENGINE_RESTARTS)
            for state in seen.values():
                if state.info and not state.error:
                    restarts.add_metric([state.info["engine"]], state.restarts)
            return [*families.values(), restarts, self._engine_up(seen, now)]
        finally:
            os.close(root_fd)

    def _engine_up(self, seen: dict[str, EngineState], now: float) -> Metric:
        """1 per engine whose heartbeat is fresh, 0 for one that went stale, and still 0
        for an hour after the last heartbeat of one whose directory is gone (an engine
        that is gone for good reads as down, not as absent)."""
        up = new_family(ENGINE_UP)
        current = {}
        for state in seen.values():
            if state.info and not state.error:
                engine = state.info["engine"]
                current[engine] = (state.info["model"], state.last_heartbeat)
                up.add_metric([engine, state.info["model"]], 1.0 if state.alive else 0.0)
        for engine, (model, heartbeat) in list(self._last_seen.items()):
            if engine in current:
                continue
            if now - heartbeat > GONE_KEEP_SECONDS:
                del self._last_seen[engine]
            else:
                up.add_metric([engine, model], 0.0)
        self._last_seen.update(current)
        return up

    def _read_engine(self, root_fd: int, root_owner: int, name: str, reader: _EngineReader,
                     now: float):
        """(state, samples) of one engine directory; (None, None) when it is not one."""
        try:
            dir_fd = open_dir_nofollow(name, root_fd)
        except (NotADirectoryError, FileNotFoundError):
            return None, None
        except OSError as exc:
            if os.path.islink(os.path.join(self.root, name)):
                raise BadEngine("is a symlink; engine directories must be real directories") \
                    from None
            raise BadEngine(f"cannot open: {exc.strerror}") from None
        try:
            info_stat = self._check_dir(dir_fd, root_owner)
            if info_stat is None:
                return None, None  # not an engine directory (no engine.json)
            heartbeat = info_stat.st_mtime
            alive = now - heartbeat <= self.stale_seconds
            if not alive and now - heartbeat > self.stale_seconds + self.grace_seconds:
                self._forget(root_fd, name, _read_info_or_none(dir_fd))
                return None, None
            try:
                info = parse_engine_info(read_regular_file(dir_fd, ENGINE_INFO_FILE,
                                                           MAX_INFO_BYTES))
            except ValueError as exc:
                raise BadEngine(str(exc)) from None
            identity = (info.get("engine_id", str(info["pid"])), info["engine"], info["model"])
            if reader.identity != identity:
                if reader.identity and identity[0] != reader.identity[0]:
                    reader.restarts += 1  # a new engine in the same directory
                reader.identity = identity
                reader.keys.clear()  # keys are checked against engine.json's labels
                reader.plan, reader.refused = None, ()
            samples, warning, inherited = self._read_samples(dir_fd, info, reader)
        except OSError as exc:  # unreadable in any way: this engine's problem alone
            raise BadEngine(f"cannot read: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        return EngineState(name, info, alive, heartbeat, "", warning, reader.restarts,
                           inherited), samples

    @staticmethod
    def _check_dir(dir_fd: int, root_owner: int) -> os.stat_result | None:
        info = os.fstat(dir_fd)
        if info.st_uid not in (root_owner, os.geteuid()):
            raise BadEngine(f"is owned by uid {info.st_uid}; the telemetry root belongs to "
                            f"uid {root_owner}")
        if info.st_mode & 0o022:
            raise BadEngine(f"is writable by other users (mode "
                            f"{stat.S_IMODE(info.st_mode):04o}): chmod go-w it")
        try:
            info_stat = os.stat(ENGINE_INFO_FILE, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info_stat.st_mode):
            raise BadEngine(f"{ENGINE_INFO_FILE} is not a regular file")
        return info_stat

    def _read_samples(self, dir_fd: int, info: dict, reader: _EngineReader) -> tuple:
        """(this cycle's values laid out by the engine's plan, why entries were skipped or
        "", whether files of a pid other than engine.json's are among them)."""
        pids = {name: parsed[1] for name in os.listdir(dir_fd)
                if (parsed := parse_db_file_name(name))}
        names = list(pids)
        reader.files = {n: i for n, i in reader.files.items() if n in names}
        indexes, values, entries = [], [], 0
        for name in names:
            index = reader.files.get(name)
            if index is None:
                index = reader.files[name] = _FileIndex()
            try:
                read = index.read(dir_fd, name)
            except FileNotFoundError:
                continue  # removed under us (a dead pid's gauges)
            if read is not None:
                indexes.append(index)
                values.append(read)
                entries += len(read)
                if entries > MAX_ENTRIES_PER_ENGINE:  # many pids' files: stop reading
                    raise BadEngine(f"more than {MAX_ENTRIES_PER_ENGINE} entries in its "
                                    "files")
        layout = tuple(index.layout for index in indexes)
        plan = reader.plan
        if plan is None or plan.layout != layout:
            reader.plan = None
            if reader.refused and reader.refused[0] == layout:  # files as they were
                raise BadEngine(reader.refused[1])
            # Counted before a key is parsed (skipped ones too): a directory of foreign
            # keys costs neither the parsing nor the memory of more than the limit.
            if _too_many_keys(indexes):
                reader.keys.clear()
                reader.refused = (layout, f"more than {MAX_SERIES_PER_ENGINE} keys")
                raise BadEngine(reader.refused[1])
            if len(reader.keys) > 2 * MAX_SERIES_PER_ENGINE:
                reader.keys.clear()  # churned by rewritten files: parse afresh
            expected = {"engine": info["engine"], "model": info["model"]}
            plan = reader.plan = _Plan(layout, [index.keys for index in indexes],
                                       reader.keys, expected)
        return plan.evaluate(values), plan.warning, any(pid != info["pid"]
                                                        for pid in pids.values())

    def _forget(self, root_fd: int, name: str, info: dict | None) -> None:
        """Past the grace period: drop its series; remove its files once its process is
        gone. Only a directory whose engine.json is ours, naming a dead process, and that
        no engine holds (its lock) is ever touched."""
        if info is None or pid_alive(info["pid"]):
            return  # not ours to judge, or alive but silent (stopped, another pid namespace)
        try:
            left = remove_engine_dir(root_fd, name)
        except OSError as exc:
            log.warning("cannot remove telemetry of %s: %s", name, exc)
            return
        if left is None:
            return  # an engine holds it again
        log.info("removed telemetry of vanished engine %s (pid %s)%s", name, info["pid"],
                 f"; left {len(left)} other file(s) in place" if left else "")

    def status(self) -> list[dict]:
        now = time.time()
        return [{"engine": s.info.get("engine"), "model": s.info.get("model"),
                 "pid": s.info.get("pid"), "api_address": s.info.get("api_address"),
                 "alive": s.alive and not s.error, "restarts": s.restarts,
                 "heartbeat_age_seconds": round(now - s.last_heartbeat, 1)
                 if s.last_heartbeat else None,
                 "directory": str(self.root / s.name), "error": s.error, "warning": s.warning}
                for s in self.engines.values()]


def _too_many_keys(indexes: list[_FileIndex]) -> bool:
    """More distinct keys across these files than an engine may have."""
    keys: set[str] = set()
    for index in indexes:
        keys.update(index.keys)
        if len(keys) > MAX_SERIES_PER_ENGINE:
            return True
    return False


def _read_info_or_none(dir_fd: int) -> dict | None:
    try:
        return parse_engine_info(read_regular_file(dir_fd, ENGINE_INFO_FILE, MAX_INFO_BYTES))
    except (OSError, ValueError):
        return None


def _bound_texts(spec) -> frozenset[str]:
    """The `le` values the writer puts in a histogram's keys, exactly as it spells them."""
    return frozenset([repr(float(b)) for b in spec.buckets] + ["+Inf"])


_LE_TEXTS = {spec.family: _bound_texts(spec) for spec in ENGINE_METRICS
             if spec.type == HISTOGRAM}


def _check_key(key: str, expected: dict[str, str]) -> _Entry | str:
    """The entry a key stands for if it is a series of the contract, else why not."""
    try:
        family, sample, labels, _ = parse_sample_key(key)
    except ValueError as exc:
        return str(exc)
    spec = _SPECS.get(family)
    if spec is None:
        return f"{family[:80]!r} is not an engine family"
    le = labels.pop("le", None)
    if spec.type == HISTOGRAM:
        if sample == f"{family}_bucket" and le is not None:
            if le not in _LE_TEXTS[family]:  # one spelling per bound: no duplicate buckets
                return f"{family}: le={le[:20]!r} is not one of its buckets"
            le = float(le)
        elif sample != f"{family}_sum" or le is not None:
            return f"{sample[:80]!r} is not a sample of {family}"
    elif le is not None or sample != (spec.name if spec.type == COUNTER else family):
        return f"{sample[:80]!r} is not a sample of {family}"
    if set(labels) != set(spec.labels):
        return f"{family}: labels {sorted(labels)[:8]} are not {list(spec.labels)}"
    for label, value in labels.items():
        allowed = _ALLOWED_VALUES.get(label)
        if label in expected and value != expected[label]:
            return f"{family}: {label}={value[:40]!r}, engine.json says {expected[label]!r}"
        if (allowed is not None and value not in allowed) or \
                not 0 < len(value) <= MAX_LABEL_VALUE_CHARS:
            return f"{family}: {label}={value[:40]!r} is not allowed"
    ordered = tuple((label, labels[label]) for label in spec.labels)
    sample_labels = dict(ordered)
    if le is not None:
        sample_labels["le"] = floatToGoString(le)
    return _Entry(family, sample, ordered, le, sample_labels, dict(ordered),
                  (sample, tuple(sample_labels.items())))


# Every bound of each histogram family, +Inf last: a series exposes all of them (the
# writer stores only the buckets that were hit; Prometheus' histogram_quantile answers NaN
# for a series without its +Inf bucket).
_BOUNDS = {spec.family: sorted({float(b) for b in spec.buckets} | {math.inf})
           for spec in ENGINE_METRICS if spec.type == HISTOGRAM}
_FAMILY_ORDER = {spec.family: i for i, spec in enumerate(ENGINE_METRICS)}
_SAMPLE_REST = (None,) * (len(Sample._fields) - 3)  # timestamp, exemplar, ... all None


class EngineFamily(Metric):
    """A family of the engines' series, made from each engine's values of the cycle.

    It carries them as `blocks`: one (keys, values) pair per engine, the keys a tuple of
    the series' window keys (sample name, ((label, value), ...)) that stays the same
    object while the engine's files keep their layout, the values a float64 array of
    this cycle. The daemon's windows and history take a cycle from them with a few array
    operations (see daemon.windows.Frame) instead of a tuple and a dict entry per sample.
    `samples` are made on first use only (a render, not every cycle: under a Prometheus
    at 15 s, 14 cycles in 15 are never rendered), reusing each series' last `Sample`
    while its value holds (see _Plan.samples)."""

    def __init__(self, spec):
        # One engine's share each: (its plan, the cycle's values, where this family's
        # series sit in them, their keys).
        self._parts: list[tuple[_Plan, np.ndarray, int, int, tuple]] = []
        self._made: list | None = None
        super().__init__(spec.family, spec.help, spec.type)

    @property
    def blocks(self) -> list[tuple[tuple, np.ndarray]]:
        return [(keys, values[start:end]) for _, values, start, end, keys in self._parts]

    @property
    def samples(self) -> list:
        made = self._made
        if made is None:  # two threads may both make them: the same samples, either way
            made = []
            for plan, values, start, end, _ in self._parts:
                made += plan.samples(values, start, end)
            self._made = made
        return made

    @samples.setter
    def samples(self, value: list) -> None:  # Metric.__init__ sets an empty list
        self._made = value or None


class _Plan:
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
        self.layout = layout
        slot_of: dict[tuple, int] = {}  # a series' watch key -> its slot in the totals
        stored: list[_Entry] = []
        skipped: dict[str, str] = {}
        sources = []
        for keys in file_keys:
            for key in keys:
                entry = checked.get(key)
                if entry is None:
                    entry = checked[key] = _check_key(key, expected)
                if isinstance(entry, str):
                    skipped[key] = entry
                    sources.append(-1)
                    continue
                slot = slot_of.get(entry.watch_key)
                if slot is None:
                    slot = slot_of[entry.watch_key] = len(stored)
                    stored.append(entry)
                sources.append(slot)
        zero = len(stored)  # a slot that is always 0.0 (skipped entries are summed there)
        self._zero = zero
        self._sources = np.array([zero if s < 0 else s for s in sources], dtype=np.intp)
        self.warning = (f"{len(skipped)} entries skipped, e.g. {next(iter(skipped.values()))}"
                        if skipped else "")
        # The exposition, family by family (the contract's order): the family's own
        # samples (a histogram's _sum), then each label set's buckets, bound by bound,
        # and its _count.
        by_family: dict[str, tuple[list, dict]] = {}
        for slot, entry in enumerate(stored):
            scalars, groups = by_family.setdefault(entry.family, ([], {}))
            if entry.le is None:
                scalars.append(slot)
            else:
                groups.setdefault(entry.labels, (entry, {}))[1][entry.le] = slot
        scalar_slots, rows_by_length, order = [], {}, []  # order: where each exposed
        names, labels, watch_keys = [], [], []            # value sits in the computed ones
        self.segments: list[tuple[str, int, int, tuple]] = []
        for family in sorted(by_family, key=_FAMILY_ORDER.__getitem__):
            scalars, groups = by_family[family]
            start = len(names)
            for slot in scalars:
                entry = stored[slot]
                order.append(("scalar", len(scalar_slots)))
                scalar_slots.append(slot)
                names.append(entry.sample)
                labels.append(entry.sample_labels)
                watch_keys.append(entry.watch_key)
            for entry, per_bound in groups.values():
                bounds = _BOUNDS[family]
                rows = rows_by_length.setdefault(len(bounds) + 1, [])
                row = len(rows)
                rows.append([per_bound.get(bound, zero) for bound in bounds] + [zero])
                for column, bound in enumerate(bounds):
                    sample_labels = {**entry.count_labels, "le": floatToGoString(bound)}
                    order.append((len(bounds) + 1, row * (len(bounds) + 1) + column))
                    names.append(f"{family}_bucket")
                    labels.append(sample_labels)
                    watch_keys.append((f"{family}_bucket", tuple(sample_labels.items())))
                order.append((len(bounds) + 1, row * (len(bounds) + 1) + len(bounds)))
                names.append(f"{family}_count")
                labels.append(entry.count_labels)
                watch_keys.append((f"{family}_count", tuple(entry.count_labels.items())))
            self.segments.append((family, start, len(names), tuple(watch_keys[start:])))
        self._scalars = np.array(scalar_slots, dtype=np.intp)
        self._rows = [(length, np.array(rows, dtype=np.intp))
                      for length, rows in rows_by_length.items()]
        base, where = {"scalar": 0}, len(scalar_slots)  # each part's start in the values
        for length, rows in self._rows:
            base[length] = where
            where += rows.size
        self._order = np.array([base[part] + at for part, at in order], dtype=np.intp)
        self._identity = bool(np.array_equal(self._order, np.arange(len(order))))
        self._names, self._labels = names, labels
        self._samples: list[Sample | None] = [None] * len(names)
        self._held = np.full(len(names), np.nan)  # the values _samples hold (NaN: none)
        self._lock = threading.Lock()  # samples are asked for by a render and a cycle

    def evaluate(self, values: list[np.ndarray]) -> "_EngineValues":
        raw = values[0] if len(values) == 1 else np.concatenate(values) if values else \
            np.zeros(0)
        totals = np.bincount(self._sources, weights=raw, minlength=self._zero + 1)
        totals[self._zero] = 0.0
        parts = [totals[self._scalars]]
        parts += [np.cumsum(totals[rows], axis=1).ravel() for _, rows in self._rows]
        exposed = np.concatenate(parts)
        if not self._identity:
            exposed = exposed[self._order]
        return _EngineValues(self, exposed)

    def samples(self, exposed: np.ndarray, start: int, end: int) -> list[Sample]:
        """The Samples of exposed[start:end] (one cycle's values): each series' last one
        while its value holds, a new one where it moved (NaN != NaN: made anew, rightly)."""
        with self._lock:
            samples, held = self._samples, self._held
            moved = np.flatnonzero(exposed[start:end] != held[start:end]) + start
            names, labels, make = self._names, self._labels, tuple.__new__
            for i, value in zip(moved.tolist(), exposed[moved].tolist()):
                # Sample(name, labels, value), without its Python __new__ (half the time)
                samples[i] = make(Sample, (names[i], labels[i], value) + _SAMPLE_REST)
            held[moved] = exposed[moved]
            return samples[start:end]


class _EngineValues:
    """One engine's exposed values of one cycle, laid out by its plan."""
    __slots__ = ("plan", "values")

    def __init__(self, plan: _Plan, values: np.ndarray):
        self.plan, self.values = plan, values

    def add_to(self, families: dict[str, EngineFamily]) -> None:
        plan, values = self.plan, self.values
        for family, start, end, keys in plan.segments:
            metric = families.get(family)
            if metric is None:
                metric = families[family] = EngineFamily(_SPECS[family])
            metric._parts.append((plan, values, start, end, keys))
