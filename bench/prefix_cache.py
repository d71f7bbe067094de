"""Does prefix caching pay? Time to first token of a request behind a 1,024-token system
prompt: cold (a system prompt the cache has never seen) against warm (the shared one,
already cached), in one engine, alternating cold and warm requests.

TTFT is the engine's own (arrival to the first token, `trace.ttft_ns`), one new token per
request, one request at a time. The cached-token count of each warm request is checked
(every full block of the system prompt hit), so the figure is the cache's, not luck.

Usage: python bench/prefix_cache.py [--rounds 15] [--system-tokens 1024] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams


def _system(tokens: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(tokens)]


def measure(rounds: int, system_tokens: int, device: str) -> dict:
    with Engine(EngineConfig(device=device, seed=0)) as engine:
        vocab = engine.runner.model.config.vocab_size
        block = engine.block_manager.block_size
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        shared = _system(system_tokens, 0, vocab)

        def ttft(system: list[int], question: int) -> tuple[float, int]:
            prompt = system + _system(16, 10_000 + question, vocab)
            out = engine.add_request(prompt=prompt, params=params).result()
            return out.trace.ttft_ns / 1e9, out.num_cached_tokens

        ttft(shared, 0)  # warms the cache with the shared prompt (and the engine up)
        ttft(_system(system_tokens, 1, vocab), 1)
        cold, warm = [], []
        for r in range(rounds):
            order = ("cold", "warm") if r % 2 == 0 else ("warm", "cold")
            for kind in order:
                if kind == "cold":
                    seconds, cached = ttft(_system(system_tokens, 100 + r, vocab), 2 * r + 2)
                    assert cached == 0, cached
                    cold.append(seconds)
                else:
                    seconds, cached = ttft(shared, 2 * r + 3)
                    assert cached >= system_tokens // block * block, cached
                    warm.append(seconds)
    ratios = sorted(c / w for c, w in zip(cold, warm, strict=False))
    return {"rounds": rounds, "system_tokens": system_tokens,
            "cold_ttft_ms": statistics.median(cold) * 1e3,
            "warm_ttft_ms": statistics.median(warm) * 1e3,
            "speedup": statistics.median(cold) / statistics.median(warm),
            "speedup_min": ratios[0], "speedup_max": ratios[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    args = parser.parse_args()
    r = measure(args.rounds, args.system_tokens, args.device)
    print(f"prefix caching, {r['system_tokens']}-token system prompt, {r['rounds']} rounds: "
          f"TTFT cold {r['cold_ttft_ms']:.1f} ms, warm {r['warm_ttft_ms']:.1f} ms, "
          f"{r['speedup']:.2f}x faster warm (pairs {r['speedup_min']:.2f}x .. "
          f"{r['speedup_max']:.2f}x)")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
