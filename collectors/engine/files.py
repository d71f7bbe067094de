"""Reading an engine's `.db` files: one index per file, and the bounds every read keeps.

A file is prometheus_client's multiprocess format (`ac_observe.telemetry_format`), one
per process and kind of value. Its entries only grow by appending, so each entry's offset
and key are parsed once (`FileIndex`); a cycle reads only the values, and an engine's
files become its series through its `SeriesPlan`, laid out again only when an entry or a
file is added.

NOTE: the files are hostile input. A read never blocks or follows a symlink, reads no
more than a file's used part (at most MAX_DB_BYTES), and an engine's keys and entries are
bounded across all its files, counted before any key is parsed.
"""
from __future__ import annotations

import itertools
import os
import stat
from typing import NamedTuple

import numpy as np

from ac_observe.collectors.engine.discovery import BadEngine
from ac_observe.collectors.engine.keys import CheckedKey
from ac_observe.collectors.engine.plan import SeriesPlan
from ac_observe.telemetry_format import MAX_DB_BYTES, parse_db_file_name, scan_entries, used_size

MAX_SERIES_PER_ENGINE = 50_000
MAX_ENTRIES_PER_ENGINE = 4 * MAX_SERIES_PER_ENGINE  # across the files of all its pids
_FIRST_ENTRY_BYTES = 64
_LAYOUTS = itertools.count(1)


class _FileVersion(NamedTuple):
    """What a file is now: a rejection stands only while none of this changes (the
    header too: on tmpfs, mmap writes leave size and mtime as they were)."""
    device: int
    inode: int
    size: int
    mtime_ns: int
    header: bytes


class _Rejection(NamedTuple):
    version: _FileVersion  # the file as it was rejected: not re-read while it stays so
    reason: str


class _FileIdentity(NamedTuple):
    """Which file an index holds: an inode number can be reused, so another engine's
    file is also told apart by its first key."""
    device: int
    inode: int
    first_entry: bytes


class FileIndex:
    """Where the entries of one `.db` file sit, parsed once (the format only appends).

    A cycle reads the used part of the file in one bounded `pread` and takes every known
    value out of it with one numpy gather (no JSON parse, no Python per value): `read`
    gives the values in the order of `keys`.
    """
    __slots__ = ("identity", "used", "entries", "rejected", "keys", "layout", "_at")

    def __init__(self):
        self.identity: _FileIdentity | None = None
        self.used = 8
        self.entries: list[tuple[int, str]] = []  # (value offset, key), as scan_entries gives
        self.rejected: _Rejection | None = None
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
            version = _FileVersion(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns,
                                   header)
            if self.rejected and self.rejected.version == version:
                raise BadEngine(self.rejected.reason)
            try:
                data = self._read_used(fd, info, header)
            except ValueError as exc:
                self.rejected = _Rejection(version, f"{name}: {exc}")
                raise BadEngine(self.rejected.reason) from None
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
        # A new file under that name starts over.
        identity = _FileIdentity(info.st_dev, info.st_ino,
                                 bytes(data[8:8 + _FIRST_ENTRY_BYTES]))
        if identity != self.identity or used < self.used:
            self.identity, self.used, self.entries = identity, 8, []
            self._at = None
        entries, self.used = scan_entries(data, self.used, len(data))
        if entries:
            self.entries.extend(entries)
            self._at = None
        return data


def too_many_keys(indexes: list[FileIndex]) -> bool:
    """More distinct keys across these files than an engine may have."""
    keys: set[str] = set()
    for index in indexes:
        keys.update(index.keys)
        if len(keys) > MAX_SERIES_PER_ENGINE:
            return True
    return False


class _Refusal(NamedTuple):
    layout: tuple  # the files' layouts when refused: not counted again while they hold
    reason: str


class FilesRead(NamedTuple):
    """One cycle's read of an engine's files."""
    plan: SeriesPlan
    exposed: np.ndarray  # the cycle's values, laid out by the plan
    inherited: bool      # files of a pid other than engine.json's are among them


class EngineFiles:
    """One engine directory's `.db` files, remembered between cycles: each file's index,
    every key checked so far against engine.json's labels, and the series plan while the
    files' layout holds."""
    __slots__ = ("indexes", "checked", "plan", "refusal")

    def __init__(self):
        self.indexes: dict[str, FileIndex] = {}  # by file name
        self.checked: dict[str, CheckedKey | str] = {}  # str: why it is skipped
        self.plan: SeriesPlan | None = None  # how its files become series, while their keys hold
        self.refusal: _Refusal | None = None  # of files with too many keys

    def forget_checks(self) -> None:
        """Keys are checked against engine.json's labels: another engine there starts over."""
        self.checked.clear()
        self.plan, self.refusal = None, None

    def read(self, dir_fd: int, info: dict) -> FilesRead:
        """This cycle's values of the engine `info` (its engine.json) describes."""
        pids = {name: parsed[1] for name in os.listdir(dir_fd)
                if (parsed := parse_db_file_name(name))}
        self.indexes = {n: i for n, i in self.indexes.items() if n in pids}
        indexes, values = self._read_values(dir_fd, list(pids))
        plan = self._plan_for(indexes, info)
        return FilesRead(plan, plan.evaluate(values),
                         any(pid != info["pid"] for pid in pids.values()))

    def _read_values(self, dir_fd: int,
                     names: list[str]) -> tuple[list[FileIndex], list[np.ndarray]]:
        """The indexes of the files that hold values, and their values (in one order)."""
        indexes, values, entries = [], [], 0
        for name in names:
            index = self.indexes.get(name)
            if index is None:
                index = self.indexes[name] = FileIndex()
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
        return indexes, values

    def _plan_for(self, indexes: list[FileIndex], info: dict) -> SeriesPlan:
        """The plan of these files: the last one while their layout holds, else a new one
        (unless they hold too many keys)."""
        layout = tuple(index.layout for index in indexes)
        plan = self.plan
        if plan is not None and plan.layout == layout:
            return plan
        self.plan = None
        if self.refusal and self.refusal.layout == layout:  # files as they were
            raise BadEngine(self.refusal.reason)
        # Counted before a key is parsed (skipped ones too): a directory of foreign
        # keys costs neither the parsing nor the memory of more than the limit.
        if too_many_keys(indexes):
            self.checked.clear()
            self.refusal = _Refusal(layout, f"more than {MAX_SERIES_PER_ENGINE} keys")
            raise BadEngine(self.refusal.reason)
        if len(self.checked) > 2 * MAX_SERIES_PER_ENGINE:
            self.checked.clear()  # churned by rewritten files: parse afresh
        expected = {"engine": info["engine"], "model": info["model"],
                    **{label: info[label] for label in ("kind", "upstream") if label in info}}
        plan = self.plan = SeriesPlan(layout, [index.keys for index in indexes],
                                      self.checked, expected)
        return plan
