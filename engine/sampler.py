"""Greedy and temperature / top-k / top-p sampling for one batch of logits.

NOTE: never raises on legal parameters: a temperature too small to divide by is greedy,
top-p always keeps the most likely token, and a distribution that is not finite falls
back to the greedy choice, so one request's settings cannot fail its batch.
"""
from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, seqs) -> torch.Tensor:
    # logits: [B, V] float32 -> token ids [B]
    token_ids = logits.argmax(dim=-1)
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.temperature < MIN_TEMPERATURE:
            continue
        row_logits = logits[row] / params.temperature
        if params.top_k:
            kth = torch.topk(row_logits, min(params.top_k, row_logits.numel())).values[-1]
            row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
        probs = torch.softmax(row_logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p, and always the first token.
            drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
            drop[0] = False
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        total = probs.sum()
        if not torch.isfinite(total) or total <= 0:
            continue
        if seq.generator is None and params.seed is not None:
            seq.generator = torch.Generator(device=logits.device).manual_seed(params.seed)
        token_ids[row] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    return token_ids
