"""Runs one scheduled batch on the device: inputs, forward, sampling, and its device time.

Device time of a step comes from a pair of `torch.cuda.Event`s recorded on the lane's
stream and read after the step's own synchronisation (the sampled token ids' copy to the
host); no extra sync is added. On CPU the host monotonic clock brackets the same work.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.loader import build_model, resolve_dtype
from ac_observe.engine.model import (AttentionMetadata, PrefillSequence, long_tensor,
                                     padded_block_tables)
from ac_observe.engine.sampler import sample
from ac_observe.engine.workspace import DecodeWorkspace
from ac_observe.engine.scheduler import ScheduledBatch


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but torch sees no CUDA device")
    return device


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = build_model(config.model, self.device, self.dtype, config.seed)
        mc = self.model.config
        self.block_size = config.block_size
        slot_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * \
            torch.empty(0, dtype=self.dtype).element_size()
        self.num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_bytes // (slot_bytes * config.block_size))
        # One pre-allocated pool for every layer: [layers, K/V, kv heads, blocks, block size, head dim].
        self.kv_pool = torch.zeros(mc.num_hidden_layers, 2, mc.num_key_value_heads,
                                   self.num_blocks, self.block_size, mc.head_dim,
                                   dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_pool)
        self.streams = ({lane.name: torch.cuda.Stream(self.device) for lane in config.lanes}
                        if self.device.type == "cuda" else {})
        # CPU decode keeps each lane's batch KV contiguous (see engine/workspace.py) by
        # default; on a GPU the gather is cheap next to its memory bandwidth, and memory
        # is precious.
        use_workspace = config.decode_workspace == "on" or (
            config.decode_workspace == "auto" and self.device.type == "cpu")
        budget = self.kv_pool.numel() * self.kv_pool.element_size() // 2
        self.workspaces = ({lane.name: DecodeWorkspace(budget) for lane in config.lanes}
                           if use_workspace else {})

    def prepare_prefill(self, seqs) -> tuple:
        """Inputs of a prefill step: every sequence's new tokens packed one after another.

        Returns (input_ids [T], positions [T], num_positions, metadata, rows of each
        sequence's last token [B])."""
        bs, dev = self.block_size, self.device
        input_ids, positions, write_slots, last_rows, prefill = [], [], [], [], []
        for seq in seqs:
            start, table = seq.num_computed_tokens, seq.block_table
            n = len(seq) - start
            row = len(input_ids)
            input_ids += seq.token_ids[start:]
            positions += range(start, start + n)
            write_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            last_rows.append(row + n - 1)
            if start:  # a cached prefix: its blocks, and who sees whom (bottom-right causal)
                block_ids = long_tensor(table[:(start + n + bs - 1) // bs], dev)
                mask = torch.arange(start + n, device=dev)[None, :] <= \
                    torch.arange(start, start + n, device=dev)[:, None]
                prefill.append(PrefillSequence(row, n, start, block_ids, mask))
            elif prefill and prefill[-1].num_cached == 0 and prefill[-1].num_new == n:
                prefill[-1].num_seqs += 1  # same length, nothing cached: one batch
            else:
                prefill.append(PrefillSequence(row, n, 0, None, None))
        columns = long_tensor(input_ids + positions + write_slots + last_rows, dev)
        T = len(input_ids)
        meta = AttentionMetadata(write_slots=columns[2 * T:3 * T], prefill=prefill)
        return columns[:T], columns[T:2 * T], max(len(s) for s in seqs), meta, columns[3 * T:]

    def prepare_decode(self, lane: str, seqs) -> tuple:
        """Inputs of a decode step: one token per sequence, over the lane's workspace when
        it has one and the batch fits, else over padded block tables.

        Returns (input_ids [B], positions [B], num_positions, metadata, None)."""
        bs, dev, B = self.block_size, self.device, len(seqs)
        positions = [len(s) - 1 for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        ids = [s.token_ids[-1] for s in seqs]
        workspace = self.workspaces.get(lane)
        if workspace is not None and workspace.prepare(seqs, self.kv_pool):
            columns = long_tensor(ids + positions + slots + workspace.append_index(),
                                  dev).view(4, B)
            meta = AttentionMetadata(write_slots=columns[2],
                                     attn_mask=workspace.attend(columns[3]),
                                     workspace=workspace, workspace_index=columns[3])
            return columns[0], columns[1], max(positions) + 1, meta, None
        tables = padded_block_tables(seqs, dev)
        columns = long_tensor(ids + positions + slots, dev).view(3, B)
        # A query sees every cached position of its own sequence; padding is masked out.
        key_pos = torch.arange(tables.shape[1] * bs, device=dev)
        masked = key_pos[None, :] > columns[1][:, None]  # [B, L]
        attn_mask = torch.zeros(masked.shape, dtype=self.dtype, device=dev) \
            .masked_fill_(masked, float("-inf"))[:, None, None, :]
        meta = AttentionMetadata(write_slots=columns[2], block_tables=tables, attn_mask=attn_mask)
        return columns[0], columns[1], max(positions) + 1, meta, None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], float]:
        """The next token of every sequence (None where its sampling failed) and the
        step's device time in seconds."""
        stream = self.streams.get(batch.lane)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            start_evt = torch.cuda.Event(enable_timing=True)
            end_evt = torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter_ns()
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if stream is not None:
                    start_evt.record(stream)
                input_ids, positions, num_positions, meta, last_rows = (
                    self.prepare_prefill(batch.seqs) if batch.is_prefill
                    else self.prepare_decode(batch.lane, batch.seqs))
                hidden = self.model(input_ids, positions, num_positions, meta)
                if last_rows is not None:
                    hidden = hidden.index_select(0, last_rows)
                logits = self.model.compute_logits(hidden).float()
                token_ids, failed_rows = sample(logits, batch.seqs)
                if stream is not None:
                    end_evt.record(stream)
            next_tokens = token_ids.tolist()  # the step's synchronisation point
        except BaseException:
            if batch.lane in self.workspaces:
                self.workspaces[batch.lane].clear()  # it may hold half a step
            raise
        if meta.workspace is not None:
            meta.workspace.advance()
        for row in failed_rows:
            next_tokens[row] = None  # that request's sampling failed: it fails alone
        if stream is not None:
            return next_tokens, start_evt.elapsed_time(end_evt) / 1e3
        return next_tokens, (time.perf_counter_ns() - host_start) / 1e9

    @torch.inference_mode()
    def prompt_logits(self, seq) -> torch.Tensor:
        """Logits at every position of a sequence holding blocks and no computed KV."""
        input_ids, positions, num_positions, meta, _ = self.prepare_prefill([seq])
        return self.model.compute_logits(self.model(input_ids, positions, num_positions, meta))
