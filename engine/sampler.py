"""Greedy and temperature / top-k / top-p sampling for a whole batch in one pass.

Per-row settings become tensors; the batch is sorted once, masked by top-k and top-p, and
sampled with the exponential race (argmax of p / q, q ~ Exp(1)), as vLLM does: no host
sync and no per-row kernels except one exponential draw per seeded row, from that
request's own generator, so a seeded request samples the same tokens in any batch.

NOTE: never raises on legal settings and never lets one row fail the batch: a
temperature too small to divide by is greedy, top-p always keeps the most likely token, a
row whose distribution is not finite falls back to its greedy choice, and a row whose own
generator fails is reported in `failed` (its request fails alone).
"""
from __future__ import annotations

import logging

import torch

MIN_TEMPERATURE = 1e-5
log = logging.getLogger("ac_observe.engine.sampler")


def _column(values, device, dtype) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # pinned and non-blocking: no host sync on the step's path
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _ban_early_stops(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """Rows short of their min_tokens cannot pick a token that would end them (EOS unless
    ignored, and their stop_token_ids), as vLLM's min_tokens does."""
    rows, cols = [], []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                   else set(eos_token_ids))
            banned = [t for t in banned if 0 <= t < logits.shape[-1]]
            rows += [row] * len(banned)
            cols += banned
    if not rows:
        return logits
    index = (_column(rows, logits.device, torch.long), _column(cols, logits.device, torch.long))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def sample(logits: torch.Tensor, seqs, eos_token_ids=()) -> tuple[torch.Tensor, list[int]]:
    """logits: [B, V] float32 -> (token ids [B], rows whose sampling failed)."""
    logits = _ban_early_stops(logits, seqs, eos_token_ids)
    greedy = logits.argmax(dim=-1)
    rows = [i for i, seq in enumerate(seqs) if seq.params.temperature >= MIN_TEMPERATURE]
    if not rows:
        return greedy, []
    device, V = logits.device, logits.shape[-1]
    params = [seqs[i].params for i in rows]
    temperature = _column([p.temperature for p in params], device, torch.float32)
    top_k = _column([p.top_k or V for p in params], device, torch.long).clamp_(1, V)
    top_p = _column([p.top_p for p in params], device, torch.float32)

    index = _column(rows, device, torch.long)
    scaled = logits.index_select(0, index) / temperature[:, None]     # [R, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=device)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p, and always the first token.
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs.masked_fill_(drop, 0.0)

    race = torch.empty_like(sorted_probs).exponential_()  # seeded rows drawn again below
    failed = []
    for r, i in enumerate(rows):
        seq = seqs[i]
        if seq.params.seed is None:
            continue
        try:
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
            race[r].exponential_(generator=seq.generator)
        except Exception as exc:  # this request's generator: it fails, the batch goes on
            log.warning("sampling failed for request %s: %s", seq.request_id, exc)
            failed.append(i)
            race[r].fill_(1.0)
    choice = (sorted_probs / race).argmax(dim=-1)
    sampled = order.gather(1, choice[:, None])[:, 0]
    total = sorted_probs.sum(dim=-1)
    valid = torch.isfinite(total) & (total > 0)
    greedy.index_copy_(0, index, torch.where(valid, sampled, greedy.index_select(0, index)))
    return greedy, failed
