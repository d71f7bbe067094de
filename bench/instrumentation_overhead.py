"""What observing costs the engine: tokens/s with its instrumentation on (telemetry files,
statistics, device step timers, kernel sampling at its defaults, skeleton parsing) against
an engine built with `instrumentation=False` (`ac-observe engine --no-instrumentation`),
same model, same requests, batch 1 and 16.

Chat requests (a system prompt and a markdown/JSON user turn, so skeletons are parsed)
decode --new-tokens each. Every measurement runs in a fresh process; the two sides
alternate in --pairs pairs (on/off, then off/on), each process timing both batch sizes
(median of --repeats after a warm-up). The overhead of a pair is off/on - 1 on tokens/s;
the row is the median over pairs with the spread (lowest, highest). One extra process
runs the instrumented side under cProfile and reports the share of its time (the
engine's step loop and the caller's thread) spent in the instrumentation's own modules (engine/stats.py, telemetry.py,
skeleton.py, kernel_sampler.py).

Usage: python bench/instrumentation_overhead.py [--pairs 10] [--new-tokens 64] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams

SYSTEM = "You are a careful assistant. Answer in short markdown.\n" * 8
MODULES = ("engine/stats.py", "engine/telemetry.py", "engine/skeleton.py",
           "engine/kernel_sampler.py")


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


def profile_share(batches: list[int], new_tokens: int) -> dict:
    """Self time in the instrumentation's modules, as a share of all profiled time: the
    engine thread's step loop and the caller's thread (where requests are tokenized and
    their skeletons parsed), each under its own cProfile."""
    import cProfile
    import pstats

    from ac_observe.engine import llm_engine
    loop_profiler, caller_profiler = cProfile.Profile(), cProfile.Profile()
    real = llm_engine.Engine._loop

    def profiled(self, *args, **kwargs):
        loop_profiler.enable()
        try:
            return real(self, *args, **kwargs)
        finally:
            loop_profiler.disable()
    llm_engine.Engine._loop = profiled
    caller_profiler.enable()
    worker(True, batches, new_tokens, 1)
    caller_profiler.disable()
    stats = pstats.Stats(loop_profiler)
    stats.add(caller_profiler)
    total = sum(row[2] for row in stats.stats.values())  # tottime: self time
    ours = {m: 0.0 for m in MODULES}
    for (filename, _, _), row in stats.stats.items():
        for module in MODULES:
            if filename.endswith(module):
                ours[module] += row[2]
    return {"total_seconds": total,
            "share": {m: (v / total if total else 0.0) for m, v in ours.items()}}


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
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    parser.add_argument("--worker", choices=["on", "off", "profile"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker == "profile":
        print(json.dumps(profile_share(batches, args.new_tokens)))
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
    result = {"pairs": args.pairs, "new_tokens": args.new_tokens, "batches": {}}
    print(f"instrumentation overhead: {args.pairs} alternating pairs, {args.new_tokens} new "
          f"tokens, chat requests (skeletons parsed), CPU threads as torch sets them")
    print(f"{'batch':>5} {'on tok/s':>10} {'off tok/s':>10} {'overhead':>9} "
          f"{'spread (pairs)':>18}")
    for batch in batches:
        on = [r[str(batch)] for r in runs["on"]]
        off = [r[str(batch)] for r in runs["off"]]
        overheads = sorted(o_off / o_on - 1 for o_on, o_off in zip(on, off))
        row = {"on_tokens_per_s": statistics.median(on),
               "off_tokens_per_s": statistics.median(off),
               "overhead": statistics.median(overheads),
               "overhead_min": overheads[0], "overhead_max": overheads[-1]}
        result["batches"][str(batch)] = row
        print(f"{batch:>5} {row['on_tokens_per_s']:>10.1f} {row['off_tokens_per_s']:>10.1f} "
              f"{row['overhead'] * 100:>8.2f}% {overheads[0] * 100:>8.2f}% .. "
              f"{overheads[-1] * 100:.2f}%")
    share = profile["share"]
    result["profile_share"] = share
    print("cProfile, instrumented (step loop + caller): self time in "
          + ", ".join(f"{m.split('/')[-1]} {v * 100:.2f}%" for m, v in share.items())
          + f" (sum {sum(share.values()) * 100:.2f}% of {profile['total_seconds']:.2f} s)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
