"""An engine's process as this daemon sees it: engine.json's pid, believed only when that
process maps the engine's own telemetry file (`counter_<pid>.db`, by device and inode).

Why: an engine in a container writes the pid of its own pid namespace; the same number
on the daemon's side may be any other process. A check that fails names no process, and
the engine's series then carry no container labels (never another's).

NOTE: /proc/PID/maps of a torch process is thousands of lines: each (engine, pid, start
time) is checked once and remembered while it stays the same.
"""
from __future__ import annotations

import os
from pathlib import Path

from ac_observe.collectors.attribution.cgroup import start_time
from ac_observe.telemetry_format import db_file_name

MAX_MAPS_BYTES = 8 << 20


def maps_file(proc: Path, pid: int, device: int, inode: int) -> bool:
    """Whether process `pid` maps the file (device, inode)."""
    wanted_dev = f"{os.major(device):02x}:{os.minor(device):02x}"
    wanted_inode = str(inode)
    try:
        with open(proc / str(pid) / "maps", "rb") as maps:
            text = maps.read(MAX_MAPS_BYTES).decode("ascii", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) >= 5 and fields[4] == wanted_inode and fields[3] == wanted_dev:
            return True
    return False


class EngineProcesses:
    """{engine: pid} of the engines whose pid checks out, remembered by start time."""

    def __init__(self, root: Path, proc: Path = Path("/proc")):
        self.root, self.proc = root, proc
        self._checked: dict[str, tuple[int, int | None, bool]] = {}  # name -> pid, start, ok

    def pid_of(self, directory: str, engine: str, pid: object) -> int | None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        started = start_time(self.proc, pid)
        if started is None:
            return None
        remembered = self._checked.get(engine)
        if remembered is not None and remembered[:2] == (pid, started):
            return pid if remembered[2] else None
        try:
            info = os.stat(self.root / directory / db_file_name("counter", pid),
                           follow_symlinks=False)
            ok = maps_file(self.proc, pid, info.st_dev, info.st_ino)
        except OSError:
            ok = False
        self._checked[engine] = (pid, started, ok)
        return pid if ok else None

    def keep_only(self, engines: set[str]) -> None:
        for engine in set(self._checked) - engines:
            del self._checked[engine]
