"""A process's container and pod, read from its cgroup path (`/proc/PID/cgroup`).

The forms recognised, cgroup v2 (`0::/path`) and v1 (`N:controllers:/path`) alike:
  docker      `/docker/<id>`, `docker-<id>.scope` (systemd driver)
  containerd  `cri-containerd-<id>.scope`, `/kubepods/<qos>/pod<uid>/<id>` (cgroupfs)
  CRI-O       `crio-<id>.scope` (`crio-conmon-<id>.scope` is CRI-O's monitor, outside
              the container: no container)
  podman      `libpod-<id>.scope`
  pods        `kubepods[-<qos>]-pod<uid, '_' for '-'>.slice`, `/kubepods/[<qos>/]pod<uid>/`

NOTE: the file is the process's own business (a container's process may have made its
own cgroups, named anything): it is read bounded (MAX_CGROUP_BYTES, MAX_LINES), each
line must match the format, every name must match a strict pattern (64 hex digits, a
UUID), and anything else is ignored, never an error. Labels therefore only ever hold a
64-hex container id and a UUID.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MAX_CGROUP_BYTES = 16384
MAX_LINES = 64
MAX_STAT_BYTES = 4096

_HEX64 = r"[0-9a-f]{64}"
_LINE = re.compile(r"^(\d{1,4}):([\w,=.-]{0,256}):(/[^\x00]{0,4096})$")
# A path component naming a container: (runtime, pattern with the id as group 1).
_CONTAINER_COMPONENTS = (
    ("docker", re.compile(rf"^docker-({_HEX64})\.scope$")),
    ("containerd", re.compile(rf"^cri-containerd-({_HEX64})\.scope$")),
    ("cri-o", re.compile(rf"^crio-({_HEX64})\.scope$")),
    ("podman", re.compile(rf"^libpod-({_HEX64})\.scope$")),
)
_BARE_ID = re.compile(rf"^({_HEX64})$")
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SLICE = re.compile(rf"^kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod({_UID})\.slice$")
_POD_DIR = re.compile(rf"^pod({_UID})$")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """Who a process is, as its cgroup says: empty strings where it says nothing."""
    container_id: str = ""
    runtime: str = ""       # docker | containerd | cri-o | podman | kubernetes ("" if none)
    pod_uid: str = ""       # a Kubernetes pod's UID, with dashes

    def __bool__(self) -> bool:
        return bool(self.container_id or self.pod_uid)


NOBODY = CgroupIdentity()


def _from_path(path: str) -> CgroupIdentity:
    parts = [p for p in path.split("/") if p]
    container_id = runtime = pod_uid = ""
    # The outermost match wins: a process that may make cgroups (delegated v2, privileged)
    # can name one below its own anything, never rename the ones above it.
    for i, part in enumerate(parts):
        pod = _POD_SLICE.match(part) or _POD_DIR.match(part)
        if pod:
            pod_uid = pod_uid or pod.group(1).replace("_", "-")
            continue
        if container_id:
            continue
        for name, pattern in _CONTAINER_COMPONENTS:
            found = pattern.match(part)
            if found:
                container_id, runtime = found.group(1), name
                break
        else:
            bare = _BARE_ID.match(part)
            if bare and i > 0:  # `/docker/<id>`, or a pod's container under cgroupfs
                parent = parts[i - 1]
                if parent == "docker":
                    container_id, runtime = bare.group(1), "docker"
                elif pod_uid and (_POD_DIR.match(parent) or _POD_SLICE.match(parent)):
                    container_id, runtime = bare.group(1), "kubernetes"
    if pod_uid and runtime in ("", "docker") and container_id and "kubepods" in path:
        runtime = runtime or "kubernetes"
    return CgroupIdentity(container_id, runtime, pod_uid)


def parse_cgroup(text: str) -> CgroupIdentity:
    """The identity a `/proc/PID/cgroup` text gives: the v2 line's when it names a
    container or pod, else the first v1 line's that does; NOBODY when none does."""
    found: CgroupIdentity | None = None
    for line in text.splitlines()[:MAX_LINES]:
        match = _LINE.match(line)
        if not match:
            continue
        identity = _from_path(match.group(3))
        if not identity:
            continue
        if match.group(1) == "0" and not match.group(2):  # the v2 (unified) line
            return identity
        found = found or identity
    return found or NOBODY


def _read_bounded(path: Path, limit: int) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, limit).decode("ascii", errors="replace")
    finally:
        os.close(fd)


def read_cgroup(proc: Path, pid: int) -> CgroupIdentity:
    """The process's identity (NOBODY when it is gone or the file does not read)."""
    try:
        return parse_cgroup(_read_bounded(proc / str(pid) / "cgroup", MAX_CGROUP_BYTES))
    except OSError:
        return NOBODY


def start_time(proc: Path, pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat's field 22): with
    the pid, which process this is (a pid reused is another start time); None if gone."""
    try:
        stat = _read_bounded(proc / str(pid) / "stat", MAX_STAT_BYTES)
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])  # the fields after comm start at field 3 (state)
    except (IndexError, ValueError):
        return None
