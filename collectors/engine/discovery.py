"""The telemetry root's engine directories: which are engines, whether they are safe to
read, their engine.json and heartbeat, and the clean-up of a gone engine's files.

An engine directory holds `engine.json`, whose mtime its writer refreshes every second
(the heartbeat). An engine whose heartbeat stopped keeps its series for a grace period (a
restart within it continues its counters), then they vanish and, once its process is
gone, its telemetry files are removed (and its directory, if nothing else is in it).

NOTE: the directory is hostile input. A directory that is not safe or not well formed is
that engine's problem (`BadEngine`, reported in `status` with the reason), never
another's; nothing is opened through a symlink.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.core import Metric

from ac_observe.collectors.base import new_gauge
from ac_observe.metrics import ENGINE_UP, KIND_AC_OBSERVE
from ac_observe.telemetry_format import (
    ENGINE_INFO_FILE,
    MAX_INFO_BYTES,
    UnsafeDirectory,
    open_engine_dir_at,
    parse_engine_info,
    pid_alive,
    read_regular_file,
    remove_engine_dir,
)

log = logging.getLogger("ac_observe.collectors.engine")

GONE_KEEP_SECONDS = 3600.0  # a gone engine's ac_engine_up stays at 0 this long


class BadEngine(ValueError):
    """An engine directory that cannot be read; the reason names what to fix."""


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


class EngineIdentity(NamedTuple):
    """Who engine.json says serves a directory; a new engine_id there is a restart."""
    engine_id: str
    engine: str
    model: str

    @classmethod
    def of(cls, info: dict) -> EngineIdentity:
        return cls(info.get("engine_id", str(info["pid"])), info["engine"], info["model"])


def open_engine_dir(root_fd: int, name: str, telemetry_owner: int | None) -> int | None:
    """A descriptor of directory `name` under the root, once found safe to read
    (open_engine_dir_at: owned by root, this daemon's user or the telemetry owner it was
    given, writable by no one else); None when it is not a directory."""
    try:
        return open_engine_dir_at(root_fd, name, telemetry_owner)
    except UnsafeDirectory as exc:
        raise BadEngine(str(exc)) from None


def engine_info_stat(dir_fd: int) -> os.stat_result | None:
    """The stat of the directory's engine.json (its mtime is the heartbeat); None when it
    has no engine.json (not an engine's)."""
    try:
        info_stat = os.stat(ENGINE_INFO_FILE, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info_stat.st_mode):
        raise BadEngine(f"{ENGINE_INFO_FILE} is not a regular file")
    return info_stat


def read_engine_info(dir_fd: int) -> dict:
    try:
        return parse_engine_info(read_regular_file(dir_fd, ENGINE_INFO_FILE, MAX_INFO_BYTES))
    except ValueError as exc:
        raise BadEngine(str(exc)) from None


def read_engine_info_or_none(dir_fd: int) -> dict | None:
    try:
        return parse_engine_info(read_regular_file(dir_fd, ENGINE_INFO_FILE, MAX_INFO_BYTES))
    except (OSError, ValueError):
        return None


# Why removal may never work here: a read-only mount (the unprivileged DaemonSet's), or
# directories that are not this daemon's user's to change. Said once, not tried again.
_NOT_REMOVABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def remove_gone_engine(root_fd: int, name: str, info: dict | None) -> bool:
    """Past the grace period: remove its files once its process is gone. Only a
    directory whose engine.json is ours, naming a dead process, and that no engine holds
    (its lock) is ever touched. False when this daemon may not remove it (said once,
    by the directory's name's repr: the caller tries it no more)."""
    if info is None or pid_alive(info["pid"]):
        return True  # not ours to judge, or alive but silent (stopped, another pid namespace)
    try:
        left = remove_engine_dir(root_fd, name)
    except OSError as exc:
        if exc.errno in _NOT_REMOVABLE:
            log.warning("cannot remove telemetry of gone engine directory %r: %s; left in "
                        "place, not tried again", name, exc.strerror)
            return False
        log.warning("cannot remove telemetry of %r: %s", name, exc)
        return True
    if left is None:
        return True  # an engine holds it again
    log.info("removed telemetry of vanished engine %r (pid %s)%s", name, info["pid"],
             f"; left {len(left)} other file(s) in place" if left else "")
    return True


class _LastHeartbeat(NamedTuple):
    model: str
    at: float
    kind: str = KIND_AC_OBSERVE


class EngineUp:
    """ac_engine_up: 1 per engine whose heartbeat is fresh, 0 for one that went stale,
    and still 0 for an hour after the last heartbeat of one whose directory is gone (an
    engine that is gone for good reads as down, not as absent)."""

    def __init__(self):
        self._last_heartbeats: dict[str, _LastHeartbeat] = {}  # by engine label

    def family(self, seen: dict[str, EngineState], now: float) -> Metric:
        up = new_gauge(ENGINE_UP)
        current = {}
        for state in seen.values():
            if state.info and not state.error:
                engine = state.info["engine"]
                kind = state.info.get("kind", KIND_AC_OBSERVE)
                current[engine] = _LastHeartbeat(state.info["model"], state.last_heartbeat,
                                                 kind)
                up.add_metric([engine, state.info["model"], kind],
                              1.0 if state.alive else 0.0)
        for engine, (model, heartbeat, kind) in list(self._last_heartbeats.items()):
            if engine in current:
                continue
            if now - heartbeat > GONE_KEEP_SECONDS:
                del self._last_heartbeats[engine]
            else:
                up.add_metric([engine, model, kind], 0.0)
        self._last_heartbeats.update(current)
        return up
