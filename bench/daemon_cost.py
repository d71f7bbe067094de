"""The daemon's cost: CPU time per collection cycle and /metrics latency (p50/p99).

The cycles are scraped as Prometheus scrapes: with gzip, every SCRAPE_EVERY (15) cycles,
and what the scrapes render and compress counts as the cycles' cost.

Two sizes: one engine's worth of series (what the demo produces) and the fewest engines
giving 10,000 series or more (12 of ~857 series each). Engines are stood in for by their
telemetry files, written with the engine's own TelemetryWriter and filled with
observations, so the daemon reads the real format. /metrics is scraped by 1 client and by
50 at once (keep-alive connections from a separate process, see scrape_worker; the daemon
cycling underneath), p50/p99 over every scrape.
Between two cycles each engine finishes `--load` requests (20: one engine's demo rate is
a few a second, so this is a busy node), written untimed: a cycle meets series that
changed, not only still ones.
Usage: python bench/daemon_cost.py [--cycles 60] [--scrapes 300] [--load 20] [--json]
       python bench/daemon_cost.py --phases 12 --cycles 20   (where a cycle's CPU goes)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timed_calls import time_calls

from ac_observe import metrics as m
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.http_api import make_server
from ac_observe.daemon.service import Daemon, tune_interpreter
from ac_observe.engine.telemetry import TelemetryWriter
from ac_observe.metrics import LANES

SCALE_SERIES = 10_000  # the second size
SCRAPE_EVERY = 15  # cycles (1 s) between two scrapes: Prometheus at its usual 15 s


def write_engine(directory: Path, name: str, rng: random.Random) -> TelemetryWriter:
    writer = TelemetryWriter(directory, {"api_address": "", "started_at": time.time()},
                             engine=name, model="tiny", heartbeat_seconds=0.5)
    traffic(writer, rng, 200)
    return writer


def traffic(writer: TelemetryWriter, rng: random.Random, requests: int) -> None:
    """What `requests` finished requests leave in an engine's files."""
    for _ in range(requests):
        lane = rng.choice(LANES)
        for spec in (m.INFERENCE_LATENCY, m.QUEUE_TIME, m.E2E_LATENCY, m.INTER_TOKEN_LATENCY):
            writer.observe(spec, rng.expovariate(20), stream=lane)
        writer.observe(m.PREFILL_GPU, rng.expovariate(100), stream=lane)
        writer.observe(m.DECODE_STEP_GPU, rng.expovariate(500), stream=lane)
        writer.inc(m.STREAM_BUSY, 0.01, stream=lane)
        writer.inc(m.REQUESTS, stream=lane, status="ok")
        writer.observe(m.SKELETON_COMPLEXITY, float(rng.randint(1, 9)))
        writer.inc(m.SKELETON_REQUESTS, skeleton=f"{rng.randrange(20):012x}")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def loaded_cycles(daemon: Daemon, writers: list, rng: random.Random, cycles: int,
                  load: int) -> float:
    """CPU seconds of `cycles` cycles, each after `load` requests per engine (untimed),
    scraped with gzip every SCRAPE_EVERY cycles as Prometheus does (the scrape's render
    and gzip, where the cycle did not make them ahead, count as the cycle's)."""
    spent = 0.0
    for cycle in range(cycles):
        for writer in writers:
            traffic(writer, rng, load)
        before = cpu_seconds()
        daemon.run_cycle()
        if cycle % SCRAPE_EVERY == 0:
            daemon.render_metrics_gzip()
        spent += cpu_seconds() - before
    return spent


@contextlib.contextmanager
def paced_daemon(num_engines: int, load: int):
    """(daemon, writers, rng): `num_engines` engines' files under a daemon that ran four
    cycles and then 3 x SCRAPE_EVERY loaded, scraped ones (untimed: its pace learnt);
    the daemon and the writers are closed on the way out."""
    rng = random.Random(num_engines)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writers = [write_engine(root / f"engine-{i}", f"engine-{i}", rng)
                   for i in range(num_engines)]
        daemon = Daemon(DaemonConfig(telemetry_root=root, collectors=("engine",)))
        try:
            for _ in range(4):
                daemon.run_cycle()
            loaded_cycles(daemon, writers, rng, 3 * SCRAPE_EVERY, load)
            yield daemon, writers, rng
        finally:
            daemon.close()
            for writer in writers:
                writer.close()


def measure(num_engines: int, cycles: int, scrapes: int,
            concurrency: tuple[int, ...] = (1, 50), load: int = 20) -> dict:
    """`load`: requests each engine finishes between two cycles (written untimed), so a
    cycle meets series that changed, as under traffic, not only still ones."""
    with paced_daemon(num_engines, load) as (daemon, writers, rng):
        series = sum(len(f.samples) for f in daemon._snapshot)
        per_cycle = loaded_cycles(daemon, writers, rng, cycles, load) / cycles
        server = make_server(daemon, "127.0.0.1", 0, None)
        stop_server = server.start_in_thread()
        daemon.start()  # scrapes race real cycles, so rendering is not always cached
        scraping = {c: _scrape(server.port, c, scrapes) for c in concurrency}
        stop_server()
    result = {"engines": num_engines, "series": series, "cpu_ms_per_cycle": per_cycle * 1e3,
              "core_percent_at_1s": per_cycle * 100}
    for c, (latencies, body) in scraping.items():
        latencies.sort()
        result[f"scrape_p50_ms_{c}"] = statistics.median(latencies) * 1e3
        result[f"scrape_p99_ms_{c}"] = latencies[int(0.99 * (len(latencies) - 1))] * 1e3
        result["body_kib"] = body / 1024
    return result


def phases(num_engines: int, cycles: int, load: int) -> dict:
    """Where a loaded, scraped cycle goes: thread CPU time of each of its phases (the
    collector reading the files and summing them into series on its own thread, the
    windows, the minute history, the render), ms a cycle."""
    import collections

    from ac_observe.collectors.engine import families, files, plan
    from ac_observe.daemon import exposition, history, windows
    spent: collections.Counter = collections.Counter()
    for owner, name, label in (
            (Daemon, "run_cycle", "the whole cycle (not scrapes)"),
            (files.EngineFiles, "read", "read the files, all in"),
            (plan.SeriesPlan, "evaluate", "  of which: sum into series"),
            (families.EngineValues, "add_to", "add to the families"),
            (windows.Windows, "append", "windows"),
            (history.MinuteAggregator, "add", "minute history"),
            (exposition.Renderer, "render", "render"),
            (Daemon, "render_metrics_gzip", "render and gzip")):
        time_calls(owner, name, spent, label, clock=time.thread_time)
    with paced_daemon(num_engines, load) as (daemon, writers, rng):
        spent.clear()
        loaded_cycles(daemon, writers, rng, cycles, load)
    return {label: seconds / cycles * 1e3 for label, seconds in spent.most_common()
            if not label.endswith(" calls")}


def _scrape(port: int, clients: int, scrapes: int) -> tuple[list[float], int]:
    """`scrapes` GETs of /metrics spread over `clients` scrapers at once, run in another
    process (the scrapers' own Python work must not share the daemon's GIL)."""
    out = subprocess.run([sys.executable, __file__, "--scrape-worker", str(port),
                          str(clients), str(scrapes)], check=True, capture_output=True,
                         text=True, timeout=900)
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    return answer["latencies"], answer["size"]


def scrape_worker(port: int, clients: int, scrapes: int) -> tuple[list[float], int]:
    """The scrapers: `clients` connections at once, each a keep-alive HTTP/1.1 client
    scraping in a loop and asking for gzip as Prometheus does, on one asyncio loop with
    bare sockets. A scraper is Prometheus (Go):
    a client costing ~1 ms of Python a request, 50 of them in threads, would time its own
    queue for the GIL, not the daemon (httpx did: p50 56 ms at 1 engine)."""
    latencies: list[float] = []
    size = [0]

    async def one_client(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        try:
            for _ in range(n):
                start = time.perf_counter()
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n"
                             b"Accept: text/plain\r\nAccept-Encoding: gzip\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1]
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                latencies.append(time.perf_counter() - start)
                assert status == b"200", head
                size[0] = len(body)
                await asyncio.sleep(0.005)
        finally:
            writer.close()

    async def all_clients() -> None:
        each = max(scrapes // clients, 5)
        await asyncio.gather(*(one_client(each) for _ in range(clients)))
    asyncio.run(all_clients())
    return latencies, size[0]


def main() -> None:
    tune_interpreter()  # as `ac-observe daemon` does
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--load", type=int, default=20,
                        help="Requests each engine finishes between two cycles.")
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    parser.add_argument("--scrape-worker", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--phases", type=int, metavar="ENGINES",
                        help="Only time the phases of a loaded cycle at this many engines.")
    args = parser.parse_args()
    if args.phases:
        for label, ms in phases(args.phases, args.cycles, args.load).items():
            print(f"{label:>30} {ms:8.1f} ms a cycle")
        return
    if args.scrape_worker:
        latencies, size = scrape_worker(*args.scrape_worker)
        print(json.dumps({"latencies": latencies, "size": size}))
        return
    print(f"{'engines':>7} {'series':>7} {'cpu ms/cycle':>13} {'% core @1s':>11} "
          f"{'p50/p99 ms, 1 scraper':>22} {'p50/p99 ms, 50':>15} {'gzip KiB':>9}")
    results = []
    engines = 1
    while True:
        r = measure(engines, args.cycles, args.scrapes, load=args.load)
        results.append(r)
        print(f"{r['engines']:>7} {r['series']:>7} {r['cpu_ms_per_cycle']:>13.2f} "
              f"{r['core_percent_at_1s']:>11.2f} "
              f"{r['scrape_p50_ms_1']:>10.2f} / {r['scrape_p99_ms_1']:<9.2f} "
              f"{r['scrape_p50_ms_50']:>6.2f} / {r['scrape_p99_ms_50']:<6.2f} "
              f"{r['body_kib']:>9.0f}", flush=True)
        if r["series"] >= SCALE_SERIES:
            break
        engines = math.ceil(SCALE_SERIES / r["series"])  # the fewest reaching it
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
