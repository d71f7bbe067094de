"""Engine -> daemon telemetry: prometheus_client multiprocess files plus `engine.json`.

The engine writes cumulative counters, histograms (raw per-bucket counts, as
prometheus_client's multiprocess mode stores them) and live-sum gauges into mmap `.db`
files in its own directory; any process reads them with `MultiProcessCollector`. Files
are named by pid, so a restarted engine's counters add onto its predecessor's and stay
monotonic; a dead pid's live gauges are removed with `mark_process_dead`.

NOTE: torch-free; the writer is thread-safe (one lock), the engine is single-process.
"""
from __future__ import annotations

import bisect
import json
import os
import threading
import time
from pathlib import Path

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.utils import floatToGoString

from daemon.catalog import (COUNTER, ENGINE_METRICS, GAUGE, HISTOGRAM, LANES,
                            REQUEST_STATUSES, MetricSpec)

ENGINE_INFO_FILE = "engine.json"
TELEMETRY_FORMAT = "prometheus-multiprocess-v1"
OTHER_SKELETON = "other"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _family_name(spec: MetricSpec) -> str:
    # prometheus_client names a counter family without `_total`; samples carry it.
    return spec.name[:-len("_total")] if spec.type == COUNTER else spec.name


class TelemetryWriter:
    def __init__(self, directory: str | os.PathLike, info: dict, engine: str, model: str,
                 specs: tuple[MetricSpec, ...] = ENGINE_METRICS, heartbeat_seconds: float = 1.0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._reap_dead_predecessor()
        pid = os.getpid()
        self._files = {
            COUNTER: MmapedDict(str(self.directory / f"counter_{pid}.db")),
            HISTOGRAM: MmapedDict(str(self.directory / f"histogram_{pid}.db")),
            GAUGE: MmapedDict(str(self.directory / f"gauge_livesum_{pid}.db")),
        }
        self._base = {"engine": engine, "model": model}
        self._specs = {spec.name: spec for spec in specs}
        # A file of this pid may exist already (an engine re-created in one process):
        # continue its counters rather than overwrite them.
        self._values: dict[str, float] = {
            key: value for typ in (COUNTER, HISTOGRAM)
            for key, value, _ in self._files[typ].read_all_values()}
        self._keys: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self._declare_series()
        self._write_info({**info, "engine": engine, "model": model, "pid": pid,
                          "telemetry_format": TELEMETRY_FORMAT})
        # The daemon reads engine.json's mtime as a heartbeat: a separate thread keeps it
        # fresh, so a busy or stuck engine loop still counts as alive while the process is.
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_seconds,),
                                           name="ac-telemetry-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self, period: float) -> None:
        info_path = self.directory / ENGINE_INFO_FILE
        while not self._closed.wait(period):
            try:
                os.utime(info_path)
            except OSError:
                pass  # removed by a daemon that judged us gone; nothing to refresh

    def _reap_dead_predecessor(self) -> None:
        info = read_engine_info(self.directory)
        if info and info.get("pid") != os.getpid() and not pid_alive(int(info["pid"])):
            mark_process_dead(int(info["pid"]), str(self.directory))

    def _write_info(self, info: dict) -> None:
        tmp = self.directory / f".{ENGINE_INFO_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, self.directory / ENGINE_INFO_FILE)

    def _declare_series(self) -> None:
        """Write every series a user expects at zero, so types and labels show before traffic."""
        for spec in self._specs.values():
            extra = set(spec.labels) - {"engine", "model"}
            if extra == {"stream"}:
                for lane in LANES:
                    self._touch(spec, stream=lane)
            elif extra == {"stream", "status"}:
                for lane in LANES:
                    for status in REQUEST_STATUSES:
                        self._touch(spec, stream=lane, status=status)
            elif extra == {"skeleton"}:
                self._touch(spec, skeleton=OTHER_SKELETON)
            else:
                self._touch(spec)

    def _touch(self, spec: MetricSpec, **labels) -> None:
        if spec.type == HISTOGRAM:
            self.observe(spec.name, None, **labels)
        elif spec.type == COUNTER:
            self.inc(spec.name, 0, **labels)
        else:
            self.set(spec.name, 0, **labels)

    def _sample_keys(self, name: str, labels: dict) -> tuple:
        cache_key = (name, tuple(sorted(labels.items())))
        keys = self._keys.get(cache_key)
        if keys is None:
            spec = self._specs[name]
            values = {**self._base, **labels}
            if set(values) != set(spec.labels):
                raise ValueError(f"{name} takes labels {spec.labels}, got {sorted(values)}")
            names = list(spec.labels)
            vals = [str(values[label]) for label in names]
            family = _family_name(spec)
            if spec.type == HISTOGRAM:
                bounds = list(spec.buckets) + [float("inf")]
                keys = (
                    mmap_key(family, f"{family}_sum", names, vals, spec.help),
                    [mmap_key(family, f"{family}_bucket", names + ["le"],
                              vals + [floatToGoString(b)], spec.help) for b in bounds],
                )
            else:
                sample = spec.name if spec.type == COUNTER else family
                keys = (mmap_key(family, sample, names, vals, spec.help),)
            self._keys[cache_key] = keys
        return keys

    def _add(self, typ: str, key: str, amount: float) -> None:
        value = self._values.get(key, 0.0) + amount
        self._values[key] = value
        self._files[typ].write_value(key, value, time.time())

    def inc(self, name: str, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            (key,) = self._sample_keys(name, labels)
            self._add(COUNTER, key, amount)

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            (key,) = self._sample_keys(name, labels)
            self._values[key] = value
            self._files[GAUGE].write_value(key, value, time.time())

    def observe(self, name: str, value: float | None, **labels) -> None:
        """Add one observation (None only declares the series)."""
        with self._lock:
            sum_key, bucket_keys = self._sample_keys(name, labels)
            if value is None:
                self._add(HISTOGRAM, sum_key, 0.0)
                for key in bucket_keys:
                    self._add(HISTOGRAM, key, 0.0)
                return
            index = bisect.bisect_left(self._specs[name].buckets, value)
            self._add(HISTOGRAM, bucket_keys[index], 1.0)
            self._add(HISTOGRAM, sum_key, value)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for mmap_dict in self._files.values():
                mmap_dict.close()


def read_engine_info(directory: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(directory) / ENGINE_INFO_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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
