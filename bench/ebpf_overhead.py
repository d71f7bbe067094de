"""What a probed CUDA call costs: ns per cuLaunchKernel (stand-in driver, built here) with
no probes, with the counting probes (entry only), with launch-latency probes too (a
return probe), and with the runtime group as well (the bench calls the driver directly,
so that row shows the cost of probes that do not fire); and what that
adds up to at 10k and 100k launches/s. Needs root (real uprobes, through the collector).

Modes alternate, each in a fresh process, best and median of --rounds.
Usage: sudo .venv/bin/python bench/ebpf_overhead.py [--calls 200000] [--rounds 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ac_observe.collectors.ebpf import EbpfCollector  # noqa: E402
from support.standins import Pattern, build_cuda  # noqa: E402  (test helper, not shipped)

MODES = {"unprobed": None, "counting": ("launch", "graph", "sync", "memcpy"),
         "with latency": ("launch", "graph", "sync", "memcpy", "launch_latency"),
         "runtime too": ("launch", "graph", "sync", "memcpy", "launch_latency", "runtime")}


def measure(folder: Path, groups, calls: int) -> float:
    pattern = Pattern(folder)
    collector = None
    try:
        if groups is not None:
            collector = EbpfCollector(SimpleNamespace(telemetry_root=folder / "none",
                                                      telemetry_owner=None,
                                                      ebpf_probes=groups))
            collector.collect()  # compiles, finds the pattern, attaches
        pattern.run(f"bench {calls // 10}")  # warm
        return float(pattern.run(f"bench {calls}"))
    finally:
        pattern.exit()
        if collector is not None:
            collector.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_cuda(Path(tmp))
        results = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, groups in MODES.items():
                results[mode].append(measure(folder, groups, args.calls))
    base = statistics.median(results["unprobed"])
    print(f"{'mode':<14} {'ns/call med':>12} {'best':>8} {'added ns':>9} "
          f"{'core % @10k/s':>14} {'core % @100k/s':>15}")
    summary = {}
    for mode, values in results.items():
        added = statistics.median(values) - base
        summary[mode] = {"ns_per_call": statistics.median(values), "added_ns": added,
                         "core_percent_10k": added * 1e4 / 1e9 * 100,
                         "core_percent_100k": added * 1e5 / 1e9 * 100}
        print(f"{mode:<14} {statistics.median(values):>12.1f} {min(values):>8.1f} "
              f"{added:>9.1f} {added * 1e4 / 1e9 * 100:>14.2f} "
              f"{added * 1e5 / 1e9 * 100:>15.2f}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
