"""What observing costs the engine: tokens/s with its instrumentation on (telemetry files,
statistics, device step timers, kernel sampling at its defaults, skeleton parsing) against
an engine built with `instrumentation=False` (`ac-observe engine --no-instrumentation`),
same model, same requests, batch 1 and 16.

Chat requests (a system prompt and a markdown/JSON user turn, so skeletons are parsed)
decode --new-tokens each. Every measurement runs in a fresh process; the two sides
alternate in --pairs pairs (on/off, then off/on), each process timing both batch sizes
(median of --repeats after a warm-up). The overhead of a pair is off/on - 1 on tokens/s;
the row is the median over pairs with the spread (lowest, highest). A second estimate
runs both engines in one process, taking turns a batch at a time (--blocks turns each),
so the between-process noise of a shared machine hits both sides alike. Another times
every instrumentation hook where it runs, as a share of the step loop (the least noisy
of the three figures: it does not difference two noisy totals). One extra process
runs the instrumented side with its step loop under cProfile and reports the share of the
loop's working time spent in the instrumentation's own modules (engine/stats.py,
telemetry.py, kernel_sampler.py and the telemetry file format), and what skeleton parsing
costs per request on the caller's thread.

Usage: python bench/instrumentation_overhead.py [--pairs 10] [--new-tokens 64] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time

from timed_calls import time_calls

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams

SYSTEM = "You are a careful assistant. Answer in short markdown.\n" * 8
MODULES = ("engine/stats.py", "engine/telemetry.py", "engine/kernel_sampler.py",
           "contract/telemetry_format.py", "ac_observe/telemetry_format.py")


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"# Task {i}\n- list the steps\n- keep it short\n"
                                        f"```json\n{{\"id\": {i}, \"tags\": [\"a\", \"b\"]}}\n```"}]


def _run(engine: Engine, batch: int, new_tokens: int, offset: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    handles = [engine.add_request(messages=_messages(offset + i), system=SYSTEM,
                                  lane="throughput", params=params) for i in range(batch)]
    outs = [h.result() for h in handles]
    seconds = time.perf_counter() - start
    assert all(o.num_output_tokens == new_tokens for o in outs)
    return batch * new_tokens / seconds


def worker(on: bool, batches: list[int], new_tokens: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(instrumentation=on, telemetry_dir=f"{tmp}/e" if on else None,
                              seed=0)
        with Engine(config) as engine:
            rates = {}
            for batch in batches:
                _run(engine, batch, new_tokens, 10_000 * batch)  # warm-up
                rates[batch] = statistics.median(
                    _run(engine, batch, new_tokens, 10_000 * batch + 100 * (r + 1))
                    for r in range(repeats))
    return rates


def blocks(batches: list[int], new_tokens: int, count: int) -> dict:
    """Both engines in one process, one instrumented and one not, taking turns a batch at
    a time (--blocks turns each, the order alternating): the between-process noise of
    this machine (thread placement, page cache, neighbours) hits both alike. The overhead
    is the ratio of the summed times (not a mean of ratios); the spread, that of each
    turn's pair."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp, \
            Engine(EngineConfig(instrumentation=True, telemetry_dir=f"{tmp}/e",
                                seed=0)) as on, \
            Engine(EngineConfig(instrumentation=False, seed=0)) as off:
        for batch in batches:
            for engine in (on, off):
                _run(engine, batch, new_tokens, 20_000 * batch)  # warm-up
            seconds = {"on": [], "off": []}
            for b in range(count):
                order = (("on", on), ("off", off)) if b % 2 == 0 else (("off", off),
                                                                      ("on", on))
                for name, engine in order:
                    rate = _run(engine, batch, new_tokens, 20_000 * batch + 100 * (b + 1))
                    seconds[name].append(batch * new_tokens / rate)
            pairs = sorted(a / b - 1 for a, b in zip(seconds["on"], seconds["off"], strict=False))
            out[str(batch)] = {"overhead": sum(seconds["on"]) / sum(seconds["off"]) - 1,
                               "overhead_p10": pairs[len(pairs) // 10],
                               "overhead_p90": pairs[(len(pairs) * 9) // 10],
                               "blocks": count}
    return out


WAITS = ("acquire", "wait", "sleep")  # a thread blocked, not working


def profile_share(batches: list[int], new_tokens: int) -> dict:
    """The engine thread's step loop under cProfile: self time in the instrumentation's
    modules (and the telemetry file format's writes) as a share of the loop's working
    time (its self time less lock and event waits). Work inside builtins called from
    them (a regex, an mmap write) is charged to the builtin, so this is a floor. Skeleton
    parsing runs on the caller's thread at admission: timed apart, per request."""
    import cProfile
    import pstats

    from ac_observe.engine import llm_engine
    from ac_observe.engine.skeleton import skeleton_of_request
    profiler = cProfile.Profile()
    real = llm_engine.Engine._loop

    def profiled(self, *args, **kwargs):
        profiler.enable()
        try:
            return real(self, *args, **kwargs)
        finally:
            profiler.disable()
    llm_engine.Engine._loop = profiled
    worker(True, batches, new_tokens, 1)
    stats = pstats.Stats(profiler).stats
    working = sum(row[2] for (_, _, name), row in stats.items()
                  if not any(w in name for w in WAITS))
    ours = {m: 0.0 for m in MODULES}
    for (filename, _, _), row in stats.items():
        for module in MODULES:
            if filename.endswith(module):
                ours[module] += row[2]
    runs = 200
    start = time.perf_counter()
    for i in range(runs):
        skeleton_of_request(SYSTEM, _messages(i))
    parse_us = (time.perf_counter() - start) / runs * 1e6
    return {"working_seconds": working, "skeleton_parse_us_per_request": parse_us,
            "share": {m: (v / working if working else 0.0) for m, v in ours.items()}}


def hooks_share(batches: list[int], new_tokens: int, repeats: int = 10) -> dict:
    """The instrumentation timed where it runs: every EngineStats hook, the telemetry
    flushes and the kernel sampler's begin/end on the engine thread, wrapped in
    perf_counter, against the step loop's own time, per batch size. Unlike cProfile this
    charges the hooks what they call (the mmap writes, the locks) and adds ~0.2 us a call,
    not a tracer's overhead on every function. Kernel sampling runs as by default: its
    bookkeeping on every step counts as hooks; a sampled step's begin/end and its slower
    step are the sampler's own charge (`overhead_seconds`, bounded by its budget, 0.5 % of
    wall time by default), counted apart and taken out of the step loop's time."""
    from ac_observe.engine import llm_engine, stats
    from ac_observe.engine.kernel_sampler import KernelSampler
    spent: collections.Counter = collections.Counter()
    # Outermost hooks only (flush_due calls flush, which writes the state and gauges).
    for name in ("on_rejected", "on_accepted", "on_step", "on_kernel_sample",
                 "on_first_scheduled", "on_tokens", "on_first_text", "on_finished",
                 "flush_due"):
        time_calls(stats.EngineStats, name, spent, "hooks")
    time_calls(llm_engine.Engine, "step", spent, "steps")
    real_begin, real_end = KernelSampler.begin, KernelSampler.end

    def begin(self, keys):
        start = time.perf_counter()
        sampled = real_begin(self, keys)
        spent["sampled" if sampled else "hooks"] += time.perf_counter() - start
        return sampled

    def end(self, completed=None):
        sampled, start = self._profile is not None, time.perf_counter()
        try:
            return real_end(self, completed)
        finally:
            spent["sampled" if sampled else "hooks"] += time.perf_counter() - start
    KernelSampler.begin, KernelSampler.end = begin, end
    out = {}
    with tempfile.TemporaryDirectory() as tmp, \
            Engine(EngineConfig(instrumentation=True, telemetry_dir=f"{tmp}/e",
                                seed=0)) as engine:
        sampler = engine.kernel_sampler
        for batch in batches:
            _run(engine, batch, new_tokens, 30_000 * batch)  # warm-up
            spent.clear()
            charged = sampler.overhead_seconds
            for r in range(repeats):
                _run(engine, batch, new_tokens, 30_000 * batch + 100 * (r + 1))
            steps = spent["steps calls"]
            charged = sampler.overhead_seconds - charged
            working = spent["steps"] - charged  # the step loop without the samples
            out[str(batch)] = {"share": spent["hooks"] / working,
                               "us_per_step": spent["hooks"] / steps * 1e6,
                               "step_ms": working / steps * 1e3,
                               "sampling_share": charged / spent["steps"]}
    return out


def _spawn(args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--batches", args.batches, "--new-tokens",
           str(args.new_tokens), "--repeats", str(args.repeats), *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=20,
                        help="Turns of each engine in the one-process comparison.")
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    parser.add_argument("--worker", choices=["on", "off", "profile", "blocks", "hooks"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker == "profile":
        print(json.dumps(profile_share(batches, args.new_tokens)))
        return
    if args.worker == "hooks":
        print(json.dumps(hooks_share(batches, args.new_tokens)))
        return
    if args.worker == "blocks":
        print(json.dumps(blocks(batches, args.new_tokens, args.blocks)))
        return
    if args.worker:
        rates = worker(args.worker == "on", batches, args.new_tokens, args.repeats)
        print(json.dumps({str(k): v for k, v in rates.items()}))
        return
    runs = {"on": [], "off": []}
    for pair in range(args.pairs):
        for side in (("on", "off") if pair % 2 == 0 else ("off", "on")):
            runs[side].append(_spawn(args, "--worker", side))
    profile = _spawn(args, "--worker", "profile")
    in_process = _spawn(args, "--worker", "blocks", "--blocks", str(args.blocks))
    hooks = _spawn(args, "--worker", "hooks")
    result = {"pairs": args.pairs, "new_tokens": args.new_tokens, "batches": {}}
    print(f"instrumentation overhead: {args.pairs} alternating pairs, {args.new_tokens} new "
          f"tokens, chat requests (skeletons parsed), CPU threads as torch sets them")
    print(f"{'batch':>5} {'on tok/s':>10} {'off tok/s':>10} {'overhead':>9} "
          f"{'spread (pairs)':>18}")
    for batch in batches:
        on = [r[str(batch)] for r in runs["on"]]
        off = [r[str(batch)] for r in runs["off"]]
        overheads = sorted(o_off / o_on - 1 for o_on, o_off in zip(on, off, strict=False))
        row = {"on_tokens_per_s": statistics.median(on),
               "off_tokens_per_s": statistics.median(off),
               "overhead": statistics.median(overheads),
               "overhead_min": overheads[0], "overhead_max": overheads[-1]}
        result["batches"][str(batch)] = row
        print(f"{batch:>5} {row['on_tokens_per_s']:>10.1f} {row['off_tokens_per_s']:>10.1f} "
              f"{row['overhead'] * 100:>8.2f}% {overheads[0] * 100:>8.2f}% .. "
              f"{overheads[-1] * 100:.2f}%")
    result["in_process"] = in_process
    for batch, b in in_process.items():
        print(f"one process, {b['blocks']} alternating turns each, batch {batch}: overhead "
              f"{b['overhead'] * 100:.2f}% (turns p10..p90 {b['overhead_p10'] * 100:.2f}% .. "
              f"{b['overhead_p90'] * 100:.2f}%)")
    result["hooks"] = hooks
    for batch, h in hooks.items():
        print(f"hooks timed in place, batch {batch}: {h['us_per_step']:.1f} us a step of "
              f"{h['step_ms']:.2f} ms = {h['share'] * 100:.2f}% (kernel sampling apart: "
              f"{h['sampling_share'] * 100:.2f}% here, its budget in the long run)")
    share = {m: v for m, v in profile["share"].items() if v}
    result["profile_share"] = share
    result["skeleton_parse_us_per_request"] = profile["skeleton_parse_us_per_request"]
    print("cProfile, the instrumented step loop: self time in "
          + ", ".join(f"{m.split('/')[-1]} {v * 100:.2f}%" for m, v in share.items())
          + f" (sum {sum(share.values()) * 100:.2f}% of {profile['working_seconds']:.2f} s "
          f"working); skeleton parsing {profile['skeleton_parse_us_per_request']:.0f} us "
          "a request at admission")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
