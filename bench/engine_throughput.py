"""Tokens/s of the ac-observe engine vs `transformers` `generate` on the same weights.

Both run on the same randomly initialised checkpoint (the tiny preset's shape, written
here with `save_pretrained`), greedy, 128 new tokens, batch 1 and 16. Each measurement runs
in a fresh worker process (alternating, --rounds pairs), so neither side inherits the
other's thread pools. Prints the best of each side and their ratio, then the ratio of each
pair of neighbouring runs (sorted, median in brackets): on a noisy machine the pairs show
the spread; compare figures only within one run of this script.
Ours runs with its instrumentation on (telemetry files written, as in service) unless
--no-telemetry.
Usage: python bench/engine_throughput.py [--device cpu] [--rounds 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from ac_observe.engine.config import EngineConfig, ModelConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.checkpoints import write_hf_checkpoint  # noqa: E402  (test helper, not shipped)


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def bench_engine(folder: Path, device: str, batch: int, prompt_len: int, new_tokens: int,
                 repeats: int, telemetry: bool = True) -> float:
    with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(
            model=str(folder), device=device, dtype="float32",
            telemetry_dir=f"{tmp}/e" if telemetry else None)) as engine:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        engine.generate_batch(_prompts(batch, prompt_len, 256), params)  # warm-up
        best = float("inf")
        for r in range(repeats):
            prompts = _prompts(batch + 100 * (r + 1), prompt_len, 256)[:batch]
            start = time.perf_counter()
            outs = engine.generate_batch(prompts, params)
            best = min(best, time.perf_counter() - start)
            assert all(o.num_output_tokens == new_tokens for o in outs)
    return batch * new_tokens / best


def bench_transformers(folder: Path, device: str, batch: int, prompt_len: int,
                       new_tokens: int, repeats: int) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = model.to(device).eval()
    best = float("inf")
    for r in range(repeats + 1):
        ids = torch.tensor(_prompts(batch + 100 * r, prompt_len, 256)[:batch], device=device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
        if r:  # the first run is warm-up
            best = min(best, time.perf_counter() - start)
        assert out.shape[1] == prompt_len + new_tokens
    return batch * new_tokens / best


def _worker(kind: str, folder: str, args) -> float:
    cmd = [sys.executable, __file__, "--worker", kind, "--folder", folder, "--device",
           args.device, "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
           "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats)]
    if not args.telemetry:
        cmd.append("--no-telemetry")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-telemetry", dest="telemetry", action="store_false",
                        help="Ours without telemetry files (as before this row existed).")
    parser.add_argument("--json", action="store_true", help="End with one JSON line.")
    parser.add_argument("--worker", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "ours":
            rate = bench_engine(Path(args.folder), args.device, args.batch, args.prompt_len,
                                args.new_tokens, args.repeats, args.telemetry)
        else:
            rate = bench_transformers(Path(args.folder), args.device, args.batch,
                                      args.prompt_len, args.new_tokens, args.repeats)
        print(json.dumps({"tokens_per_second": rate}))
        return
    tiny = ModelConfig.tiny()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_hf_checkpoint(
            Path(tmp), vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_hidden_layers,
            num_attention_heads=tiny.num_attention_heads,
            num_key_value_heads=tiny.num_key_value_heads,
            max_position_embeddings=tiny.max_position_embeddings)
        print(f"device={args.device} threads={torch.get_num_threads()} "
              f"new_tokens={args.new_tokens} prompt_len={args.prompt_len} model=tiny-shape "
              f"rounds={args.rounds} telemetry={'on' if args.telemetry else 'off'}")
        print(f"{'batch':>5} {'ac-observe tok/s':>17} {'transformers tok/s':>19} {'ratio':>6} "
              f"{'paired ratios (median)':>24}")
        summary = {}
        for batch in (int(b) for b in args.batches.split(",")):
            args.batch = batch
            pairs = [(_worker("ours", str(folder), args),
                      _worker("transformers", str(folder), args))
                     for _ in range(args.rounds)]
            ours, ref = max(p[0] for p in pairs), max(p[1] for p in pairs)
            ratios = sorted(o / r for o, r in pairs)
            spread = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"{batch:>5} {ours:>17.1f} {ref:>19.1f} {ours / ref:>6.2f}   "
                  f"{spread} ({statistics.median(ratios):.2f})", flush=True)
            summary[str(batch)] = {"ours_tokens_per_s": ours, "transformers_tokens_per_s": ref,
                                   "ratio": ours / ref,
                                   "ratio_median_pairs": statistics.median(ratios),
                                   "ratio_min": ratios[0], "ratio_max": ratios[-1]}
        if args.json:
            print(json.dumps(summary))


if __name__ == "__main__":
    main()
