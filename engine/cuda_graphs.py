"""Decode steps captured as CUDA graphs, as nano-vllm and vLLM do.

A decode step of the model is ~15 kernel launches per layer; launched one by one from
Python, the GPU idles between them and a step's device span is mostly host gaps. Each lane
captures its decode forward once per bucket of (batch size, context blocks) at start-up
and replays it: one launch per step, and the step's span is nearly its kernel time.

A bucket's graph reads its inputs from one static buffer per lane: at offset 0 the token
ids, then positions, cache slots, and the block tables, each at the bucket's padded
shape. A step fills that buffer with one copy from pinned host memory on the lane's stream
(the step's one host-to-device copy), replays, and reads the first B rows of the static
hidden-state buffer. Padding rows (a batch of 5 runs in the 8 bucket) read token 0 at
position 0 and write their keys and values into a trash block the block manager never
hands out, so they can never touch a sequence's cache; padding columns of a block table
point at the trash block and are masked out by position. Both lanes' padding rows may write
the trash block at once: only padding rows ever read it, and their outputs are dropped.

A step sampled by the kernel sampler (engine/kernel_sampler.py) runs eagerly: a replayed
graph's kernels have no op around them to say which part of the model they belong to.

Buckets: batch sizes 1, 2, 4, 8 and every multiple of 16 up to the lane's batch limit
(nano-vllm's), context blocks every power of two up to the graphs' context limit
(`cuda_graph_max_len`, vLLM's max_seq_len_to_capture): a step whose batch or longest
context lies beyond the buckets runs eagerly. The price of a bucket: decode attention
gathers and reads the bucket's context, up to twice the batch's longest (masked beyond
each sequence), where an eager step reads the longest. At 8192 tokens the default lanes
(4 and 64 sequences) capture 110 graphs. A lane's graphs share one memory pool, captured
largest first so the smaller ones reuse its blocks; lanes have their own pools and
buffers, because their steps may be in flight together.

Off the GPU (`cuda_graphs="on"` on CPU) the same padded static-buffer steps run eagerly
instead of replaying, after one warm-up run per bucket at start-up: every part but the
capture itself, which is what the CPU tests check; the GPU check compares captured and
eager steps token for token.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ac_observe.engine.model import AttentionMetadata, decode_mask, host_long


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to and including the lane's limit."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16))
    return sizes + [max_seqs]


def graph_block_counts(max_blocks: int) -> list[int]:
    """Every power of two below the limit, then the limit."""
    counts, n = [], 1
    while n < max_blocks:
        counts.append(n)
        n *= 2
    return counts + [max_blocks]


def _bucket(sizes: list[int], n: int) -> int | None:
    return next((size for size in sizes if size >= n), None)


class DecodeGraphs:
    """One lane's captured decode steps and their static buffers."""

    def __init__(self, model, max_seqs: int, max_blocks: int, block_size: int,
                 trash_block: int, num_positions: int, device: torch.device):
        self.model = model
        self.batch_sizes = graph_batch_sizes(max_seqs)
        self.block_counts = graph_block_counts(max_blocks)
        self.block_size, self.trash_block = block_size, trash_block
        self.num_positions, self.device = num_positions, device
        B, M = max_seqs, max_blocks
        self.inputs = torch.zeros(3 * B + B * M, dtype=torch.long, device=device)
        self.hidden = torch.zeros(B, model.config.hidden_size,
                                  dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[tuple[int, int], object] = {}
        self.pool = None
        self.replays = 0  # decode steps run through a bucket (the GPU check reads it)

    @property
    def captured(self) -> bool:
        """Whether the buckets are CUDA graphs (on CPU they run eagerly)."""
        return bool(self.graphs)

    def key_for(self, batch_size: int, blocks: int) -> tuple[int, int] | None:
        """The bucket a step of `batch_size` sequences, the longest holding `blocks`
        blocks, replays in; None when it lies beyond them (the step runs eagerly)."""
        bs, M = _bucket(self.batch_sizes, batch_size), _bucket(self.block_counts, blocks)
        return None if bs is None or M is None else (bs, M)

    def _forward(self, key: tuple[int, int]) -> None:
        """The captured work: the model over the bucket's views of the static buffers."""
        bs, M = key
        ids, positions, slots = (self.inputs[i * bs:(i + 1) * bs] for i in range(3))
        tables = self.inputs[3 * bs:3 * bs + bs * M].view(bs, M)
        meta = AttentionMetadata(write_slots=slots, block_tables=tables,
                                 attn_mask=decode_mask(positions, M * self.block_size,
                                                       self.hidden.dtype))
        self.hidden[:bs].copy_(self.model(ids, positions, self.num_positions, meta))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the pool's blocks),
        each after a warm-up run over an all-padding fill at its own layout (lazy library
        state is set up outside the capture, and nothing but the trash block is written).
        On CPU only the warm-ups run, one per bucket (every layout checked); `replay` then
        runs `_forward` eagerly."""
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
        for M in reversed(self.block_counts):
            for bs in reversed(self.batch_sizes):
                with torch.cuda.stream(side) if cuda else nullcontext():
                    self.load((bs, M), [])
                    self._forward((bs, M))
                if not cuda:
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=side,
                                      capture_error_mode="thread_local"):
                    self._forward((bs, M))
                self.pool = self.pool or graph.pool()
                self.graphs[bs, M] = graph
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-ups' blocks: the graphs hold their own pool

    def load(self, key: tuple[int, int], seqs) -> None:
        """Fill the static buffer for this step (no `seqs`: all padding): one copy, on the
        current (lane's) stream."""
        bs, M = key
        block_size, trash = self.block_size, self.trash_block
        pad = bs - len(seqs)
        positions = [len(seq) - 1 for seq in seqs]
        flat = [seq.token_ids[-1] for seq in seqs] + [0] * pad
        flat += positions + [0] * pad
        flat += [seq.block_table[p // block_size] * block_size + p % block_size
                 for seq, p in zip(seqs, positions, strict=False)] + [trash * block_size] * pad
        for seq in seqs:
            flat += seq.block_table + [trash] * (M - len(seq.block_table))
        flat += [trash] * (M * pad)
        self.inputs[:len(flat)].copy_(host_long(flat, pinned=self.device.type == "cuda"),
                                      non_blocking=True)

    def replay(self, key: tuple[int, int], batch_size: int) -> torch.Tensor:
        """Run the bucket's graph on the current stream -> hidden states [batch_size, D]
        (a view of the static buffer: valid until this lane's next step)."""
        self.replays += 1
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._forward(key)
        return self.hidden[:batch_size]
