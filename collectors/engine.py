"""Engine collector: every engine under the telemetry root, read from its files.

Each engine directory holds `engine.json` (refreshed every second as a heartbeat) and
prometheus_client multiprocess `.db` files. An engine whose heartbeat stopped keeps its
series for a grace period (a restart within it continues its counters), then they vanish
and, once its process is gone, its directory is removed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from collectors.base import Collector, register
from engine.telemetry import ENGINE_INFO_FILE, pid_alive, read_engine_info

log = logging.getLogger("ac_observe.collectors.engine")


_INT = struct.Struct("i").unpack_from
_DOUBLE = struct.Struct("d").unpack_from


class _FileIndex:
    """Where the entries of one multiprocess `.db` file sit, parsed once.

    The format (prometheus_client's MmapedDict) only appends: a header with the used
    size, then entries [int32 key length][key, padded to 8][double value][double time].
    Each read parses only entries added since the last one and unpacks known values in
    place, so a cycle costs one unpack per series rather than one JSON parse.
    """
    __slots__ = ("used", "entries")

    def __init__(self):
        self.used = 8
        self.entries: list[tuple[int, str]] = []  # (value offset, key)

    def read(self, path: Path) -> list[tuple[str, float]]:
        fd = os.open(path, os.O_RDONLY)
        try:
            used = _INT(os.pread(fd, 4, 0), 0)[0]
            data = os.pread(fd, used, 0)
        finally:
            os.close(fd)
        if used < self.used:  # a new file under the same name: start over
            self.used, self.entries = 8, []
        pos = self.used
        while pos + 4 <= used:
            length = _INT(data, pos)[0]
            value_at = pos + 4 + length + (8 - (length + 4) % 8)
            if length <= 0 or value_at + 16 > used:
                break  # a partly written entry: read it next cycle
            self.entries.append((value_at, data[pos + 4:pos + 4 + length].decode("utf-8")))
            pos = value_at + 16
        self.used = pos
        return [(key, _DOUBLE(data, at)[0]) for at, key in self.entries]


@dataclass(slots=True)
class EngineState:
    directory: Path
    info: dict
    alive: bool
    last_heartbeat: float


@register("engine")
class EngineCollector(Collector):
    def __init__(self, config):
        self.root = Path(config.telemetry_root)
        self.stale_seconds = config.engine_stale_seconds
        self.grace_seconds = config.engine_grace_seconds
        self.engines: dict[str, EngineState] = {}
        self._keys: dict[str, tuple] = {}  # parsed mmap keys, kept across cycles
        self._files: dict[Path, _FileIndex] = {}

    def collect(self):
        now = time.time()
        families: dict[str, Metric] = {}
        seen: dict[str, EngineState] = {}
        for directory in self._engine_dirs():
            try:
                heartbeat = (directory / ENGINE_INFO_FILE).stat().st_mtime
            except FileNotFoundError:
                continue
            info = read_engine_info(directory) or {}
            alive = now - heartbeat <= self.stale_seconds
            if not alive and now - heartbeat > self.stale_seconds + self.grace_seconds:
                self._forget(directory, info)
                continue
            seen[str(directory)] = EngineState(directory, info, alive, heartbeat)
            self._read_into(directory, families)
        self.engines = seen
        self._files = {p: i for p, i in self._files.items() if str(p.parent) in seen}
        return list(families.values())

    def _engine_dirs(self) -> list[Path]:
        try:
            return sorted(p for p in self.root.iterdir() if (p / ENGINE_INFO_FILE).exists())
        except FileNotFoundError:
            return []

    def _forget(self, directory: Path, info: dict) -> None:
        """Past the grace period: drop its series; remove its files once its process is gone."""
        pid = info.get("pid")
        if isinstance(pid, int) and pid_alive(pid):
            return  # alive but silent (stopped, or another pid namespace): hide, keep files
        try:
            shutil.rmtree(directory)
            log.info("removed telemetry of vanished engine %s (pid %s)", info.get("engine"), pid)
        except OSError as exc:
            log.warning("cannot remove %s: %s", directory, exc)

    def _parse(self, key: str) -> tuple:
        """(family, sample, labels tuple, help, le or None, labels dict for the sample)."""
        parsed = self._keys.get(key)
        if parsed is None:
            family, sample, labels, help_text = json.loads(key)
            le = labels.pop("le", None)
            ordered = tuple(sorted(labels.items()))
            out = dict(ordered)
            if le is not None:
                le = float(le)
                out["le"] = floatToGoString(le)
            parsed = self._keys[key] = (family, sample, ordered, help_text, le, out)
        return parsed

    def _read_into(self, directory: Path, families: dict[str, Metric]) -> None:
        totals: dict[str, float] = defaultdict(float)  # summed over the files of all pids
        types: dict[str, str] = {}
        for path in directory.glob("*.db"):
            index = self._files.get(path)
            if index is None:
                index = self._files[path] = _FileIndex()
            try:
                entries = index.read(path)
            except (FileNotFoundError, OSError, UnicodeDecodeError, ValueError):
                self._files.pop(path, None)
                continue  # removed or being rewritten under us; next cycle reads it
            typ = path.name.split("_", 1)[0]
            for key, value in entries:
                totals[key] += value
                types[key] = typ
        buckets: dict[tuple, list] = defaultdict(list)
        for key, value in totals.items():
            family, sample, labels, help_text, le, out = self._parse(key)
            metric = families.get(family)
            if metric is None:
                metric = families[family] = Metric(family, help_text, types[key])
            if le is None:
                metric.add_sample(sample, out, value)
            else:
                buckets[(family, labels)].append((le, value, out))
        for (family, labels), counts in buckets.items():
            metric = families[family]
            counts.sort(key=lambda item: item[0])
            total = 0.0
            for _, value, out in counts:
                total += value  # stored per bucket; exposed cumulative
                metric.add_sample(f"{family}_bucket", out, total)
            metric.add_sample(f"{family}_count", dict(labels), total)

    def status(self) -> list[dict]:
        return [{"engine": s.info.get("engine"), "model": s.info.get("model"),
                 "pid": s.info.get("pid"), "api_address": s.info.get("api_address"),
                 "alive": s.alive, "heartbeat_age_seconds": round(time.time() - s.last_heartbeat, 1),
                 "directory": str(s.directory)} for s in self.engines.values()]
