"""The daemon's memory over a simulated day of churn: engines and pids coming and going.

A real `Daemon` (its series budget, windows, snapshot and /metrics render; no history
store) is driven cycle by cycle on a simulated clock, one cycle a simulated second, as fast
as it goes. Its collectors are stood in for by a churn collector:
- engines: `--engines` alive at once (12 of ~860 series: ~10,000 live series), each with
  the series a real bundled engine exports (read once from files its own telemetry writer
  made), living a random 2-20 minutes (`--engine-life`), then replaced under a new name
  (a new engine name every ~1 min on average: faster than life);
- pids: `--pids` CUDA processes at once with per-pid series (the eBPF and NVML kind:
  kernel launches per stream, memcpy bytes, sync waits, process memory), each living a
  random 10-120 s.
Values move as under traffic: a third of the counters step each cycle (whole steps), the
sums and gauges drift. /metrics is rendered, gzipped, every `--scrape-every` cycles (60: a
Prometheus at 1 min; the stand-in families build their samples anew at each render).

Printed: the RSS curve (every `--every` simulated minutes: live and held series, the
windows' bytes, RSS), the slope of RSS (least squares, MB per simulated hour) once the
window is full (after two windows: a series gone is dropped at most two windows after its
last point), and RSS above idle (the daemon built, before its first cycle).
Usage: python bench/daemon_soak.py [--hours 24] [--engines 12] [--pids 40]
                                   [--engine-life 2-20] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from ac_observe import metrics as m
from ac_observe.collectors.base import Collector
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.daemon.windows import give_back_memory


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def engine_template() -> list[tuple[str, str, list[tuple[str, tuple]]]]:
    """(family, type, [(sample name, labels)]) of what a bundled engine exports, read by
    the daemon's engine collector from files the engine's own telemetry writer made."""
    from types import SimpleNamespace

    from ac_observe.collectors.engine import EngineCollector
    from ac_observe.engine.telemetry import TelemetryWriter
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = TelemetryWriter(root / "template", {"started_at": time.time()},
                                 engine="template", model="tiny")
        for lane in m.LANES:
            writer.observe(m.INFERENCE_LATENCY, 0.05, stream=lane)
        writer.close()
        collector = EngineCollector(SimpleNamespace(telemetry_root=root, telemetry_owner=None,
                                                    engine_stale_seconds=60,
                                                    engine_grace_seconds=60))
        return [(family.name, family.type,
                 [(s.name, tuple(s.labels.items())) for s in family.samples])
                for family in collector.collect()]


class BlockFamily(Metric):
    """A family carried as (keys, values) blocks, as the engine collector's are."""

    def __init__(self, name: str, typ: str, blocks: list):
        super().__init__(name, "", typ)
        self._blocks, self._refused = blocks, frozenset()

    @property
    def blocks(self):
        if not self._refused:
            return self._blocks
        out = []
        for keys, values in self._blocks:
            kept = [key not in self._refused for key in keys]
            out.append((tuple(k for k, keep in zip(keys, kept, strict=True) if keep),
                        values[kept]))
        return out

    def refuse(self, keys) -> None:
        self._refused = keys

    @property
    def samples(self):
        return [Sample(name, dict(labels), value, None, None)
                for keys, values in self.blocks
                for (name, labels), value in zip(keys, values.tolist(), strict=True)]

    @samples.setter
    def samples(self, value) -> None:
        pass


class Engine:
    def __init__(self, name: str, template, rng: np.random.Generator, born: float,
                 lifetime: float):
        self.name, self.ends = name, born + lifetime
        self.families = []  # (family, type, keys, slice of self.values)
        counter = []
        for family, typ, series in template:
            keys = tuple((sample, tuple((k, name if k == "engine" else v) for k, v in labels))
                         for sample, labels in series)
            self.families.append((family, typ, keys, slice(len(counter),
                                                           len(counter) + len(keys))))
            counter += [not s.endswith("_sum") and typ in ("counter", "histogram")
                        for s, _ in series]
        self.counter = np.array(counter)
        self.values = np.zeros(len(counter))
        self.rng = rng

    def step(self) -> None:
        moving = self.rng.random(len(self.values)) < 0.33
        steps = np.where(self.counter, self.rng.integers(1, 20, len(self.values)),
                         self.rng.random(len(self.values)))
        self.values[moving] += steps[moving]


class ChurnCollector(Collector):
    name = "churn"

    def __init__(self, engines: int, pids: int, life_minutes: tuple[float, float],
                 seed: int = 1):
        self.random = random.Random(seed)
        self.rng = np.random.default_rng(seed)
        self.template = engine_template()
        self.per_engine = sum(len(series) for _, _, series in self.template)
        self.num_engines, self.num_pids = engines, pids
        self.life_seconds = (60 * life_minutes[0], 60 * life_minutes[1])
        self.engines: list[Engine] = []
        self.pids: dict[int, float] = {}  # pid -> when it ends
        self.pid_values: dict[tuple, float] = {}
        self.next_engine = self.next_pid = 0
        self.now = 0.0

    def advance(self, now: float) -> None:
        self.now = now
        self.engines = [e for e in self.engines if e.ends > now]
        while len(self.engines) < self.num_engines:
            self.engines.append(Engine(f"engine-{self.next_engine}", self.template, self.rng,
                                       now, self.random.uniform(*self.life_seconds)))
            self.next_engine += 1
        self.pids = {pid: ends for pid, ends in self.pids.items() if ends > now}
        while len(self.pids) < self.num_pids:
            self.next_pid += 1
            self.pids[10_000 + self.next_pid] = now + self.random.uniform(10, 120)
        for engine in self.engines:
            engine.step()

    def collect(self):
        families: dict[str, list] = {}
        for engine in self.engines:
            values = engine.values.copy()
            for family, typ, keys, span in engine.families:
                families.setdefault(family, [typ, []])[1].append((keys, values[span]))
        out: list[Metric] = [BlockFamily(name, typ, blocks)
                             for name, (typ, blocks) in families.items()]
        launches = Metric(m.CUDA_KERNEL_LAUNCHES.family, "", "counter")
        memory = Metric(m.GPU_PROCESS_MEMORY.family, "", "gauge")
        for pid in self.pids:
            for stream in ("7", "13", "default"):
                labels = {"pid": str(pid), "comm": "python", "stream": stream}
                key = (pid, stream)
                self.pid_values[key] = self.pid_values.get(key, 0) + self.random.randrange(50)
                launches.add_sample(m.CUDA_KERNEL_LAUNCHES.name, labels, self.pid_values[key])
            memory.add_sample(m.GPU_PROCESS_MEMORY.name, {"gpu": "0", "uuid": "GPU-0",
                                                          "pid": str(pid)}, 2.0 ** 30)
        self.pid_values = {k: v for k, v in self.pid_values.items() if k[0] in self.pids}
        return out + [launches, memory]


def slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    return float(np.polyfit(x, y, 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours")
    parser.add_argument("--engines", type=int, default=12, help="engines alive at once")
    parser.add_argument("--pids", type=int, default=40, help="CUDA processes at once")
    parser.add_argument("--engine-life", default="2-20",
                        help="an engine's life, minutes: uniform in MIN-MAX")
    parser.add_argument("--window", type=float, default=3600.0, help="daemon --window, s")
    parser.add_argument("--every", type=float, default=30.0, help="minutes between points")
    parser.add_argument("--scrape-every", type=int, default=60, help="cycles between renders")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    low, high = (float(part) for part in args.engine_life.split("-"))
    churn = ChurnCollector(args.engines, args.pids, (low, high))
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(DaemonConfig(telemetry_root=Path(tmp), collectors=(), history=False,
                                     window_seconds=args.window), collectors=[churn])
        give_back_memory()
        idle = rss_mb()
        start = 1.7e9
        cycles = int(args.hours * 3600)
        every = int(args.every * 60)
        curve = []
        began = time.monotonic()
        for cycle in range(1, cycles + 1):
            now = start + cycle
            churn.advance(now)
            daemon.run_cycle(now)
            if cycle % args.scrape_every == 0:
                daemon.render_metrics_gzip()
            if cycle % every == 0:
                point = {"hour": round(cycle / 3600, 3), "live": daemon.budget.held,
                         "held": len(daemon.windows.series),
                         "windows_mb": round(daemon.windows.nbytes / 2 ** 20, 1),
                         "rss_mb": round(rss_mb(), 1)}
                curve.append(point)
                if not args.json:
                    print(f"{point['hour']:6.2f} h  live {point['live']:6d}  held "
                          f"{point['held']:6d}  windows {point['windows_mb']:6.1f} MB  "
                          f"RSS {point['rss_mb']:6.1f} MB", flush=True)
        full = [(p["hour"], p["rss_mb"]) for p in curve if p["hour"] * 3600 >= 2 * args.window]
        result = {"hours": args.hours, "engines_at_once": args.engines,
                  "series_per_engine": churn.per_engine, "pids_at_once": args.pids,
                  "engines_started": churn.next_engine, "pids_started": churn.next_pid,
                  "idle_rss_mb": round(idle, 1),
                  "final_rss_mb": curve[-1]["rss_mb"] if curve else None,
                  "above_idle_mb": round(curve[-1]["rss_mb"] - idle, 1) if curve else None,
                  "slope_mb_per_hour_after_two_windows": round(slope(full), 3),
                  "wall_seconds": round(time.monotonic() - began, 1), "curve": curve}
        daemon.close()
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(f"idle {result['idle_rss_mb']} MB; at the end {result['final_rss_mb']} MB "
              f"({result['above_idle_mb']} MB above idle) with ~{daemon.budget.held} live "
              f"series; {result['engines_started']} engines and {result['pids_started']} "
              f"pids started; RSS slope after two windows "
              f"{result['slope_mb_per_hour_after_two_windows']} MB/h; "
              f"{result['wall_seconds']} s")


if __name__ == "__main__":
    main()
