"""How the engine runs its projections on a CPU: the GEMM forms, timed.

For each projection shape of a model (the tiny preset by default) and token counts T
from decode batches to prefill chunks, times `h @ W^T` (torch.nn.functional.linear, on
MKL), `W @ h^T` (the weight as the left operand, what engine.model does without packed
weights) and oneDNN on weights packed once (`torch.ops.mkldnn._linear_pointwise`, what
engine.model does with them, the default for CPU float32), in one run, alternating,
median of --rounds. Cold: the weights of every layer are cycled, as in a forward pass,
so they come from memory rather than the core's own cache.
Usage: python bench/gemm_orientation.py [--tokens 1,16,64,1024] [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ac_observe.engine.config import ModelConfig
from ac_observe.engine.model import packed_weight


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _forms(h: torch.Tensor, layer_weights: list, layer_packed: list) -> dict:
    """The three GEMM forms over every layer's weight, each a call to time."""
    return {"h @ W^T": lambda: [F.linear(h, w) for w in layer_weights],
            "W @ h^T": lambda: [torch.mm(w, h.t()) for w in layer_weights],
            "packed": lambda: [torch.ops.mkldnn._linear_pointwise(
                h, p, None, "none", [], "") for p in layer_packed]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,16,64,1024")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cfg = ModelConfig.tiny()
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, cfg.hidden_size), "o": (cfg.hidden_size, cfg.hidden_size),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.intermediate_size)}
    layers = cfg.num_hidden_layers
    weights = {name: [torch.randn(shape) for _ in range(layers)] for name, shape in shapes.items()}
    packed = {name: [packed_weight(w) for w in ws] for name, ws in weights.items()}
    if any(p is None for ps in packed.values() for p in ps):
        raise SystemExit("this torch has no oneDNN linear: nothing to compare packed")
    print(f"threads={torch.get_num_threads()} model=tiny layers={layers}; microseconds per "
          f"GEMM (median of {args.rounds}), cold = cycling all layers' weights")
    print(f"{'T':>5} {'proj':>8} {'h @ W^T':>9} {'W @ h^T':>9} {'packed':>9} "
          f"{'best MKL / packed':>18}")
    for T in (int(t) for t in args.tokens.split(",")):
        repeats = max(1, 256 // T)
        for name, (_, k) in shapes.items():
            forms = _forms(torch.randn(T, k), weights[name], packed[name])
            results: dict[str, list[float]] = {form: [] for form in forms}
            for _ in range(args.rounds):
                for form, fn in forms.items():
                    results[form].append(_time(fn, repeats) / layers * 1e6)
            a, b, c = (statistics.median(results[form]) for form in forms)
            print(f"{T:>5} {name:>8} {a:>9.1f} {b:>9.1f} {c:>9.1f} {min(a, b) / c:>18.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
