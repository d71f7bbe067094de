"""The engine -> daemon telemetry files, and the directory they live in.

An engine writes into its own directory under the telemetry root:
- `engine.json`: who it is (engine, model, pid, API address, format); its mtime is a
  heartbeat, refreshed every second;
- `counter_PID.db`, `histogram_PID.db`, `gauge_livesum_PID.db`: prometheus_client's
  multiprocess layout, so `MultiProcessCollector` reads them too (tests prove it for the
  prometheus_client versions pyproject allows). Counters are cumulative, histograms keep
  raw per-bucket counts, gauges are live sums.

File layout (prometheus_client's MmapedDict): int32 used size, 4 bytes padding, then
entries [int32 key length][utf-8 key padded to 8][double value][double timestamp]. It only
grows by appending, so a reader remembers where each entry's value sits.

NOTE: a leaf module (standard library only). Everything here treats the directory as
hostile: no path is followed through a symlink, temporary files are created exclusively,
reads are bounded and only of regular files, and a malformed file raises ValueError with
a reason, never anything that could harm another engine's data.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import stat
import struct
import time
from pathlib import Path

ENGINE_INFO_FILE = "engine.json"
TELEMETRY_FORMAT = "prometheus-multiprocess-v1"
DB_KINDS = ("counter", "histogram", "gauge_livesum")
MAX_INFO_BYTES = 64 << 10
MAX_DB_BYTES = 32 << 20      # ~100k series (an engine writes ~400); more is not ours
MAX_KEY_BYTES = 16 << 10
_INITIAL_DB_BYTES = 1 << 16
_DB_NAME = re.compile(r"^(counter|histogram|gauge_livesum)_([0-9]{1,10})\.db$")
_TEMP_INFO = re.compile(r"^\.engine\.json\.[0-9]{1,10}\.[0-9a-f]{8,32}$")
_INT = struct.Struct("i")
_TWO_DOUBLES = struct.Struct("dd")
_DOUBLE = struct.Struct("d")
MAX_PID = (1 << 31) - 1

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeDirectory(PermissionError):
    """A directory that another user could tamper with, or that is not ours to use."""


# ----- names ---------------------------------------------------------------------------------

def db_file_name(kind: str, pid: int) -> str:
    if kind not in DB_KINDS:
        raise ValueError(f"unknown telemetry file kind {kind!r}")
    return f"{kind}_{pid}.db"


def parse_db_file_name(name: str) -> tuple[str, int] | None:
    """(kind, pid) of a telemetry `.db` file name, or None for any other name."""
    match = _DB_NAME.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def is_format_file(name: str) -> bool:
    """A name the engine writes (and so the only names the daemon ever removes)."""
    return name == ENGINE_INFO_FILE or bool(_DB_NAME.match(name) or _TEMP_INFO.match(name))


def sample_key(family: str, sample: str, labels: dict[str, str], help_text: str) -> str:
    """An entry's key: prometheus_client's `mmap_key` (JSON, labels sorted)."""
    return json.dumps([family, sample, labels, help_text], sort_keys=True)


def parse_sample_key(key: str) -> tuple[str, str, dict[str, str], str]:
    """(family, sample, labels, help) of a key; ValueError when it is not one."""
    try:
        value = json.loads(key)
    except (ValueError, RecursionError):
        raise ValueError("an entry's key is not JSON") from None
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
            and isinstance(value[1], str) and isinstance(value[2], dict)
            and isinstance(value[3], str)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value[2].items())):
        raise ValueError("an entry's key is not [family, sample, {labels}, help]")
    family, sample, labels, help_text = value
    if not sample.startswith(family):
        raise ValueError(f"sample {sample[:80]!r} is not of family {family[:80]!r}")
    return family, sample, labels, help_text


# ----- the mmap layout -----------------------------------------------------------------------

FileBytes = bytes | mmap.mmap  # a `.db` file's contents, read or mapped

def scan_entries(data: FileBytes, start: int, used: int) -> tuple[list[tuple[int, str]], int]:
    """Entries that begin at `start`, up to `used`: ([(value offset, key)], next start).

    A partly written last entry is left for the next scan; anything else that does not
    parse raises ValueError.
    """
    entries = []
    pos = start
    while pos + 4 <= used:
        length = _INT.unpack_from(data, pos)[0]
        if length <= 0 or length > MAX_KEY_BYTES:
            raise ValueError(f"entry at byte {pos} has a key length of {length}")
        value_at = pos + 4 + length + (8 - (length + 4) % 8)
        if value_at + 16 > used:
            break
        try:
            key = data[pos + 4:pos + 4 + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"entry at byte {pos} has a key that is not UTF-8") from None
        entries.append((value_at, key))
        pos = value_at + 16
    return entries, pos


def used_size(data: FileBytes) -> int:
    used = _INT.unpack_from(data, 0)[0] if len(data) >= 4 else 0
    if used < 8:
        raise ValueError(f"header says {used} bytes used")
    return used


def value_at(data: FileBytes, offset: int) -> float:
    return _DOUBLE.unpack_from(data, offset)[0]


# An engine's directory and files: its group may read them (metrics alone, never prompt
# text), so a daemon of another uid in that group reads them (the unprivileged DaemonSet,
# dashboards/kubernetes/unprivileged/daemon.yaml); no one else, and no one but the engine
# may write.
TELEMETRY_DIR_MODE = 0o750
TELEMETRY_FILE_MODE = 0o640


class ValueFile:
    """Writer of one `.db` file (prometheus_client's MmapedDict layout). Not thread-safe.

    Opened relative to the engine directory's descriptor, never through a symlink.
    """

    def __init__(self, dir_fd: int, name: str):
        self._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           TELEMETRY_FILE_MODE, dir_fd=dir_fd)
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(self._fd)
            raise ValueError(f"{name} is not a regular file")
        if stat.S_IMODE(info.st_mode) != TELEMETRY_FILE_MODE and info.st_uid == os.geteuid():
            os.fchmod(self._fd, TELEMETRY_FILE_MODE)  # whatever the umask or an older engine
        self._capacity = info.st_size
        if self._capacity == 0:
            self._capacity = _INITIAL_DB_BYTES
            os.ftruncate(self._fd, self._capacity)
        self._map = mmap.mmap(self._fd, self._capacity)
        self._positions: dict[str, int] = {}
        self._used = _INT.unpack_from(self._map, 0)[0]
        if self._used == 0:
            self._used = 8
            self._map[0:4] = _INT.pack(8)
        else:
            entries, _ = scan_entries(self._map, 8, self._used)
            self._positions = {key: at for at, key in entries}

    def read_all(self) -> dict[str, float]:
        return {key: value_at(self._map, at) for key, at in self._positions.items()}

    def write(self, key: str, value: float, timestamp: float) -> None:
        at = self._positions.get(key)
        if at is None:
            at = self._append(key)
        # One slice assignment: a reader never sees a half-written pair of zeros.
        self._map[at:at + 16] = _TWO_DOUBLES.pack(value, timestamp)

    def _append(self, key: str) -> int:
        encoded = key.encode("utf-8")
        padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
        entry = struct.pack(f"i{len(padded)}sdd", len(encoded), padded, 0.0, 0.0)
        while self._used + len(entry) > self._capacity:
            self._capacity *= 2
            os.ftruncate(self._fd, self._capacity)
            self._map.close()
            self._map = mmap.mmap(self._fd, self._capacity)
        self._map[self._used:self._used + len(entry)] = entry
        self._used += len(entry)
        self._map[0:4] = _INT.pack(self._used)  # after the entry: readers see it whole
        at = self._positions[key] = self._used - 16
        return at

    def close(self) -> None:
        if not self._map.closed:  # (closed already when a grow failed to map the file)
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ----- engine.json ---------------------------------------------------------------------------

_INFO_FIELDS: dict[str, type] = {"engine": str, "model": str, "pid": int, "telemetry_format": str}
_OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "engine_id": str, "api_address": str, "started_at": (int, float), "device": str,
    "num_kv_blocks": int, "block_size": int,
    "kind": str, "upstream": str,  # a gateway's: kind "gateway", the server it relays to
    "cuda_streams": dict}  # lane -> CUDA stream handle, on a GPU


def parse_engine_info(raw: bytes) -> dict:
    """The checked contents of an `engine.json`; ValueError naming what is wrong."""
    try:
        info = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("engine.json is not UTF-8") from None
    except (ValueError, RecursionError):
        raise ValueError("engine.json is not JSON") from None
    if not isinstance(info, dict):
        raise ValueError(f"engine.json holds a {type(info).__name__}, not an object")
    _check_field_types(info)
    if not 0 < info["pid"] <= MAX_PID:
        raise ValueError(f"engine.json: pid {info['pid']} is out of range")
    if info["telemetry_format"] != TELEMETRY_FORMAT:
        raise ValueError(f"engine.json: format {info['telemetry_format'][:64]!r}, "
                         f"this reader knows {TELEMETRY_FORMAT!r}")
    for name in ("engine", "model"):
        if not 0 < len(info[name]) <= 256:
            raise ValueError(f"engine.json: {name!r} must be 1-256 characters")
    if info.get("kind", "gateway") != "gateway":  # files are the bundled engine's or a gateway's
        raise ValueError(f"engine.json: kind {info['kind'][:40]!r} is not written to files")
    if not 0 < len(info.get("upstream", "-")) <= 256 or not info.get("upstream", "-").isprintable():
        raise ValueError("engine.json: 'upstream' must be 1-256 printable characters")
    return info


def _check_field_types(info: dict) -> None:
    """Every field engine.json must hold, of its type; the optional ones of theirs where
    present (a bool is no number here)."""
    for name, typ in _INFO_FIELDS.items():
        if not isinstance(info.get(name), typ) or isinstance(info.get(name), bool):
            raise ValueError(f"engine.json: {name!r} is missing or not a {typ.__name__}")
    for name, types in _OPTIONAL_FIELDS.items():
        if name in info and (not isinstance(info[name], types) or isinstance(info[name], bool)):
            raise ValueError(f"engine.json: {name!r} has the wrong type")
    streams = info.get("cuda_streams", {})
    if len(streams) > 8 or not all(isinstance(k, str) and isinstance(v, int)
                                   and not isinstance(v, bool) for k, v in streams.items()):
        raise ValueError("engine.json: 'cuda_streams' must map lane names to stream handles")


def read_regular_file(dir_fd: int, name: str, max_bytes: int) -> bytes:
    """Whole contents of a regular file in a directory; never follows a symlink, never
    blocks on a FIFO or device, never reads more than `max_bytes`."""
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"{name} is {info.st_size} bytes; the limit is {max_bytes}")
        return os.pread(fd, max_bytes + 1, 0)[:max_bytes]
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----- the telemetry root --------------------------------------------------------------------

def default_telemetry_root() -> Path:
    """`AC_OBSERVE_TELEMETRY_DIR`, else `$XDG_RUNTIME_DIR/ac-observe/telemetry` (per user,
    private), else `/tmp/ac-observe-$UID/telemetry`."""
    env = os.environ.get("AC_OBSERVE_TELEMETRY_DIR")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "ac-observe" if runtime else Path(f"/tmp/ac-observe-{os.geteuid()}")
    return base / "telemetry"


def unsafe_reason(info: os.stat_result, trusted_uids: set[int], owner: int | None = None,
                  sticky_ok: bool = False) -> str | None:
    """Why a directory (lstat result) is not safe to read or write in, or None: it must be
    a real directory, owned by one of `trusted_uids` or by `owner` (a daemon's
    --telemetry-owner), and writable by no group or other user (`sticky_ok`: unless its
    sticky bit keeps others from replacing entries, as /tmp's does: for directories passed
    on the way, never for the one read)."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in trusted_uids and info.st_uid != owner:
        euid = os.geteuid()
        allowed = [f"you (uid {euid})"] if euid in trusted_uids else []
        allowed += ["root"] if 0 in trusted_uids and euid != 0 else []
        allowed += [] if owner is None else [f"the telemetry owner (uid {owner})"]
        listed = allowed[0] if len(allowed) == 1 else \
            f"{', '.join(allowed[:-1])} or {allowed[-1]}"
        return f"is owned by uid {info.st_uid}, not by {listed}"
    if info.st_mode & 0o022 and not (sticky_ok and info.st_mode & stat.S_ISVTX):
        return (f"is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                "chmod go-w it")
    return None


MAX_ENGINE_DIRS = 1024  # engines read under one telemetry root (more are not read)


def open_engine_dir_at(root_fd: int, name: str, owner: int | None) -> int | None:
    """A descriptor of engine directory `name` under the telemetry root `root_fd` that is
    safe to read: a real directory (never through a symlink) owned by root, this process's
    user or the telemetry `owner`, writable by no group or other user. None when it is not
    a directory (or is gone); UnsafeDirectory saying why when it is not safe. The one rule
    for every reader of engine directories (the engine and eBPF collectors)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # (a symlink: ENOTDIR with O_DIRECTORY, else ELOOP)
        try:
            info = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeDirectory("is a symlink; engine directories must be real "
                                  "directories") from None
        if isinstance(exc, NotADirectoryError):
            return None
        raise UnsafeDirectory(f"cannot open: {exc.strerror}") from None
    try:
        reason = unsafe_reason(os.fstat(fd), {0, os.geteuid()}, owner)
    except BaseException:
        os.close(fd)
        raise
    if reason:
        os.close(fd)
        raise UnsafeDirectory(reason)
    return fd


MAX_SYMLINK_HOPS = 40


def _trusted_symlink(name: str, dir_fd: int, trusted: set[int], where: str) -> bool:
    """Whether `name` in `dir_fd` is a symlink (one root or we own); UnsafeDirectory naming
    `where` when another user owns it."""
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        return False
    if info.st_uid not in trusted:
        raise UnsafeDirectory(f"{where} is a symlink owned by uid {info.st_uid}") from None
    return True


def _walk_reason(info: os.stat_result, trusted: set[int], owner: int | None, what: str,
                 last: bool) -> str | None:
    """unsafe_reason of a directory open_trusted_dir passes: the owner may own the last
    alone, and only one on the way may be sticky and world-writable (as /tmp)."""
    if last:
        return unsafe_reason(info, trusted, owner)
    reason = unsafe_reason(info, trusted, sticky_ok=True)
    if reason and owner is not None and info.st_uid == owner:
        return (f"is owned by the telemetry owner (uid {owner}), who may own the {what} "
                "itself but no directory above it")
    return reason


def _closed_reason(dir_fd: int, name: str, walked: Path, last: bool) -> str:
    """Why directory `name` cannot be opened (EACCES): whose it is, and for the directory
    asked for, how to make it ours (an older release's root-owned directory, say)."""
    euid = os.geteuid()
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"{walked / name} cannot be opened by you (uid {euid})"
    said = (f"{walked / name} is owned by uid {info.st_uid} (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): you (uid {euid}) may not open it")
    if last:
        said += f"; make it yours with everything in it (chown -R {euid} it) or remove it"
    return said


def _raise_unless_symlink(exc: OSError, name: str, dir_fd: int, trusted: set[int],
                          where: str, walked: Path, last: bool) -> None:
    """`name` in `dir_fd` did not open as a directory: return when it is a symlink to
    follow, else raise (UnsafeDirectory saying whose it is when it was not ours to open)."""
    if isinstance(exc, PermissionError):
        raise UnsafeDirectory(f"{where}: {_closed_reason(dir_fd, name, walked, last)}") \
            from None
    if not _trusted_symlink(name, dir_fd, trusted, f"{where}: {walked / name}"):
        raise exc


def open_trusted_dir(path: str | os.PathLike, what: str = "telemetry directory",
                     create: bool = False, owner: int | None = None) -> int:
    """A descriptor of directory `path`, reached from / one component at a time with
    O_NOFOLLOW (as systemd's chase() does), so nothing can be swapped in along the way:
    every directory passed is owned by root or by us and no other user can replace its
    entries (OpenSSH's StrictModes), and a symlink is followed only when root or we own
    it. With `create`, missing directories are made (0700), only ever inside trusted ones.
    `owner` (a daemon's --telemetry-owner) may own the last directory, `path` itself,
    never one above it nor a symlink. Else UnsafeDirectory naming the culprit."""
    trusted = {0, os.geteuid()}
    pending = [part for part in str(os.path.abspath(path)).split("/") if part]
    walked = Path("/")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    hops = 0
    try:
        while True:
            reason = _walk_reason(os.fstat(fd), trusted, owner, what, last=not pending)
            if reason:
                raise UnsafeDirectory(f"{what} {path}: {walked} {reason}")
            if not pending:
                return fd
            name = pending.pop(0)
            if name == ".":
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create or name == "..":
                    raise
                # FileExistsError: made meanwhile, then opened and checked like any other.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                pending.insert(0, name)
                continue
            except OSError as exc:
                _raise_unless_symlink(exc, name, fd, trusted, f"{what} {path}", walked,
                                      last=not pending)
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise UnsafeDirectory(f"{what} {path}: too many symlinks") from None
                target = os.readlink(name, dir_fd=fd)
                pending[:0] = [part for part in target.split("/") if part]
                if target.startswith("/"):
                    os.close(fd)
                    fd, walked = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), \
                        Path("/")
                continue
            os.close(fd)
            fd, walked = child, (walked.parent if name == ".." else walked / name)
    except BaseException:
        os.close(fd)
        raise


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _refuse_others_files(dir_fd: int, path: Path) -> None:
    """UnsafeDirectory when files of another user are in a non-root engine's directory (an
    older release's engine ran as root there): it could neither write nor remove them."""
    euid = os.geteuid()
    if euid == 0:
        return  # root writes and removes anyone's
    for name in os.listdir(dir_fd):
        with contextlib.suppress(FileNotFoundError):
            owner = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid
            if owner != euid:
                raise UnsafeDirectory(
                    f"telemetry directory {path} holds {name!r} of uid {owner}, not yours "
                    f"(uid {euid}): make the directory yours with everything in it "
                    f"(chown -R {euid} {path}) or remove it")


def open_engine_dir(path: str | os.PathLike, wait_seconds: float = 5.0) -> int:
    """A descriptor of the engine's own telemetry directory, created if missing, made
    TELEMETRY_DIR_MODE (its group may read it) and locked (flock) for as long as it stays
    open: one engine per directory, and the daemon never removes a directory an engine
    holds.

    Refuses (UnsafeDirectory) a directory another user owns or could tamper with, one that
    another live engine holds, and one holding files that are not ac-observe telemetry.
    """
    path = Path(path)
    deadline = time.monotonic() + wait_seconds
    while True:
        fd = open_trusted_dir(path, create=True)
        try:
            info = os.fstat(fd)
            reason = unsafe_reason(info, {os.geteuid()})
            if reason and info.st_uid != os.geteuid():
                reason += (f": make it yours with everything in it (chown -R {os.geteuid()} "
                           "it) or remove it")
            if reason:
                raise UnsafeDirectory(f"telemetry directory {path} {reason}")
            wanted = stat.S_IMODE(info.st_mode) & ~0o777 | TELEMETRY_DIR_MODE  # (setgid kept)
            if stat.S_IMODE(info.st_mode) != wanted:
                os.fchmod(fd, wanted)  # made 0700, or by an older engine
            locked = _try_lock(fd)
            if locked and os.fstat(fd).st_nlink > 0:
                _refuse_others_files(fd, path)
                foreign = sorted(name for name in os.listdir(fd) if not is_format_file(name))
                if foreign:
                    raise UnsafeDirectory(
                        f"telemetry directory {path} holds files that are not ac-observe "
                        f"telemetry ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}"
                        "): give the engine a directory of its own (an empty or new one)")
                return fd
            if time.monotonic() > deadline:
                raise UnsafeDirectory(f"telemetry directory {path} is in use by another "
                                      "running engine: give this one another --engine-name "
                                      "or --telemetry-dir")
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # held by another engine, or removed under us by a daemon: again
        time.sleep(0.05)


def open_dir_nofollow(path: str | os.PathLike, dir_fd: int | None = None) -> int:
    return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)


def remove_dead_gauges(dir_fd: int, keep_pid: int) -> None:
    """Live gauges of processes that are gone no longer count (prometheus_client's
    mark_process_dead), whichever pid engine.json last named."""
    for name in os.listdir(dir_fd):
        parsed = parse_db_file_name(name)
        if parsed and parsed[0] == "gauge_livesum" and parsed[1] != keep_pid \
                and not pid_alive(parsed[1]):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def remove_engine_dir(parent_fd: int, name: str) -> list[str] | None:
    """Remove the telemetry files of a gone engine's directory, then the directory if that
    left it empty. Only names of the format are touched: a user's file survives, and so
    does its directory. None when an engine holds the directory (nothing removed); else
    what was left behind."""
    fd = open_dir_nofollow(name, parent_fd)
    try:
        if not _try_lock(fd):
            return None
        left = []
        for entry in os.listdir(fd):
            if not is_format_file(entry):
                left.append(entry)
                continue
            try:
                os.unlink(entry, dir_fd=fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                left.append(entry)
        if not left:
            try:
                os.rmdir(name, dir_fd=parent_fd)  # while locked: no engine has it open
            except OSError as exc:
                left.append(f"({exc.strerror})")
        return left
    finally:
        os.close(fd)
