"""Runs one scheduled batch on the device: inputs, forward, sampling, and its device time.

On CUDA a step is launched on its lane's stream (inputs in one pinned non-blocking copy,
then the model, sampling and the ids' copy back) and finished by waiting on its own end
event: the one wait of a step, so two lanes' steps can be in flight together. Its device
time is the span between two `torch.cuda.Event`s around the device work, recorded after
the inputs were queued. A decode step replays its lane's CUDA graph for its bucket
(engine/cuda_graphs.py), one launch, so that span is nearly the step's kernel time. On CPU
the host clock brackets the same work.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.cuda_graphs import DecodeGraphs
from ac_observe.engine.kernel_sampler import SCOPE_SAMPLING, sampling, scoped, step_scope
from ac_observe.engine.loader import build_model, resolve_dtype
from ac_observe.engine.model import AttentionMetadata, PrefillSequence, decode_mask, long_tensor
from ac_observe.engine.sampler import sample
from ac_observe.engine.scheduler import ScheduledBatch
from ac_observe.engine.workspace import DecodeWorkspace
from ac_observe.metrics import LOW_LATENCY, PHASE_DECODE, PHASE_PREFILL

CPU_KV_POOL_BYTES = 256 << 20
log = logging.getLogger("ac_observe.engine.model_runner")


def activation_bytes(mc, num_tokens: int, element: int) -> int:
    """A generous bound on one step's activations at `num_tokens` tokens: the residual
    stream, q/k/v, the MLP's gate/up and their outputs alive together, twice over."""
    per_token = 4 * mc.hidden_size + 3 * mc.intermediate_size + \
        (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    return 2 * num_tokens * per_token * element


def decode_step_bytes(mc, batch: int, context: int, element: int) -> int:
    """A bound on a decode step's transient memory at `batch` sequences of `context`
    positions: the gathered keys and values, the additive mask, and where attention runs
    SDPA's math kernel its float32 copies (the keys, their scaled copy, the values) and its
    float32 scores and softmax; and the activations."""
    H, G, E = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per_position = (2 * G * E + 1) * element + (3 * G * E + 2 * H) * 4
    return batch * context * per_position + activation_bytes(mc, batch, element)


FREE_MARGIN_BYTES = 256 << 20


def kv_pool_bytes_from_free(total: int, free: int, utilization: float, ours: int,
                            activations: int) -> int:
    """The KV pool a GPU affords, vLLM's way: this engine may hold `utilization` of the
    device's memory (a per-instance share: two engines at 0.45 share a GPU); what it holds
    already (the weights) and a step's activations come off that. It never takes more
    than is free now, less a margin, whatever other processes hold."""
    budget = min(int(total * utilization) - ours, free - FREE_MARGIN_BYTES) - activations
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total >> 20} MiB is "
            f"{int(total * utilization) >> 20} MiB, this engine holds {ours >> 20} MiB, "
            f"{free >> 20} MiB are free and a step needs ~{activations >> 20} MiB; raise "
            "--gpu-memory-utilization, free the GPU, or set --kv-memory-mb")
    return budget


def gpu_kv_pool_bytes(config: EngineConfig, mc, element: int, use_graphs: bool, total: int,
                      free: int, reserved: int) -> int:
    """The KV pool of an engine on a GPU with `total` bytes, `free` of them free, holding
    `reserved` (its weights): its share less a prefill step's activations and, with CUDA
    graphs, each lane's graph pool (a decode step at the lane's batch and the graphs'
    longest context); never more than every lane's batch at full context could hold."""
    max_len = config.max_model_len or mc.max_position_embeddings
    transient = activation_bytes(mc, config.max_num_batched_tokens, element)
    if use_graphs:
        graph_len = min(max_len, config.cuda_graph_max_len)
        transient += sum(decode_step_bytes(mc, lane.max_num_seqs, graph_len, element)
                         for lane in config.lanes)
    budget = kv_pool_bytes_from_free(total, free, config.gpu_memory_utilization, reserved,
                                     transient)
    useful_tokens = sum(lane.max_num_seqs for lane in config.lanes) * max_len
    slot = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * element
    return min(budget, useful_tokens * slot)


@dataclass(slots=True)
class PendingStep:
    """A launched step, until `finish` reads it."""
    batch: ScheduledBatch
    workspace: object
    host_start_ns: int
    host_end_ns: int = 0
    token_ids: torch.Tensor | None = None
    failed_rows: list[int] = field(default_factory=list)
    start_event: object = None
    end_event: object = None


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
        max_len = config.max_model_len or mc.max_position_embeddings
        # CPU decode keeps each lane's batch KV contiguous (see engine/workspace.py) by
        # default; on a GPU decode replays CUDA graphs (engine/cuda_graphs.py) over the
        # paged cache, whose gather is cheap next to the GPU's memory bandwidth.
        cuda = self.device.type == "cuda"
        use_workspace = config.decode_workspace == "on" or (
            config.decode_workspace == "auto" and not cuda and config.cuda_graphs != "on")
        use_graphs = config.cuda_graphs == "on" or (
            config.cuda_graphs == "auto" and cuda and not use_workspace)
        graph_len = min(max_len, config.cuda_graph_max_len)
        element = torch.empty(0, dtype=self.dtype).element_size()
        slot_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * element
        self.num_blocks = config.num_kv_blocks or max(
            1, self._kv_pool_bytes(config, element, use_graphs) //
            (slot_bytes * config.block_size))
        # One pre-allocated pool for every layer: [layers, K/V, kv heads, blocks, block size,
        # head dim]. With graphs one more block than the block manager knows: the trash
        # block, where a graph's padding rows write.
        self.kv_pool = torch.zeros(mc.num_hidden_layers, 2, mc.num_key_value_heads,
                                   self.num_blocks + use_graphs, self.block_size, mc.head_dim,
                                   dtype=self.dtype, device=self.device)
        self.packed_weights = False
        if config.cpu_packed_weights == "on" and cuda:
            raise RuntimeError("cpu_packed_weights on: packed weights are for a CPU engine")
        if config.cpu_packed_weights != "off" and not cuda:
            self.packed_weights = self.model.pack_weights()
            if config.cpu_packed_weights == "on" and not self.packed_weights:
                raise RuntimeError(
                    "cpu_packed_weights on: packed weights need float32 and a torch whose "
                    f"oneDNN runs them (dtype {self.dtype}; the probe at load failed or "
                    "oneDNN is missing)")
            if self.packed_weights:
                log.info("projections on oneDNN with packed weights: %d MiB more",
                         self.model.packed_bytes() >> 20)
        self.model.bind_kv_cache(self.kv_pool)
        self.model.precompute_rotations(max_len, self.dtype, self.device)
        self.graphs = {lane.name: DecodeGraphs(
            self.model, lane.max_num_seqs, -(-graph_len // self.block_size), self.block_size,
            self.num_blocks, max_len, self.device) for lane in config.lanes} if use_graphs else {}
        if cuda:
            # Weights, pool and tables were made on the default stream; the lanes' streams
            # (and the graphs' capture stream) do not wait on it by themselves.
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        for graphs in self.graphs.values():
            graphs.capture()
        if cuda and self.graphs:
            log.info("captured %d decode CUDA graphs in %.1f s",
                     sum(len(g.graphs) for g in self.graphs.values()),
                     time.perf_counter() - started)
        # low_latency's stream gets the higher priority: when both lanes' kernels wait, the
        # GPU's scheduler picks its blocks first.
        self.streams = ({lane.name: torch.cuda.Stream(
            self.device, priority=-1 if lane.name == LOW_LATENCY else 0)
            for lane in config.lanes} if cuda else {})
        self.timed = config.instrumentation  # device step timers (CUDA events)
        budget = self.kv_pool.numel() * self.kv_pool.element_size() // 2
        self.workspaces = ({lane.name: DecodeWorkspace(budget) for lane in config.lanes}
                           if use_workspace else {})

    def _kv_pool_bytes(self, config: EngineConfig, element: int, use_graphs: bool) -> int:
        if config.kv_cache_memory_bytes:
            return config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_KV_POOL_BYTES
        torch.cuda.empty_cache()  # what loading left cached is not in use
        free, total = torch.cuda.mem_get_info(self.device)
        return gpu_kv_pool_bytes(config, self.model.config, element, use_graphs, total, free,
                                 torch.cuda.memory_reserved(self.device))

    def prepare_prefill(self, seqs) -> tuple:
        """Inputs of a prefill step: every sequence's new tokens packed one after another.

        Returns (input_ids [T], positions [T], num_positions, metadata, rows of each
        sequence's last token [B])."""
        bs, dev = self.block_size, self.device
        input_ids, positions, write_slots, last_rows, prefill = [], [], [], [], []
        cached = []  # (PrefillSequence, its block ids): they ride in the same copy
        for seq in seqs:
            start, table = seq.num_computed_tokens, seq.block_table
            n = len(seq) - start
            row = len(input_ids)
            input_ids += seq.token_ids[start:]
            positions += range(start, start + n)
            write_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            last_rows.append(row + n - 1)
            if start:  # a cached prefix: its blocks, and who sees whom (bottom-right causal)
                mask = torch.arange(start + n, device=dev)[None, :] <= \
                    torch.arange(start, start + n, device=dev)[:, None]
                prefill.append(PrefillSequence(row, n, start, None, mask))
                cached.append((prefill[-1], table[:(start + n + bs - 1) // bs]))
            elif prefill and prefill[-1].num_cached == 0 and prefill[-1].num_new == n:
                prefill[-1].num_seqs += 1  # same length, nothing cached: one batch
            else:
                prefill.append(PrefillSequence(row, n, 0, None, None))
        T = len(input_ids)
        flat = input_ids + positions + write_slots + last_rows
        for _, block_ids in cached:
            flat += block_ids
        columns = long_tensor(flat, dev)  # the step's one host-to-device copy
        at = 3 * T + len(seqs)
        for entry, block_ids in cached:
            entry.block_ids, at = columns[at:at + len(block_ids)], at + len(block_ids)
        meta = AttentionMetadata(write_slots=columns[2 * T:3 * T], prefill=prefill)
        return (columns[:T], columns[T:2 * T], max(len(s) for s in seqs), meta,
                columns[3 * T:3 * T + len(seqs)])

    def prepare_decode(self, lane: str, seqs) -> tuple:
        """Inputs of a decode step: one token per sequence, over the lane's workspace when
        it has one and the batch fits, else over padded block tables.

        Returns (input_ids [B], positions [B], num_positions, metadata, None)."""
        bs, dev, B = self.block_size, self.device, len(seqs)
        positions = [len(s) - 1 for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs
                 for s, p in zip(seqs, positions, strict=False)]
        ids = [s.token_ids[-1] for s in seqs]
        workspace = self.workspaces.get(lane)
        if workspace is not None and workspace.prepare(seqs, self.kv_pool):
            columns = long_tensor(ids + positions + slots + workspace.append_index(),
                                  dev).view(4, B)
            meta = AttentionMetadata(write_slots=columns[2],
                                     attn_mask=workspace.attend(columns[3]),
                                     workspace=workspace, workspace_index=columns[3])
            return columns[0], columns[1], max(positions) + 1, meta, None
        M = max(len(s.block_table) for s in seqs)
        tables = [b for s in seqs for b in s.block_table + [0] * (M - len(s.block_table))]
        columns = long_tensor(ids + positions + slots + tables, dev)  # one copy
        tables = columns[3 * B:].view(B, M)
        columns = columns[:3 * B].view(3, B)
        meta = AttentionMetadata(write_slots=columns[2], block_tables=tables,
                                 attn_mask=decode_mask(columns[1], M * bs, self.dtype))
        return columns[0], columns[1], max(positions) + 1, meta, None

    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], float]:
        """The next token of every sequence (None where its sampling failed) and the
        step's device time in seconds."""
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingStep:
        """Issue a step: on CUDA everything is enqueued on the lane's stream and this
        returns at once; on CPU the step has run when it returns."""
        stream = self.streams.get(batch.lane)
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                graphs, key = self.graphs.get(batch.lane), None
                if graphs is not None and not batch.is_prefill and not sampling():
                    key = graphs.key_for(len(batch.seqs),
                                         max(len(seq.block_table) for seq in batch.seqs))
                if key is not None:
                    graphs.load(key, batch.seqs)
                    workspace = None
                else:
                    input_ids, positions, num_positions, meta, last_rows = (
                        self.prepare_prefill(batch.seqs) if batch.is_prefill
                        else self.prepare_decode(batch.lane, batch.seqs))
                    workspace = meta.workspace
                # The timed window holds device work only: inputs are already queued.
                step = PendingStep(batch, workspace, time.perf_counter_ns())
                if stream is not None and self.timed:
                    step.start_event, step.end_event = (torch.cuda.Event(enable_timing=True),
                                                        torch.cuda.Event(enable_timing=True))
                    step.start_event.record(stream)
                elif stream is not None:  # not timed: an end event to wait on, no timer
                    step.end_event = torch.cuda.Event()
                with step_scope(batch.lane, PHASE_PREFILL if batch.is_prefill else PHASE_DECODE):
                    if key is not None:
                        hidden = graphs.replay(key, len(batch.seqs))
                    else:
                        hidden = self.model(input_ids, positions, num_positions, meta)
                        if last_rows is not None:
                            hidden = hidden.index_select(0, last_rows)
                    logits = self.model.compute_logits(hidden).float()
                    step.token_ids, step.failed_rows = scoped(
                        SCOPE_SAMPLING, sample, logits, batch.seqs,
                        self.model.config.eos_token_ids)
                    if stream is not None:
                        step.token_ids = step.token_ids.to("cpu", non_blocking=True)
                if stream is not None:
                    step.end_event.record(stream)
                else:
                    step.host_end_ns = time.perf_counter_ns()
        except BaseException:
            self._discard(batch.lane)
            raise
        return step

    def finish(self, step: PendingStep) -> tuple[list[int | None], float]:
        """Wait for a launched step (on CUDA: its own end event, the one wait of a step)
        and read its tokens and device time."""
        try:
            if step.end_event is not None:
                step.end_event.synchronize()
                seconds = (step.start_event.elapsed_time(step.end_event) / 1e3
                           if step.start_event is not None else 0.0)
            else:
                seconds = (step.host_end_ns - step.host_start_ns) / 1e9
            next_tokens = step.token_ids.tolist()
        except BaseException:
            self._discard(step.batch.lane)
            raise
        if step.workspace is not None:
            step.workspace.advance()
        for row in step.failed_rows:
            next_tokens[row] = None  # that request's sampling failed: it fails alone
        return next_tokens, seconds

    def _discard(self, lane: str) -> None:
        """After a failed step: nothing of it may still run when its blocks are reused."""
        stream = self.streams.get(lane)
        if stream is not None:
            try:
                stream.synchronize()
            except RuntimeError:
                pass  # the device itself failed: the error is already being reported
        if lane in self.workspaces:
            self.workspaces[lane].clear()  # it may hold half a step

    @torch.inference_mode()
    def prompt_logits(self, seq) -> torch.Tensor:
        """Logits at every position of a sequence holding blocks and no computed KV."""
        input_ids, positions, num_positions, meta, _ = self.prepare_prefill([seq])
        return self.model.compute_logits(self.model(input_ids, positions, num_positions, meta))
