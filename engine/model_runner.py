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
from ac_observe.engine.model import AttentionMetadata, long_tensor, padded_block_tables
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

    def _prepare(self, batch: ScheduledBatch):
        """Inputs of a step: token ids, positions and attention metadata, and the rows of
        the last token of each sequence (None when every row is one)."""
        seqs, bs, dev = batch.seqs, self.block_size, self.device
        workspace = None
        if not batch.is_prefill and all(len(s) - s.num_computed_tokens == 1 for s in seqs):
            workspace = self.workspaces.get(batch.lane)
            if workspace is not None and not workspace.prepare(seqs, self.kv_pool):
                workspace = None
        if workspace is not None:  # decode over the workspace: one row per sequence
            positions = [len(s) - 1 for s in seqs]
            columns = long_tensor(
                [s.token_ids[-1] for s in seqs] + positions
                + [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
                + workspace.append_index(), dev).view(4, len(seqs))
            meta = AttentionMetadata(
                batch_shape=(len(seqs), 1), write_index=None, write_slots=columns[2],
                block_tables=None, attn_mask=workspace.attend(columns[3]),
                workspace=workspace, workspace_index=columns[3])
            return columns[0], columns[1], max(positions) + 1, meta, None
        new_lens = [len(s) - s.num_computed_tokens for s in seqs]
        N = max(new_lens)
        input_ids, positions, write_index, write_slots = [], [], [], []
        for row, (seq, n) in enumerate(zip(seqs, new_lens)):
            start, table = seq.num_computed_tokens, seq.block_table
            input_ids += seq.token_ids[start:] + [0] * (N - n)
            positions += range(start, start + n)
            positions += [0] * (N - n)
            write_index += range(row * N, row * N + n)
            write_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        as_tensor = lambda values: long_tensor(values, dev)
        positions_t = as_tensor(positions)
        ctx_t = as_tensor([len(s) for s in seqs])
        tables = padded_block_tables(seqs, dev)
        key_pos = torch.arange(tables.shape[1] * bs, device=dev)
        # A query at position p sees keys 0..p of its own sequence; padded queries see key 0.
        query_pos = positions_t.view(len(seqs), N)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & \
               (key_pos[None, None, :] < ctx_t[:, None, None])
        meta = AttentionMetadata(
            batch_shape=(len(seqs), N),
            write_index=None if N == 1 else as_tensor(write_index),
            write_slots=as_tensor(write_slots), block_tables=tables,
            attn_mask=torch.zeros(mask.shape, dtype=self.dtype, device=dev)
            .masked_fill_(~mask, float("-inf"))[:, None, :, :])
        last_rows = None if N == 1 else as_tensor([row * N + n - 1
                                                   for row, n in enumerate(new_lens)])
        return as_tensor(input_ids), positions_t, max(len(s) for s in seqs), meta, last_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], float]:
        """Returns the next token of every sequence and the step's device time in seconds."""
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
                input_ids, positions, num_positions, meta, last_rows = self._prepare(batch)
                hidden = self.model(input_ids, positions, num_positions, meta)
                if last_rows is not None:
                    hidden = hidden.index_select(0, last_rows)
                logits = self.model.compute_logits(hidden).float()
                token_ids = sample(logits, batch.seqs)
                if stream is not None:
                    end_evt.record(stream)
            next_tokens = token_ids.tolist()  # the step's synchronisation point
        except BaseException:
            if batch.lane in self.workspaces:
                self.workspaces[batch.lane].clear()  # it may hold half a step
            raise
        if meta.workspace is not None:
            meta.workspace.advance()
        if stream is not None:
            return next_tokens, start_evt.elapsed_time(end_evt) / 1e3
        return next_tokens, (time.perf_counter_ns() - host_start) / 1e9

    @torch.inference_mode()
    def prompt_logits(self, seq) -> torch.Tensor:
        """Logits at every position of a sequence holding blocks and no computed KV."""
        input_ids, positions, num_positions, meta, _ = self._prepare(
            ScheduledBatch("throughput", True, [seq]))
        return self.model.compute_logits(self.model(input_ids, positions, num_positions, meta))
