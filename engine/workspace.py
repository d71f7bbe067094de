"""A lane's decode workspace: its running batch's KV kept contiguous between steps.

Decode attention reads every context position of every sequence at every step. Gathering
those positions out of the paged pool each step copies the whole context per layer; the
workspace copies it once, when the batch's membership changes, and afterwards each step
only appends the new token's keys and values (also written to the pool, which stays the
source of truth for prefix caching and preemption). It keeps the additive attention mask
of the batch the same way: built once, then one position unmasked per sequence per step.

NOTE: valid only while the batch holds the same sequences in the same order and each
sequence's workspace covers exactly its computed tokens; anything else rebuilds it.
"""
from __future__ import annotations

import torch

from ac_observe.engine.model import gather_blocks, long_tensor, padded_block_tables

HEADROOM_TOKENS = 128  # steps a workspace absorbs before it must grow


class DecodeWorkspace:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.request_ids: tuple[str, ...] = ()
        self.lengths: list[int] = []
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [K/V, G, B, capacity, E]
        self.mask = torch.empty(0)        # [B, capacity]: 0 for held positions, -inf beyond

    def prepare(self, seqs, kv_pool: torch.Tensor) -> bool:
        """Make the workspace hold the batch's computed KV; False when it would not fit."""
        request_ids = tuple(seq.request_id for seq in seqs)
        computed = [len(seq) - 1 for seq in seqs]
        longest = max(computed) + 1
        if request_ids == self.request_ids and computed == self.lengths \
                and longest <= self.capacity:
            return True
        layers, _, G, _, bs, E = kv_pool.shape
        capacity = -(-(longest + HEADROOM_TOKENS) // HEADROOM_TOKENS) * HEADROOM_TOKENS
        needed = layers * 2 * G * len(seqs) * capacity * E * kv_pool.element_size()
        if needed > self.max_bytes:
            self.clear()
            return False
        tables = padded_block_tables(seqs, kv_pool.device)
        span = min(tables.shape[1] * bs, capacity)
        self.kv = []
        for layer in range(layers):
            buffer = torch.empty(2, G, len(seqs), capacity, E, dtype=kv_pool.dtype,
                                 device=kv_pool.device)
            buffer[..., :span, :] = gather_blocks(kv_pool[layer], tables)[..., :span, :]
            # Masked positions must still be finite: -inf + NaN would poison softmax.
            buffer[..., span:, :].zero_()
            self.kv.append(buffer)
        held = torch.arange(capacity, device=kv_pool.device)[None, :] < \
            long_tensor(computed, kv_pool.device)[:, None]
        self.mask = torch.zeros(len(seqs), capacity, dtype=kv_pool.dtype,
                                device=kv_pool.device).masked_fill_(~held, float("-inf"))
        self.request_ids, self.lengths, self.capacity = request_ids, computed, capacity
        return True

    def append_index(self) -> list[int]:
        """Flat slot (row * capacity + position) of each sequence's next token."""
        return [row * self.capacity + n for row, n in enumerate(self.lengths)]

    def attend(self, index: torch.Tensor) -> torch.Tensor:
        """Unmask the new tokens' slots; the mask for this step, [1, B, 1, L]."""
        self.mask.view(-1).index_fill_(0, index, 0.0)
        return self.mask[None, :, None, :max(self.lengths) + 1]

    def advance(self) -> None:
        """After the step: each sequence's new token is in the workspace too."""
        self.lengths = [n + 1 for n in self.lengths]

    def clear(self) -> None:
        self.__init__(self.max_bytes)
