"""Engine -> daemon telemetry: prometheus_client multiprocess files plus `engine.json`.

The engine writes cumulative counters, histograms (raw per-bucket counts, as
prometheus_client's multiprocess mode stores them) and live-sum gauges into mmap `.db`
files in its own directory; any process reads them with `MultiProcessCollector`. Files
are named by pid, so a restarted engine's counters add onto its predecessor's and stay
monotonic; a dead pid's live gauges are removed when the next engine starts in the directory
(prometheus_client's `mark_process_dead`). The format itself is `ac_observe.telemetry_format`.

The engine's writer is buffered: events update its memory and `TelemetryWriter.flush`
writes what moved (the engine flushes at most every 50 ms after a step, on admission,
when idle and at close: engine/stats.py).

NOTE: torch-free; the writer is thread-safe (one lock), the engine is single-process.
"""
from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import secrets
import threading
import time

from ac_observe.metrics import (
    BUNDLED_ENGINE_METRICS,
    COUNTER,
    GAUGE,
    HISTOGRAM,
    OTHER_SKELETON,
    MetricSpec,
    label_values,
)
from ac_observe.telemetry_format import (
    ENGINE_INFO_FILE,
    TELEMETRY_FILE_MODE,
    TELEMETRY_FORMAT,
    ValueFile,
    db_file_name,
    open_engine_dir,
    remove_dead_gauges,
    sample_key,
)

log = logging.getLogger("ac_observe.engine")

_FILE_KINDS = {COUNTER: "counter", HISTOGRAM: "histogram", GAUGE: "gauge_livesum"}


def _float_text(value: float) -> str:
    """A bucket bound as prometheus_client writes it into the `le` label."""
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


class TelemetryWriter:
    """NOTE: every file is opened relative to the engine directory's descriptor, which
    `open_engine_dir` checked (ours, private, holding only telemetry) and locked for as
    long as this writer lives: nothing another user plants there is followed, no other
    engine writes there, and no daemon removes it."""

    def __init__(self, directory: str | os.PathLike, info: dict, engine: str, model: str,
                 specs: tuple[MetricSpec, ...] = BUNDLED_ENGINE_METRICS,
                 heartbeat_seconds: float = 1.0, buffered: bool = False):
        self.directory = directory
        self._dir_fd = open_engine_dir(directory)
        self._reap_dead_predecessor()
        pid = os.getpid()
        self._files = {typ: ValueFile(self._dir_fd, db_file_name(kind, pid))
                       for typ, kind in _FILE_KINDS.items()}
        self._base = {"engine": engine, "model": model}
        self._specs = frozenset(specs)
        # A file of this pid may exist already (an engine re-created in one process):
        # continue its counters rather than overwrite them.
        self._values: dict[str, float] = {**self._files[COUNTER].read_all(),
                                          **self._files[HISTOGRAM].read_all()}
        self._keys: dict[tuple, tuple] = {}
        # What moved since the last write, per file: {key: value}. Buffered (the engine),
        # events only touch memory and the owner's `flush` (engine/stats.py says when)
        # writes each moved series once, so a step costs one mmap write per series it
        # moved, not one per token and bucket; unbuffered, every event is written at once.
        # Either way a gauge set to the value it holds writes nothing.
        self._buffered = buffered
        self._sum_keys: set[str] = set()
        self._dirty: dict[str, dict[str, float]] = {typ: {} for typ in _FILE_KINDS}
        self._lock = threading.Lock()
        self._declare_series()
        self.flush()
        # started_at (unless given): the moment engine.json is written, after every series
        # is declared. The daemon tells an engine it watched being born (counts from zero)
        # from one found with a past by it (collectors/engine/collector.py `_note_new_engines`).
        self._write_info({"started_at": time.time(), **info, "engine": engine, "model": model,
                          "pid": pid, "telemetry_format": TELEMETRY_FORMAT})
        # The daemon reads engine.json's mtime as a heartbeat: a separate thread keeps it
        # fresh, so a busy or stuck engine loop still counts as alive while the process is.
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_seconds,),
                                           name="ac-telemetry-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self, period: float) -> None:
        while not self._closed.wait(period):
            try:
                os.utime(ENGINE_INFO_FILE, dir_fd=self._dir_fd, follow_symlinks=False)
            except OSError:
                pass  # removed by a daemon that judged us gone; nothing to refresh

    def _reap_dead_predecessor(self) -> None:
        remove_dead_gauges(self._dir_fd, keep_pid=os.getpid())

    def _write_info(self, info: dict) -> None:
        tmp = f".{ENGINE_INFO_FILE}.{os.getpid()}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     TELEMETRY_FILE_MODE, dir_fd=self._dir_fd)
        try:
            os.fchmod(fd, TELEMETRY_FILE_MODE)  # whatever the umask
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(info, indent=2, sort_keys=True))
            os.replace(tmp, ENGINE_INFO_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self._dir_fd)
            except OSError:
                pass
            raise

    def _declare_series(self) -> None:
        """Write every series a user expects at zero, so types and labels show before traffic:
        each closed label set in full, skeletons as their catch-all. Kernel-class histograms
        are the exception: they appear with the first sampled step (declaring 8 classes x
        lanes x phases would add ~740 idle lines to every scrape)."""
        for spec in self._specs:
            extra = [label for label in spec.labels if label not in self._base]
            if "class" in extra:
                continue
            choices = [(OTHER_SKELETON,) if label == "skeleton"
                       else label_values(spec, label) or () for label in extra]
            for values in itertools.product(*choices):
                self._touch(spec, **dict(zip(extra, values, strict=False)))

    def _touch(self, spec: MetricSpec, **labels) -> None:
        if spec.type == HISTOGRAM:
            self.observe(spec, None, **labels)
        elif spec.type == COUNTER:
            self.inc(spec, 0, **labels)
        else:
            self.set(spec, 0, **labels)

    def _sample_keys(self, spec: MetricSpec, labels: dict) -> tuple:
        cache_key = (spec.name, tuple(sorted(labels.items())))
        keys = self._keys.get(cache_key)
        if keys is None:
            if spec not in self._specs:
                raise ValueError(f"{spec.name} is not an engine family of this writer")
            values = {**self._base, **labels}
            if set(values) != set(spec.labels):
                raise ValueError(f"{spec.name} takes labels {spec.labels}, "
                                 f"got {sorted(values)}")
            labels = {label: str(values[label]) for label in spec.labels}
            family = spec.family
            if spec.type == HISTOGRAM:
                bounds = list(spec.buckets) + [float("inf")]
                keys = (
                    sample_key(family, f"{family}_sum", labels, spec.help),
                    [sample_key(family, f"{family}_bucket", {**labels, "le": _float_text(b)},
                                spec.help) for b in bounds],
                )
                self._sum_keys.add(keys[0])
            else:
                keys = (sample_key(family, spec.name, labels, spec.help),)
            self._keys[cache_key] = keys
        return keys

    def _histogram_keys(self, spec: MetricSpec, labels: dict) -> tuple:
        """A histogram series' keys; its first touch writes every bucket (and the sum) at 0,
        as prometheus_client does, so any reader sees all bounds, +Inf included."""
        sum_key, bucket_keys = self._sample_keys(spec, labels)
        if sum_key not in self._values:
            for key in (sum_key, *bucket_keys):
                self._add(HISTOGRAM, key, 0.0)
        return sum_key, bucket_keys

    def _add(self, typ: str, key: str, amount: float) -> None:
        value = self._values.get(key, 0.0) + amount
        self._values[key] = value
        self._dirty[typ][key] = value

    def flush(self) -> None:
        """Write every series that moved since the last write (one timestamp for all)."""
        with self._lock:
            self._write_moved()

    def _write_moved(self) -> None:
        """(A write that fails, e.g. a full disk, raises with what moved still kept.)"""
        if self._dir_fd < 0:
            return
        now = time.time()
        sums = self._sum_keys
        for typ, dirty in self._dirty.items():
            if dirty:
                value_file = self._files[typ]
                last = []  # a histogram's _sum after its buckets, as one observe writes
                for key, value in dirty.items():
                    if key in sums:
                        last.append((key, value))
                    else:
                        value_file.write(key, value, now)
                for key, value in last:
                    value_file.write(key, value, now)
                dirty.clear()

    def series(self, spec: MetricSpec, **labels) -> Series:
        """One series with its keys resolved once (prometheus_client's `labels()` child):
        the engine's hot path holds these, so an event costs no label handling."""
        with self._lock:
            if spec.type == HISTOGRAM:
                return Series(self, spec, *self._histogram_keys(spec, labels))
            (key,) = self._sample_keys(spec, labels)
            return Series(self, spec, key, ())

    def inc(self, spec: MetricSpec, amount: float = 1.0, **labels) -> None:
        with self._lock:
            (key,) = self._sample_keys(spec, labels)
            self._inc(key, amount)

    def set(self, spec: MetricSpec, value: float, **labels) -> None:
        with self._lock:
            (key,) = self._sample_keys(spec, labels)
            self._set(key, value)

    def observe(self, spec: MetricSpec, value: float | None, **labels) -> None:
        """Add one observation (None only declares the series)."""
        with self._lock:
            sum_key, bucket_keys = self._histogram_keys(spec, labels)
            if value is not None:
                self._observe(spec, sum_key, bucket_keys, (value,))

    def observe_many(self, spec: MetricSpec, values, **labels) -> None:
        """Add several observations with one write per touched bucket."""
        with self._lock:
            sum_key, bucket_keys = self._histogram_keys(spec, labels)
            self._observe(spec, sum_key, bucket_keys, values)

    # ----- under the lock: the events on resolved keys ------------------------------------

    def _inc(self, key: str, amount: float) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self._add(COUNTER, key, amount)
        if not self._buffered:
            self._write_moved()

    def _set(self, key: str, value: float) -> None:
        if self._values.get(key) != value:  # gauges are written on change
            self._values[key] = value
            self._dirty[GAUGE][key] = value
            if not self._buffered:
                self._write_moved()

    def _observe(self, spec: MetricSpec, sum_key: str, bucket_keys: list, values) -> None:
        counts: dict[int, int] = {}
        total = 0.0
        buckets = spec.buckets
        for value in values:
            index = bisect.bisect_left(buckets, value)
            counts[index] = counts.get(index, 0) + 1
            total += value
        if not counts:
            return
        for index, count in counts.items():
            self._add(HISTOGRAM, bucket_keys[index], float(count))
        self._add(HISTOGRAM, sum_key, total)
        if not self._buffered:
            self._write_moved()

    def close(self) -> None:
        self._closed.set()
        self._heartbeat.join()  # it uses the directory's descriptor, closed below
        try:
            self.flush()
        except OSError as exc:  # a full disk: the last figures are lost, the files closed
            log.warning("telemetry: the last flush failed: %s", exc)
        with self._lock:
            for value_file in self._files.values():
                value_file.close()
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1


class Series:
    """A writer's series with its keys resolved (see TelemetryWriter.series)."""
    __slots__ = ("_writer", "_spec", "_key", "_bucket_keys")

    def __init__(self, writer: TelemetryWriter, spec: MetricSpec, key: str, bucket_keys):
        self._writer, self._spec, self._key, self._bucket_keys = writer, spec, key, bucket_keys

    def inc(self, amount: float = 1.0) -> None:
        with self._writer._lock:
            self._writer._inc(self._key, amount)

    def set(self, value: float) -> None:
        with self._writer._lock:
            self._writer._set(self._key, value)

    def observe_many(self, values) -> None:
        with self._writer._lock:
            self._writer._observe(self._spec, self._key, self._bucket_keys, values)


class SkeletonLabeler:
    """Bounded `skeleton` label values: the top-K skeleton ids, the rest as `other`.

    An id earns its own label once it has been seen `min_count` times while fewer than K
    ids hold one; earlier requests of that id stay counted under `other`, so every
    counter stays monotonic. Candidates are tracked in a bounded table (space-saving).
    """

    def __init__(self, top_k: int = 20, min_count: int = 3, max_candidates: int = 1024):
        self.top_k = top_k
        self.min_count = min_count
        self.max_candidates = max_candidates
        self.labelled: set[str] = set()
        self._counts: dict[str, int] = {}

    def label(self, skeleton_id: str) -> str:
        if skeleton_id in self.labelled:
            return skeleton_id
        if len(self.labelled) >= self.top_k:
            return OTHER_SKELETON
        count = self._counts.get(skeleton_id)
        if count is None:
            if len(self._counts) >= self.max_candidates:
                weakest = min(self._counts, key=self._counts.__getitem__)
                count = self._counts.pop(weakest)
            else:
                count = 0
        count += 1
        self._counts[skeleton_id] = count
        if count >= self.min_count:
            del self._counts[skeleton_id]
            self.labelled.add(skeleton_id)
            return skeleton_id
        return OTHER_SKELETON
