"""EngineCollector: every engine under the telemetry root, read from its files, a cycle
at a time (discovery, then each engine's files through its series plan, then the
families).

NOTE: each engine is read on its own; a directory that is not safe or not well formed is
that engine's problem (reported in `status` with the reason), never another's. Only
families and labels of the metric contract are exported, so a bad file cannot inject
series, and reads never block, follow symlinks or grow without bound.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ac_observe.collectors.base import Collector, CollectorUnavailable, new_counter, register
from ac_observe.collectors.engine.discovery import (
    BadEngine,
    EngineIdentity,
    EngineState,
    EngineUp,
    engine_info_stat,
    open_engine_dir,
    read_engine_info,
    read_engine_info_or_none,
    remove_gone_engine,
)
from ac_observe.collectors.engine.families import EngineFamily, EngineValues
from ac_observe.collectors.engine.files import EngineFiles
from ac_observe.collectors.engine.process import EngineProcesses
from ac_observe.metrics import ENGINE_RESTARTS, KIND_AC_OBSERVE
from ac_observe.telemetry_format import MAX_ENGINE_DIRS, UnsafeDirectory, open_trusted_dir

log = logging.getLogger("ac_observe.collectors.engine")

MAX_REFUSED_DIRS = 64  # refused directories listed in status and logged, each cycle


@dataclass(slots=True)
class _EngineDirectory:
    """Everything remembered about one engine directory between cycles."""
    files: EngineFiles = field(default_factory=EngineFiles)
    identity: EngineIdentity | None = None  # the engine its keys were checked against
    restarts: int = 0


@register("engine")
class EngineCollector(Collector):
    def __init__(self, config):
        self.root = Path(config.telemetry_root)
        # The uid non-root engines run as: it may own the root and engine directories.
        self.owner: int | None = config.telemetry_owner
        self._refused: dict[str, str] = {}  # directory -> why, as logged (once)
        self._warned: frozenset[str] = frozenset()  # conditions warned about, still true
        self._unremovable: set[str] = set()  # gone engines' directories it may not remove
        self.stale_seconds = config.engine_stale_seconds
        self.grace_seconds = config.engine_grace_seconds
        self.engines: dict[str, EngineState] = {}
        self._directories: dict[str, _EngineDirectory] = {}  # by directory name
        self._engine_up = EngineUp()
        self._exported: set[str] = set()     # engines whose series the last collect gave
        self._last_look: float | None = None         # start of the last look (None: not yet)
        self._look_before_last: float | None = None  # and of the one before it
        self._seen_dirs: set[str] = set()   # directories the last look read as engines
        self._counted_before_seen: list[dict[str, str]] = []
        self._processes = EngineProcesses(self.root)

    def counted_before_seen(self) -> list[dict[str, str]]:
        return self._counted_before_seen

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
        self._counted_before_seen = []
        before_last, last = self._look_before_last, self._last_look
        for engine, name in served.items():
            if engine in self._exported:
                continue
            state = seen[name]
            started = state.info.get("started_at")
            since = last if name in self._seen_dirs or before_last is None else before_last
            # `since` is None only when `last` is: the first look counts every engine.
            if last is None or since is None or state.inherited or \
                    not isinstance(started, (int, float)) or not math.isfinite(started) or \
                    started < since:
                self._counted_before_seen.append({"engine": engine})
        self._exported, self._seen_dirs = set(served), set(seen)
        self._look_before_last, self._last_look = last, now

    def collect(self):
        now = time.time()
        try:
            # The daemon may run as root and removes gone engines' files: it reads a root
            # no other user can redirect (see open_trusted_dir), never one it was lured to.
            root_fd = open_trusted_dir(self.root, "telemetry root", owner=self.owner)
        except FileNotFoundError:
            self.engines, self._directories = {}, {}
            self._note_new_engines({}, {}, now)
            return []
        except UnsafeDirectory as exc:
            hint = ("owned by root or this user (or name its owner with --telemetry-owner)"
                    if self.owner is None else "owned by root, this user or the telemetry "
                    "owner, inside directories of root's or this user's")
            raise CollectorUnavailable(f"{exc}; point --telemetry-root at a directory "
                                       f"{hint}") from None
        try:
            families: dict[str, EngineFamily] = {}
            seen: dict[str, EngineState] = {}
            served: dict[str, str] = {}  # engine label -> directory serving it
            read_dirs = refused = 0
            over_cap = False
            names = sorted(os.listdir(root_fd))
            self._unremovable &= set(names)  # (a name back later is tried again)
            for name in names:
                if read_dirs >= MAX_ENGINE_DIRS:  # engines alone count: refused ones
                    over_cap = True               # cannot crowd them out
                    break
                directory = self._directories.setdefault(name, _EngineDirectory())
                try:
                    read = self._read_engine(root_fd, name, directory, now)
                except BadEngine as exc:
                    refused += 1
                    if refused <= MAX_REFUSED_DIRS:  # listed in status, logged once each
                        seen[name] = EngineState(name, {}, False, 0.0, str(exc), "",
                                                 directory.restarts)
                        self._refuse(name, str(exc))
                    continue
                self._refused.pop(name, None)
                if read is None:
                    continue
                read_dirs += 1
                state, values = read
                engine = state.info["engine"]
                if engine in served:
                    state.error = (f"engine name {engine!r} is already served by directory "
                                   f"{served[engine]!r}; its series are not exported")
                    seen[name] = state
                    continue
                served[engine] = name
                seen[name] = state
                values.add_to(families)
            self._warn_once("cap", over_cap, "more than %d engine directories: the rest "
                            "are not read", MAX_ENGINE_DIRS)
            self._warn_once("refused", refused > MAX_REFUSED_DIRS, "%d directories under "
                            "the telemetry root are refused; %d are listed (status), the "
                            "rest not", refused, MAX_REFUSED_DIRS)
            self.engines = seen
            self._note_new_engines(served, seen, now)
            self._directories = {n: r for n, r in self._directories.items() if n in seen}
            self._refused = {n: r for n, r in self._refused.items() if n in seen}
            restarts = new_counter(ENGINE_RESTARTS)
            for state in seen.values():
                if state.info and not state.error:
                    restarts.add_metric([state.info["engine"],
                                         state.info.get("kind", KIND_AC_OBSERVE)],
                                        state.restarts)
            return [*families.values(), restarts, self._engine_up.family(seen, now)]
        finally:
            os.close(root_fd)

    def _refuse(self, name: str, reason: str) -> None:
        if self._refused.get(name) != reason:  # once a directory and reason
            # (its name by repr: a name is anyone's text, a newline in it no new log line)
            log.warning("engine directory %r under %s is not read: %s", name, self.root,
                        reason)
            self._refused[name] = reason

    def _warn_once(self, what: str, now_true: bool, message: str, *args) -> None:
        """A warning when a condition begins (again), not every cycle it lasts."""
        if now_true and what not in self._warned:
            log.warning(message, *args)
        self._warned = self._warned | {what} if now_true else self._warned - {what}

    def _read_engine(self, root_fd: int, name: str, directory: _EngineDirectory,
                     now: float) -> tuple[EngineState, EngineValues] | None:
        """(state, this cycle's values) of one engine directory; None when it is not one."""
        dir_fd = open_engine_dir(root_fd, name, self.owner)
        if dir_fd is None:
            return None
        try:
            info_stat = engine_info_stat(dir_fd)
            if info_stat is None:
                return None  # not an engine directory (no engine.json)
            heartbeat = info_stat.st_mtime
            alive = now - heartbeat <= self.stale_seconds
            if not alive and now - heartbeat > self.stale_seconds + self.grace_seconds:
                # Past the grace period: its series go, and its files once its process has.
                if name not in self._unremovable and not remove_gone_engine(
                        root_fd, name, read_engine_info_or_none(dir_fd)):
                    self._unremovable.add(name)
                return None
            info = read_engine_info(dir_fd)
            identity = EngineIdentity.of(info)
            if directory.identity != identity:
                if directory.identity and identity.engine_id != directory.identity.engine_id:
                    directory.restarts += 1  # a new engine in the same directory
                directory.identity = identity
                directory.files.forget_checks()  # keys are checked against engine.json's labels
            read = directory.files.read(dir_fd, info)
        except OSError as exc:  # unreadable in any way: this engine's problem alone
            raise BadEngine(f"cannot read: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        return (EngineState(name, info, alive, heartbeat, "", read.plan.warning,
                            directory.restarts, read.inherited),
                EngineValues(read.plan, read.exposed))

    def processes(self) -> dict[str, int]:
        """{engine: pid} of the live engines whose process this daemon sees (process.py):
        their series get that process's container and pod labels."""
        found, live = {}, set()
        for state in list(self.engines.values()):
            if state.alive and not state.error and state.info:
                engine = state.info["engine"]
                live.add(engine)
                pid = self._processes.pid_of(state.name, engine, state.info.get("pid"))
                if pid is not None:
                    found[engine] = pid
        self._processes.keep_only(live)
        return found

    def status(self) -> list[dict]:
        now = time.time()
        return [{"engine": s.info.get("engine"), "model": s.info.get("model"),
                 "pid": s.info.get("pid"), "api_address": s.info.get("api_address"),
                 "alive": s.alive and not s.error, "restarts": s.restarts,
                 "heartbeat_age_seconds": round(now - s.last_heartbeat, 1)
                 if s.last_heartbeat else None,
                 "directory": str(self.root / s.name), "error": s.error, "warning": s.warning}
                for s in self.engines.values()]
