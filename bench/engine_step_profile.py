"""Where a decode step's time goes: torch profiler over steady-state decode steps.

Usage: python bench/engine_step_profile.py [--batch 16] [--context 64] [--steps 20]
Prints the step time (min and median of repeated timings, alternating in one run the CPU
decode workspace on and off, and the projections' packed weights (oneDNN) on and off) and
the top operators with both on.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--warmup", type=int, default=60, help="decode steps before timing")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    engine = Engine(EngineConfig(), start=False)  # driven on this thread, step by step
    rng = random.Random(0)
    budget = args.warmup + 26 * (args.steps + 1) + 8  # 8 rounds of 3 modes, and slack
    for _ in range(args.batch):
        engine.add_request([rng.randrange(256) for _ in range(args.context)],
                           params=SamplingParams(max_tokens=budget, ignore_eos=True))
    for _ in range(args.warmup):
        engine.step()
    workspaces = engine.runner.workspaces
    projections = engine.runner.model.projections()
    packed = [proj.packed for proj in projections]
    timings: dict[str, list[float]] = {"workspace on": [], "workspace off": [],
                                       "workspace on, weights not packed": []}
    for _ in range(8):
        for mode in timings:
            engine.runner.workspaces = workspaces if mode != "workspace off" else {}
            for proj, weight in zip(projections, packed, strict=False):
                proj.packed = None if mode.endswith("not packed") else weight
            for workspace in workspaces.values():
                workspace.clear()
            engine.step()  # a rebuild (or not), outside the timing
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            timings[mode].append((time.perf_counter() - start) / args.steps * 1e3)
    engine.runner.workspaces = workspaces
    for proj, weight in zip(projections, packed, strict=False):
        proj.packed = weight
    context = args.context + args.warmup + 24 * (args.steps + 1)
    for mode, values in timings.items():
        print(f"batch {args.batch}, context {args.context}..{context}, {mode}: step ms "
              f"min {min(values):.2f} median {statistics.median(values):.2f}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    engine.close()


if __name__ == "__main__":
    main()
