"""eBPF collector: CUDA driver and runtime activity of any process, through bcc uprobes.

It finds the CUDA libraries processes actually mapped (`/proc/PID/maps`, through
`/proc/PID/root` so containers' own copies count), attaches once per distinct library file
(by device and inode), and picks up processes that start later. It exports per process
(`pid`, `comm`): kernel launches per stream, graph launches, time inside launch calls,
time blocked in stream/event/device synchronisation (log2 histograms kept in the kernel),
and bytes copied by direction. Streams of the bundled engine are named by lane (its
engine.json publishes their handles); others show the handle.

NOTE: down with the reason, never silently empty: not root (or without CAP_BPF and
CAP_PERFMON), bcc missing, the program not compiling (kernel headers), or no probe
attached yet. Maps are read, never cleared; a process that exits loses its series and its
map entries, and nobody else's (`ac_ebpf_map_entries{pid}` counts what the maps hold).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.utils import floatToGoString

from ac_observe import metrics as m
from ac_observe.collectors.base import (
    Collector,
    CollectorUnavailable,
    new_counter,
    new_gauge,
    new_histogram,
    register,
)
from ac_observe.collectors.ebpf_program import (
    DEFAULT_GROUPS,
    DIRECTIONS,
    GROUPS,
    LATENCY_GROUP,
    PROBES,
    PROGRAM,
    WAIT_APIS,
)
from ac_observe.telemetry_format import (
    ENGINE_INFO_FILE,
    MAX_ENGINE_DIRS,
    MAX_INFO_BYTES,
    open_engine_dir_at,
    open_trusted_dir,
    parse_engine_info,
    read_regular_file,
)

log = logging.getLogger("ac_observe.collectors.ebpf")
_LIBRARY = re.compile(r"/lib(cuda|cudart)\.so[.0-9]*$")
CAP_PERFMON, CAP_BPF, CAP_SYS_ADMIN = 38, 39, 21
DEBIAN_BCC = "/usr/lib/python3/dist-packages"
# Every map of the program (ebpf_program.PROGRAM); each is keyed by a process or a thread.
MAPS = ("launches", "graphs", "copied", "wait_slots", "wait_sums", "launch_slots",
        "launch_sums", "in_runtime", "launch_started", "waiting")


def _capabilities() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("CapEff:"))
    return int(line.split()[1], 16)


def _import_bcc():
    try:
        import bcc  # noqa: F401
    except ImportError:
        if not os.path.isdir(os.path.join(DEBIAN_BCC, "bcc")):
            raise CollectorUnavailable("bcc is not installed (Debian/Ubuntu: apt install "
                                       "python3-bpfcc)") from None
        sys.path.append(DEBIAN_BCC)  # Debian's pure-Python bcc, after everything of ours
        try:
            import bcc  # noqa: F401
        except ImportError as exc:
            raise CollectorUnavailable(f"bcc does not import: {exc}") from None
    import bcc
    return bcc


@dataclass(slots=True)
class _Library:
    kind: str           # cuda | cudart
    path: str           # a path to the file that this namespace can open
    probes: int = 0


@dataclass(slots=True)
class _Target:
    comm: str
    libraries: set = field(default_factory=set)  # (dev, inode) of its CUDA libraries


@register("ebpf")
class EbpfCollector(Collector):
    timeout_seconds = 30.0  # the first run compiles the program

    def __init__(self, config):
        self.groups = tuple(getattr(config, "ebpf_probes", None) or DEFAULT_GROUPS)
        unknown = set(self.groups) - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown eBPF probe groups {sorted(unknown)}; known: "
                             f"{', '.join(GROUPS)}")
        self.pids = set(getattr(config, "ebpf_pids", None) or ())
        comm = getattr(config, "ebpf_comm", None)
        try:
            self.comm = re.compile(comm) if comm else None
        except re.error as exc:
            raise ValueError(f"--ebpf-comm {comm!r}: {exc}") from None
        self.telemetry_root = Path(config.telemetry_root)
        self.telemetry_owner: int | None = config.telemetry_owner
        self.bpf: Any = None  # bcc.BPF once loaded (bcc has no type information)
        self.libraries: dict[tuple, _Library] = {}
        self.targets: dict[int, _Target] = {}

    # ----- set-up ------------------------------------------------------------------------

    def _load(self) -> None:
        caps = _capabilities()
        if not (caps & (1 << CAP_SYS_ADMIN) or
                (caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON))):
            raise CollectorUnavailable("eBPF needs root's capabilities (CAP_SYS_ADMIN, or "
                                       "CAP_BPF and CAP_PERFMON); this daemon runs as uid "
                                       f"{os.geteuid()} without them")
        bcc = _import_bcc()
        flags = ["-DLAUNCH_LATENCY"] if LATENCY_GROUP in self.groups else []
        try:
            self.bpf = bcc.BPF(text=PROGRAM, cflags=flags)
        except Exception as exc:  # clang's messages: the headers, usually
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CollectorUnavailable(
                f"the BPF program does not compile ({first}); install the kernel headers "
                f"for {os.uname().release} (/lib/modules/{os.uname().release}/build)") from None

    def _attach(self, key: tuple, library: _Library) -> None:
        for group in self.groups:
            for kind, symbol, entry, ret in PROBES[group]:
                if kind != library.kind:
                    continue
                try:
                    if entry:
                        self.bpf.attach_uprobe(name=library.path, sym=symbol, fn_name=entry)
                    if ret:
                        self.bpf.attach_uretprobe(name=library.path, sym=symbol, fn_name=ret)
                    library.probes += 1
                except Exception:  # a symbol this build of the library does not export
                    continue
        log.info("eBPF: %d probes on %s", library.probes, library.path)

    # ----- discovery ---------------------------------------------------------------------

    def _discover(self) -> None:
        targets = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if self.pids and pid not in self.pids:
                continue
            found = self._libraries_of(pid)
            if not found:
                continue
            comm = _comm(pid)
            if self.comm and not self.comm.search(comm):
                continue
            target = targets[pid] = _Target(comm)
            for key, library in found.items():
                target.libraries.add(key)
                if key not in self.libraries:
                    self.libraries[key] = library
                    self._attach(key, library)
        self.targets = targets

    def _libraries_of(self, pid: int) -> dict[tuple, _Library]:
        found: dict[tuple, _Library] = {}
        try:
            with open(f"/proc/{pid}/maps") as maps:
                paths = {line.split(None, 5)[5].strip() for line in maps
                         if line.count(" ") >= 5 and _LIBRARY.search(line.rstrip())}
        except (OSError, IndexError):
            return found
        for path in paths:
            seen_from_here = f"/proc/{pid}/root{path}"  # its own root: containers too
            try:
                info = os.stat(seen_from_here)
            except OSError:
                continue
            library = _LIBRARY.search(path)
            assert library is not None  # the line matched, and its path is the line's end
            kind = library.group(1)
            found[(info.st_dev, info.st_ino)] = _Library(kind, seen_from_here)
        return found

    # ----- collection --------------------------------------------------------------------

    def collect(self):
        if self.bpf is None:
            self._load()
        self._discover()
        if not any(library.probes for library in self.libraries.values()):
            raise CollectorUnavailable("no process has a CUDA library mapped yet (probes "
                                       "attach to libcuda/libcudart when one does)")
        self._forget_exited()
        held = new_gauge(m.EBPF_MAP_ENTRIES)
        for pid, count in sorted(self._entries_per_pid().items()):
            target = self.targets.get(pid)
            held.add_metric([str(pid), target.comm if target else _comm(pid)], count)
        streams = self._engine_streams()
        launches = new_counter(m.CUDA_KERNEL_LAUNCHES)
        for key, count in self.bpf["launches"].items():
            target = self.targets.get(key.pid)
            if target:
                name = streams.get((key.pid, key.stream)) or f"0x{key.stream:x}"
                launches.add_metric([str(key.pid), target.comm, name], count.value)
        graphs = new_counter(m.CUDA_GRAPH_LAUNCHES)
        for key, count in self.bpf["graphs"].items():
            target = self.targets.get(key.value)
            if target:
                graphs.add_metric([str(key.value), target.comm], count.value)
        copied = new_counter(m.CUDA_MEMCPY_BYTES)
        for key, total in self.bpf["copied"].items():
            target = self.targets.get(key.pid)
            if target:
                copied.add_metric([str(key.pid), target.comm, DIRECTIONS[key.kind]],
                                  total.value)
        families = [launches, graphs, copied, held,
                    self._histogram(m.CUDA_SYNC_WAIT, "wait_slots", "wait_sums",
                                    lambda kind: [WAIT_APIS[kind]])]
        if LATENCY_GROUP in self.groups:
            families.append(self._histogram(m.CUDA_LAUNCH_CALL, "launch_slots", "launch_sums",
                                            lambda kind: []))
        return families

    def _histogram(self, spec, slots_map: str, sums_map: str, extra):
        """log2 slots as cumulative `le` buckets. bcc's bpf_log2l(v) is floor(log2(v)) + 1,
        so slot k holds [2^(k-1), 2^k) ns: all in the bucket whose bound is 2^k ns (the
        contract's buckets are those powers of two)."""
        size = len(spec.buckets)
        counts: dict[tuple, list] = {}
        for key, count in self.bpf[slots_map].items():
            if key.pid in self.targets:
                per = counts.setdefault((key.pid, key.kind), [0] * (size + 1))
                per[min(max(key.slot - m.LOG2_FIRST_EXPONENT, 0), size)] += count.value
        sums = {(k.pid, k.kind): v.value for k, v in self.bpf[sums_map].items()}
        family = new_histogram(spec)
        for (pid, kind), per in sorted(counts.items()):
            cumulative, running = [], 0
            for bound, count in zip([*spec.buckets, float("inf")], per, strict=False):
                running += count
                cumulative.append((_le(bound), running))
            family.add_metric([str(pid), self.targets[pid].comm, *extra(kind)], cumulative,
                              sums.get((pid, kind), 0) / 1e9)
        return family

    def _forget_exited(self) -> None:
        """Map entries of processes that are gone: deleted (others keep theirs)."""
        for name in MAPS:
            table = self.bpf[name]
            for key in list(table.keys()):
                pid = _pid_of(key)
                if pid not in self.targets and not os.path.exists(f"/proc/{pid}"):
                    try:
                        del table[key]
                    except KeyError:
                        pass

    def _entries_per_pid(self) -> dict[int, int]:
        """{pid: entries} over all the maps, read back from the kernel after the deletion
        (any process the probes saw; a gone one too, were its entries not deleted): what
        ac_ebpf_map_entries shows."""
        held: dict[int, int] = {}
        for name in MAPS:
            # Its keys, from the kernel, each once: an in-flight entry deleted under the
            # walk sends get_next_key back to the first key.
            keys = {bytes(key): key for key in self.bpf[name].keys()}
            for key in keys.values():
                pid = _pid_of(key)
                held[pid] = held.get(pid, 0) + 1
        return held

    def _engine_streams(self) -> dict[tuple, str]:
        """{(pid, stream handle): lane} of the bundled engines (engine.json), from the
        engine directories the engine collector would read (open_engine_dir_at) alone."""
        names: dict[tuple, str] = {}
        try:
            root_fd = open_trusted_dir(self.telemetry_root, "telemetry root",
                                       owner=self.telemetry_owner)
        except OSError:
            return names
        try:
            read = 0
            for entry in sorted(os.listdir(root_fd)):
                if read >= MAX_ENGINE_DIRS:
                    break
                try:
                    dir_fd = open_engine_dir_at(root_fd, entry, self.telemetry_owner)
                except OSError:  # UnsafeDirectory too: the engine collector says why
                    continue
                if dir_fd is None:
                    continue
                try:
                    info = parse_engine_info(read_regular_file(dir_fd, ENGINE_INFO_FILE,
                                                               MAX_INFO_BYTES))
                except (OSError, ValueError):
                    continue
                finally:
                    os.close(dir_fd)
                read += 1
                for lane, handle in (info.get("cuda_streams") or {}).items():
                    if lane in m.LANES and isinstance(handle, int):
                        names[(info["pid"], handle)] = lane
        finally:
            os.close(root_fd)
        return names

    def close(self) -> None:
        if self.bpf is not None:
            try:
                self.bpf.cleanup()
            except Exception as exc:  # tracefs absent: the kernel drops the probes anyway
                log.debug("eBPF cleanup: %s", exc)
            self.bpf = None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()[:64]
    except OSError:
        return "?"


def _pid_of(key) -> int:
    """The process of a map key: a struct's pid, a bare pid, or a thread's pid_tgid."""
    if hasattr(key, "pid"):
        return key.pid
    return key.value >> 32 if key.value > 0xFFFFFFFF else key.value


def _le(bound: float) -> str:
    return floatToGoString(bound)
