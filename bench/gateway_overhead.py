"""What `ac-observe gateway` adds: time to first token (p50, p99) and throughput at 1, 16
and 64 concurrent streams, the same bare asyncio client going straight to an upstream
and through a gateway in front of it, the two sides alternating round by round in one
run; every stream's events checked for loss and order; the gateway's memory over
10,000 requests.

The upstream is a synthetic OpenAI chat server in its own process (a raw asyncio server:
each request answered with EVENTS numbered content events, chunk by chunk, --gap-ms apart),
so the difference between the sides is the gateway's, not a model's noise.

Aims (issue 31): ≤ 0.5 ms added at p50 and ≤ 2 ms at p99, no chunk lost or reordered,
memory flat over 10,000 requests.

Usage: python bench/gateway_overhead.py [--levels 1,16,64] [--rounds 6] [--requests 10]
                                        [--memory-requests 10000] [--gap-ms 1]
                                        [--pin] [--staggered] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.servers import ServerProcess, free_port, wait_for  # noqa: E402

EVENTS = 16
MIN_PER_SIDE = 300  # requests a side at each level, whatever the streams
UPSTREAM = r"""
import asyncio, sys
EVENTS, GAP = int(sys.argv[2]), float(sys.argv[3]) / 1e3
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n'
def chunk(data): return b"%x\r\n" % len(data) + data + b"\r\n"
async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(HEAD)
            for i in range(EVENTS):
                writer.write(chunk(EVENT % i))
                await writer.drain()
                if GAP and i < EVENTS - 1:
                    await asyncio.sleep(GAP)
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": EVENTS,
                   "messages": [{"role": "user", "content": "<q>hi</q>"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
           b"\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


async def _one(reader, writer) -> tuple[float, float, bool]:
    """(seconds to the first content event, to the end, events whole and in order)."""
    started = time.perf_counter()
    writer.write(REQUEST)
    buffer, first = b"", None
    while not buffer.endswith(b"0\r\n\r\n"):
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("closed")
        buffer += chunk
        if first is None and b'"content"' in buffer:
            first = time.perf_counter() - started
    end = time.perf_counter() - started
    numbers = [int(part.split(b'"', 1)[0]) for part in buffer.split(b'"content":"')[1:]]
    return first, end, numbers == list(range(EVENTS))


async def _worker(port: int, requests: int, out: list, offset: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await asyncio.sleep(offset)
    try:
        for _ in range(requests):
            out.append(await _one(reader, writer))
    finally:
        writer.close()


def _round(port: int, streams: int, requests: int, spread: float = 0.0) -> tuple[list, float]:
    """`streams` clients of `requests` requests each; the n-th starts n/streams of `spread`
    seconds late (0: together, so alike streams arrive in lockstep)."""
    out: list = []

    async def main():
        await asyncio.gather(*(_worker(port, requests, out, spread * n / streams)
                               for n in range(streams)))
    started = time.perf_counter()
    asyncio.run(main())
    return out, time.perf_counter() - started


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _level(ports: dict, streams: int, rounds: int, requests: int, spread: float) -> dict:
    requests = max(requests, MIN_PER_SIDE // (rounds * streams))  # a p99 is not one max
    results = {"direct": [], "gateway": []}
    seconds = {"direct": 0.0, "gateway": 0.0}
    for r in range(rounds):
        for side in (("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")):
            out, took = _round(ports[side], streams, requests, spread)
            results[side] += out
            seconds[side] += took
    row = {"streams": streams, "requests_per_side": len(results["direct"])}
    for side, out in results.items():
        ttft = [first * 1e3 for first, _, _ in out]
        row[f"{side}_ttft_p50_ms"] = round(statistics.median(ttft), 3)
        row[f"{side}_ttft_p99_ms"] = round(_p(ttft, 0.99), 3)
        row[f"{side}_req_per_s"] = round(len(out) / seconds[side], 1)
        row[f"{side}_lost_or_reordered"] = sum(not whole for _, _, whole in out)
    row["added_ttft_p50_ms"] = round(row["gateway_ttft_p50_ms"] - row["direct_ttft_p50_ms"], 3)
    row["added_ttft_p99_ms"] = round(row["gateway_ttft_p99_ms"] - row["direct_ttft_p99_ms"], 3)
    row["throughput_ratio"] = round(row["gateway_req_per_s"] / row["direct_req_per_s"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=6, help="per side and level")
    parser.add_argument("--requests", type=int, default=10,
                        help=f"per stream and round (at least {MIN_PER_SIDE} a side a level)")
    parser.add_argument("--memory-requests", type=int, default=10_000)
    parser.add_argument("--gap-ms", type=float, default=1.0,
                        help="between a stream's events: 1 (the default) is a stress, 16 "
                             "streams then 16,000 events/s; 15 is a fast GPU's decode pace")
    parser.add_argument("--pin", action="store_true",
                        help="the gateway on a core of its own, the client and the upstream "
                             "sharing another (both sides alike): its overhead when it does "
                             "not wait for a core")
    parser.add_argument("--staggered", action="store_true",
                        help="spread each level's clients over one request's length, as "
                             "independent clients arrive, rather than all at once (the "
                             "default: alike streams then arrive in lockstep, the n-th "
                             "waiting on the n-1 before it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.pin and len(cores) < 2:
        parser.error("--pin needs two cores")
    if args.pin:
        os.sched_setaffinity(0, {cores[0]})  # this client, and the upstream it starts
    root = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    (root / "telemetry").mkdir(mode=0o700)
    upstream_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(upstream_port),
                                 str(EVENTS), str(args.gap_ms)])
    gateway = None
    try:
        wait_for(lambda: _connects(upstream_port), 10, "the synthetic upstream")
        gateway = ServerProcess(["gateway", "--upstream", f"http://127.0.0.1:{upstream_port}",
                                 "--telemetry-dir", str(root / "telemetry" / "gw"),
                                 "--log-level", "warning"], root)
        wait_for(lambda: _connects(gateway.port), 60, "the gateway")
        if args.pin:  # every thread of it (each has its own affinity), once all are started
            for thread in os.listdir(f"/proc/{gateway.proc.pid}/task"):
                os.sched_setaffinity(int(thread), {cores[-1]})
        ports = {"direct": upstream_port, "gateway": gateway.port}
        _round(ports["gateway"], 4, 10)  # warm: pool, imports, first allocations
        spread = EVENTS * args.gap_ms / 1e3 if args.staggered else 0.0
        rows = [_level(ports, int(s), args.rounds, args.requests, spread)
                for s in args.levels.split(",")]
        memory = _memory(gateway, args.memory_requests)
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.kill()
        upstream.wait()
    if args.json:
        print(json.dumps({"levels": rows, "memory": memory}))
    else:
        for row in rows:
            print(", ".join(f"{k} {v}" for k, v in row.items()))
        print(", ".join(f"{k} {v}" for k, v in memory.items()))
    return 0


def _memory(gateway, total: int) -> dict:
    """The gateway's RSS after a first tenth of `total` requests and after all of them
    (64 streams): flat means the second figure is the first, give or take the allocator."""
    pid = gateway.proc.pid
    tenth = max(64, total // 10)
    _round(gateway.port, 64, tenth // 64)
    after_tenth = _rss_kib(pid)
    done, lost = tenth // 64 * 64, 0
    while done < total:
        out, _ = _round(gateway.port, 64, max(1, min(tenth, total - done) // 64))
        done += len(out)
        lost += sum(not whole for _, _, whole in out)
    return {"requests": done, "rss_after_first_tenth_mib": round(after_tenth / 1024, 1),
            "rss_at_end_mib": round(_rss_kib(pid) / 1024, 1), "lost_or_reordered": lost}


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
