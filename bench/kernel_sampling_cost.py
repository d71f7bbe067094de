"""What sampled kernel time costs: the engine's tokens/s with kernel sampling at its default
rate against off, in one run, alternating.

One engine (tiny preset, or --model/--device) keeps --batch requests decoding (a finished
request is replaced at once, so prefills mix in as in service). Sampling is switched on
and off every --steps steps (a pair is one block of each, the order alternating), so drift
(growing contexts, a noisy neighbour) hits both sides alike. Samples are rare (every
`kernel_sample_steps`-th step of a lane and phase, within `kernel_sample_budget` of wall
time), so a block holds one or none: the cost is read from the sums over all pairs
(on tokens/s over off tokens/s), and the spread from the same ratio over each tenth of
the pairs. The sampler's count runs on only in "on" blocks, and its budget accrues only
there, as if sampling were always on. Also printed: what the sampler charged itself per
sample and in all (its own measure of the cost), and the classes of the last sample.

Usage: python bench/kernel_sampling_cost.py [--pairs 200] [--steps 50] [--batch 16]
       [--device cpu|cuda] [--model tiny|random-1b|FOLDER]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device=args.device)
    default_every = config.kernel_sample_steps
    rng = random.Random(0)
    generated = 0

    def count(out) -> None:
        nonlocal generated
        generated += len(out.new_token_ids)

    with Engine(config, start=False) as engine:
        sampler = engine.kernel_sampler

        def top_up() -> None:
            while engine.num_unfinished < args.batch:
                engine.add_request([rng.randrange(256) for _ in range(args.prompt)],
                                   params=SamplingParams(max_tokens=args.max_tokens,
                                                         ignore_eos=True),
                                   lane="throughput", on_output=count)

        def run(on: bool) -> tuple[int, float, int]:
            nonlocal generated
            sampler.every_steps = default_every if on else 0
            if on:
                sampler._refilled = sampler.clock()  # the off block earned no budget
            samples = sampler.num_samples
            generated = 0
            start = time.perf_counter()
            for _ in range(args.steps):
                top_up()
                engine.step()
            return generated, time.perf_counter() - start, sampler.num_samples - samples

        sampler.every_steps = default_every
        for _ in range(max(default_every, 50) + 20):  # warm-up, and a usual step time known
            top_up()
            engine.step()
        print(f"device {engine.runner.device}, model {engine.model_name}, batch {args.batch}, "
              f"{args.pairs} pairs of {args.steps}-step blocks, sampling every "
              f"{default_every} steps per lane and phase, budget "
              f"{config.kernel_sample_budget:.1%} of wall time")
        overhead_before, samples_before = sampler.overhead_seconds, sampler.num_samples
        pairs = []
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            figures = {on: run(on) for on in order}
            pairs.append((figures[True], figures[False]))

        def ratio(chunk) -> float:
            on = sum(p[0][0] for p in chunk) / sum(p[0][1] for p in chunk)
            off = sum(p[1][0] for p in chunk) / sum(p[1][1] for p in chunk)
            return on / off

        tenth = max(1, len(pairs) // 10)
        parts = [ratio(pairs[i:i + tenth]) for i in range(0, len(pairs), tenth)]
        on_seconds = sum(p[0][1] for p in pairs)
        on_rate = sum(p[0][0] for p in pairs) / on_seconds
        off_rate = sum(p[1][0] for p in pairs) / sum(p[1][1] for p in pairs)
        print(f"on {on_rate:.1f} tok/s, off {off_rate:.1f} tok/s: on/off {on_rate / off_rate:.4f}"
              f" -> cost {1 - on_rate / off_rate:+.2%}")
        print("on/off per tenth of the pairs: " + " ".join(f"{r:.4f}" for r in parts) +
              f" (median {statistics.median(parts):.4f})")
        charged = sampler.overhead_seconds - overhead_before
        n_samples = sampler.num_samples - samples_before
        print(f"{n_samples} samples in {args.pairs * args.steps} 'on' steps "
              f"({on_seconds:.1f} s); the sampler charged itself "
              f"{charged / max(n_samples, 1) * 1e3:.1f} ms a sample, {charged:.3f} s in all: "
              f"{charged / on_seconds:.2%} of the 'on' time")
        if sampler.last_profile is not None:
            from ac_observe.engine.kernel_sampler import attribute
            found = attribute(sampler.last_profile.kineto_results.events(),
                              sampler.device_kernels)
            for (lane, phase), classes in found.items():
                total = sum(classes.values())
                shares = ", ".join(f"{cls} {ns / total:.1%}" for cls, ns in
                                   sorted(classes.items(), key=lambda kv: -kv[1]))
                print(f"last sample, {lane} {phase}: {total / 1e6:.2f} ms: {shares}")


if __name__ == "__main__":
    main()
