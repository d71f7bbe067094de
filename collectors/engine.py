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

import logging
import math
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    watch_key: tuple           # (sample, labels as the exposition orders them): see _merge


class _FileIndex:
    """Where the entries of one `.db` file sit, parsed once (the format only appends).

    A cycle reads the used part of the file in one bounded `pread` and unpacks every known
    value with one `struct` call laid out from the entries (no JSON parse, no Python per
    value); `read` gives (key, value) pairs.
    """
    __slots__ = ("identity", "used", "entries", "rejected", "unique", "_keys", "_values")

    def __init__(self):
        self.identity: tuple = ()
        self.used = 8
        self.entries: list[tuple[int, str]] = []  # (value offset, key)
        self.rejected: tuple | None = None        # (file version, reason): not re-read
        self._keys: tuple[str, ...] = ()
        self._values: struct.Struct | None = None  # unpacks every value in one call
        self.unique = True  # no key twice (a hostile file may repeat one: those add up)

    def read(self, dir_fd: int, name: str):
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
            return ()
        if len(self.entries) > MAX_SERIES_PER_ENGINE:
            raise BadEngine(f"{name} holds more than {MAX_SERIES_PER_ENGINE} series")
        if self._values is None:  # entries were added, or the file started over
            self._keys, self._values = _values_struct(self.entries)
            self.unique = len(set(self._keys)) == len(self._keys)
        return zip(self._keys, self._values.unpack_from(data)) if self._keys else ()

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
            self._values = None
        entries, self.used = scan_entries(data, self.used, len(data))
        if entries:
            self.entries.extend(entries)
            self._values = None
        return data


def _values_struct(entries: list[tuple[int, str]]) -> tuple[tuple, struct.Struct]:
    """The keys of a file's entries and a Struct reading all their values at once (each
    is a double in native byte order at its offset; the format skips the bytes between)."""
    parts, pos = ["="], 0  # native order, as the writer packs ("d"), no alignment
    for at, _ in entries:
        parts.append(f"{at - pos}xd" if at > pos else "d")
        pos = at + 8
    return tuple(key for _, key in entries), struct.Struct("".join(parts))


@dataclass(slots=True)
class EngineState:
    name: str                  # the directory's name under the root
    info: dict
    alive: bool
    last_heartbeat: float
    error: str = ""            # unusable: why (its series are not exported)
    warning: str = ""          # usable, but entries were skipped: why
    restarts: int = 0


@dataclass(slots=True)
class _EngineReader:
    """Everything remembered about one engine directory between cycles."""
    files: dict[str, _FileIndex] = field(default_factory=dict)
    keys: dict[str, _Entry | str] = field(default_factory=dict)  # str: why it is skipped
    identity: tuple = ()   # (engine_id, engine, model) the checked keys were checked against
    restarts: int = 0


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
        self._last_collect: float | None = None
        self._with_past: list[dict[str, str]] = []
        self._samples: dict[tuple, Sample] = {}  # the last cycle's, by watch key

    def with_past(self) -> list[dict[str, str]]:
        return self._with_past

    def _note_new_engines(self, served: dict[str, str], seen: dict, now: float) -> None:
        """An engine exported now and not last time, that started before the last look
        (back after a spell as a bad directory, a name clash or silence; or found late),
        brings counters with a past; one started since counts from zero."""
        self._with_past = []
        for engine, name in served.items():
            if engine in self._exported:
                continue
            started = seen[name].info.get("started_at")
            if self._last_collect is None or not isinstance(started, (int, float)) or \
                    started < self._last_collect:
                self._with_past.append({"engine": engine})
        self._exported, self._last_collect = set(served), now

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
            current: dict[tuple, Sample] = {}  # this cycle's samples, reused next cycle
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
                _merge(families, samples, self._samples, current)
            self.engines, self._samples = seen, current
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
            samples, warning = self._read_samples(dir_fd, info, reader)
        except OSError as exc:  # unreadable in any way: this engine's problem alone
            raise BadEngine(f"cannot read: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        return EngineState(name, info, alive, heartbeat, "", warning, reader.restarts), samples

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
        """(checked samples, why entries were skipped or "")."""
        totals: dict[str, float] = {}  # summed over the files of all pids
        names = set()
        for name in os.listdir(dir_fd):
            if parse_db_file_name(name) is None:
                continue
            names.add(name)
            index = reader.files.get(name)
            if index is None:
                index = reader.files[name] = _FileIndex()
            try:
                entries = index.read(dir_fd, name)
            except FileNotFoundError:
                continue  # removed under us (a dead pid's gauges)
            if totals or not index.unique:
                for key, value in entries:  # files of several pids: their series add up
                    totals[key] = totals.get(key, 0.0) + value
            else:
                totals.update(entries)
            if len(totals) > MAX_SERIES_PER_ENGINE:
                raise BadEngine(f"more than {MAX_SERIES_PER_ENGINE} series")
        reader.files = {n: i for n, i in reader.files.items() if n in names}
        expected = {"engine": info["engine"], "model": info["model"]}
        if len(reader.keys) > 2 * MAX_SERIES_PER_ENGINE:
            reader.keys.clear()  # churned by rewritten files: parse afresh
        samples, skipped, why = [], 0, ""
        for key, value in totals.items():
            entry = reader.keys.get(key)
            if entry is None:
                entry = reader.keys[key] = _check_key(key, expected)
            if isinstance(entry, str):
                skipped, why = skipped + 1, why or entry
            else:
                samples.append((entry, value))
        return samples, (f"{skipped} entries skipped, e.g. {why}" if skipped else "")

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
# (family, labels) -> ([(bound, its bucket's label dict, its watch key)], the _count's key)
_BUCKET_LABELS: dict[tuple, tuple[list[tuple], tuple]] = {}


def _bucket_labels(family: str, labels: tuple, count_labels: dict) -> tuple[list, tuple]:
    key = (family, labels)
    cached = _BUCKET_LABELS.get(key)
    if cached is None:
        if len(_BUCKET_LABELS) > 200_000:  # label churn: start over rather than grow
            _BUCKET_LABELS.clear()
        bounds = []
        for bound in _BOUNDS[family]:
            sample_labels = {**count_labels, "le": floatToGoString(bound)}
            bounds.append((bound, sample_labels,
                           (f"{family}_bucket", tuple(sample_labels.items()))))
        cached = _BUCKET_LABELS[key] = (bounds, (f"{family}_count",
                                                 tuple(count_labels.items())))
    return cached


class WatchedMetric(Metric):
    """A family that also carries its samples keyed as the daemon's windows key them,
    `watch`: {(sample name, ((label, value), ...)): value}, built from keys made once per
    series, so the daemon takes a cycle's values with one dict update instead of a tuple
    per sample (see Daemon._watched_samples). Every sample is added through `add`, which
    reuses the last cycle's `Sample` of a series whose value has not changed (`previous`,
    `current`: the collector's {watch key: Sample} of the last cycle and of this one)."""

    def __init__(self, name: str, documentation: str, typ: str, previous: dict,
                 current: dict):
        super().__init__(name, documentation, typ)
        self.watch: dict[tuple, float] = {}
        self._previous, self._current = previous, current

    def add(self, sample: str, labels: dict, value: float, watch_key: tuple) -> None:
        made = self._previous.get(watch_key)
        if made is None or made.value != value:  # NaN != NaN: a new one, rightly
            made = Sample(sample, labels, value)
        self.samples.append(made)
        self._current[watch_key] = made
        self.watch[watch_key] = value


def _merge(families: dict[str, WatchedMetric], samples: list, previous: dict,
           current: dict) -> None:
    """Add one engine's checked samples to the exposition's families (`previous` and
    `current`: see WatchedMetric)."""
    buckets: dict[tuple, dict] = {}
    for entry, value in samples:
        metric = families.get(entry.family)
        if metric is None:
            spec = _SPECS[entry.family]
            metric = families[entry.family] = WatchedMetric(spec.family, spec.help, spec.type,
                                                            previous, current)
        if entry.le is None:
            metric.add(entry.sample, entry.sample_labels, value, entry.watch_key)
        else:
            per_bound = buckets.get((entry.family, entry.labels))
            if per_bound is None:
                per_bound = buckets[(entry.family, entry.labels)] = {None: entry}
            per_bound[entry.le] = per_bound.get(entry.le, 0.0) + value
    for (family, labels), per_bound in buckets.items():
        metric = families[family]
        entry = per_bound[None]
        bounds, count_key = _bucket_labels(family, labels, entry.count_labels)
        total = 0.0
        for bound, sample_labels, watch_key in bounds:
            total += per_bound.get(bound, 0.0)  # stored per bucket; exposed cumulative
            metric.add(f"{family}_bucket", sample_labels, total, watch_key)
        metric.add(f"{family}_count", entry.count_labels, total, count_key)
