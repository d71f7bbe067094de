"""vLLM and SGLang servers found on the node: their processes by command line, their
listening socket from /proc, and the address the daemon reaches them on.

A process's `/proc/PID/net/tcp{,6}` lists the sockets of *its* network namespace, so a
pod's server is seen from a daemon in the host's pid namespace (a DaemonSet with
`hostPID`). A socket bound to every address is reached on loopback when the process
shares the daemon's namespace (a host-network server), else on its namespace's own
address (a pod's IP, from `/proc/PID/net/fib_trie`). NOTE: everything read here is
written by other processes: each file is read bounded, and a process that vanishes or
hides its files midway is skipped, never an error. A command line is anyone's to write:
a process is taken only for a listening socket it holds itself (its fds), so a stand-in
named `vllm serve --port 5432` cannot aim the daemon at another service's port.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from ac_observe.metrics import KIND_SGLANG, KIND_VLLM

# The servers' own default ports, when the command line gives none.
DEFAULT_PORTS = {KIND_VLLM: 8000, KIND_SGLANG: 30000}
_MODULES = {"vllm.entrypoints.openai.api_server": KIND_VLLM,
            "sglang.launch_server": KIND_SGLANG}
_LISTEN = "0A"
_MAX_READ = 1 << 20
_MAX_FDS = 65536


@dataclass(frozen=True, slots=True)
class FoundEngine:
    pid: int
    kind: str
    url: str
    children: tuple[int, ...] = ()  # its descendants, where the model may run

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.pid}"


def _read(path: Path, limit: int = _MAX_READ) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


def engine_kind(argv: list[str]) -> str | None:
    """vllm or sglang when the command line is one of their servers', else None."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in _MODULES:
            return _MODULES[argv[i + 1]]
    for i, arg in enumerate(argv[:3]):  # `vllm serve`, or `python .../vllm serve`
        if os.path.basename(arg) == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return KIND_VLLM
    return None


def port_of(argv: list[str], kind: str) -> int | None:
    """The --port the command line gives, else the server's default; None if malformed."""
    port = str(DEFAULT_PORTS[kind])
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.split("=", 1)[1]
    return int(port) if port.isdigit() and 0 < int(port) < 65536 else None


def socket_inodes(process: Path) -> set[str]:
    """The inodes of the sockets a process holds open (its fds `socket:[N]`)."""
    inodes: set[str] = set()
    try:
        names = os.listdir(process / "fd")[:_MAX_FDS]
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(process / "fd" / name)
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(target[8:-1])
    return inodes


def _listening_address(net: Path, port: int, inodes: set[str]) -> str | None:
    """The local address a socket of this namespace listens on at `port`, if the socket
    is one of `inodes` (the process's own: a command line alone proves nothing)."""
    for name in ("tcp", "tcp6"):
        try:
            lines = _read(net / name).decode("ascii", "replace").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN or fields[9] not in inodes:
                continue
            address, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) == port:
                return _decode(address)
    return None


def _decode(hex_address: str) -> str:
    """/proc/net/tcp's address (little-endian 32-bit words) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    return str(address)


def _namespace_address(net: Path) -> str | None:
    """The namespace's own IPv4 address (not loopback), from its fib_trie's local hosts."""
    try:
        text = _read(net / "fib_trie").decode("ascii", "replace")
    except OSError:
        return None
    previous = ""
    for line in text.splitlines():
        if "/32 host LOCAL" in line:
            address = previous.strip().lstrip("|-+ ").strip()
            try:
                if not ipaddress.ip_address(address).is_loopback:
                    return address
            except ValueError:
                pass
        previous = line
    return None


def _same_namespace(pid: int, proc: Path) -> bool:
    try:
        return os.readlink(proc / str(pid) / "ns" / "net") == \
            os.readlink(proc / "self" / "ns" / "net")
    except OSError:
        return False


def reach(pid: int, port: int, proc: Path) -> str | None:
    """host:port the daemon reaches the process's listening socket on, or None."""
    net = proc / str(pid) / "net"
    bound = _listening_address(net, port, socket_inodes(proc / str(pid)))
    if bound is None:
        return None  # not listening yet (a server loading its model), or not its socket
    unspecified = bound in ("0.0.0.0", "::")
    host: str | None
    if _same_namespace(pid, proc):
        host = "127.0.0.1" if unspecified else bound
    elif unspecified or not ipaddress.ip_address(bound).is_loopback:
        host = _namespace_address(net) if unspecified else bound
    else:
        return None  # loopback of another namespace: not reachable from here
    if host is None:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parent(entry: Path) -> int | None:
    """A process's parent pid from /proc/PID/stat (after the last ')': comm may hold any)."""
    try:
        fields = _read(entry / "stat", 4096).rpartition(b")")[2].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int, parents: dict[int, int]) -> tuple[int, ...]:
    """Every process below `pid`, from a pid -> parent pid map, in pid order."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        if child in out or child == pid:
            continue  # a pid reused while reading: no loop
        out.append(child)
        todo += children.get(child, ())
    return tuple(sorted(out))


def discover(proc: Path = Path("/proc")) -> list[FoundEngine]:
    """Every vLLM or SGLang server process listening on the node, by pid, with its
    descendants."""
    found = []
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        parent = _parent(entry)
        if parent is not None:
            parents[int(entry.name)] = parent
        try:
            argv = [a.decode("utf-8", "replace")
                    for a in _read(entry / "cmdline", 65536).split(b"\0") if a]
        except OSError:
            continue  # gone, or not ours to read
        kind = engine_kind(argv)
        port = port_of(argv, kind) if kind else None
        if kind is None or port is None:
            continue
        address = reach(int(entry.name), port, proc)
        if address is not None:
            found.append(FoundEngine(int(entry.name), kind, f"http://{address}/metrics"))
    by_url: dict[str, FoundEngine] = {}
    for engine in sorted(found, key=lambda f: f.pid):  # a forked worker: its parent's
        by_url.setdefault(engine.url, engine)
    return [FoundEngine(f.pid, f.kind, f.url, descendants(f.pid, parents))
            for f in by_url.values()]
