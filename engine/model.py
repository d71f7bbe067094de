"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Covers Llama, Qwen2 (q/k/v biases, tied embeddings) and Mistral-shaped checkpoints. Numerics
follow Hugging Face `transformers` (RoPE tables and RMSNorm in float32) so logits agree.

Shapes: B sequences in the step, T token rows (a prefill packs every sequence's new tokens,
a decode has one per sequence), L context positions per sequence (cached + new), D hidden,
H query heads, G key/value heads, E head dim.

NOTE: the loader stores the rows of each query and key head in interleaved RoPE order
(dims i and i + E/2 side by side, see `rope_row_order`), so rotating a head is one
complex multiply in place. Scores are unchanged (q and k share the order); keys in the
KV cache are in that order too.
"""
from __future__ import annotations

import array
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ac_observe.engine.config import ModelConfig
from ac_observe.engine.kernel_sampler import (
    SCOPE_ACTIVATION,
    SCOPE_ATTENTION,
    SCOPE_GEMM,
    SCOPE_NORM,
    SCOPE_ROPE,
    scope,
    scoped,
)

_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


@dataclass(slots=True)
class PrefillSequence:
    """One sequence's share of a packed prefill step, or a run of `num_seqs` adjacent
    sequences of equal length with nothing cached (attended to as one batch)."""
    row: int                            # its first row in the step's T rows
    num_new: int                        # n: new tokens per sequence
    num_cached: int                     # positions before them whose KV is in the cache
    block_ids: torch.Tensor | None      # [M] its blocks, when num_cached > 0
    mask: torch.Tensor | None           # [n, num_cached + n] bool, when num_cached > 0
    num_seqs: int = 1


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each one may attend to.

    A prefill step packs every sequence's new tokens one after another (T = their sum, no
    padding), so its memory follows the batch's total tokens; attention then runs per
    sequence. A decode step has one token per sequence (T = B).

    NOTE: every layer writes the step's new keys/values before attention reads the
    context, so a sequence always reads its own new tokens.
    """
    write_slots: torch.Tensor                  # [T] cache slot of each new token
    prefill: list[PrefillSequence] | None = None
    block_tables: torch.Tensor | None = None   # decode: [B, M] blocks (padded), L = M * bs
    attn_mask: torch.Tensor | None = None      # decode: additive [1, B, 1, L]
    workspace: object = None                   # decode only: engine.workspace.DecodeWorkspace
    workspace_index: torch.Tensor | None = None  # [B] flat workspace slot of each new token


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def rope_row_order(head_dim: int) -> torch.Tensor:
    """Hugging Face head rows (pairs i, i + E/2) -> interleaved (pair i at rows 2i, 2i+1)."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)


def rotate_(x: torch.Tensor, rotation: torch.Tensor, num_heads: int) -> None:
    """RoPE in place. x: [T, heads * E] (interleaved rows); rotation: [T, 1, E/2] complex,
    or [T, 1, E/2, 2] (cos, sin) for dtypes without complex kernels."""
    pairs = x.view(x.shape[0], num_heads, -1, 2)
    if rotation.is_complex():
        torch.view_as_complex(pairs).mul_(rotation)
        return
    # (re + i im)(cos + i sin), in x's dtype and in the order transformers rounds it.
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = rotation[..., 0], rotation[..., 1]
    rotated = torch.stack((re * cos - im * sin, im * cos + re * sin), dim=-1)
    pairs.copy_(rotated)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float64:  # float32 math as transformers does
        return F.rms_norm(x, weight.shape, weight, eps)
    # transformers normalises float64 activations in float32: mirror it exactly.
    with scope(SCOPE_NORM):
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)


PLAIN, WEIGHT_LEFT, PACKED = "plain", "weight_left", "packed"  # how a step runs its GEMMs
PACKED_MIN_TOKENS = 4


def gemm_form(x: torch.Tensor, packed: bool) -> str:
    """How the projections of a step over x: [T, D] run: PACKED (oneDNN on the weights'
    packed copies, when `packed`: the model has them), WEIGHT_LEFT (MKL as W @ h^T,
    results as transposed views) or PLAIN (h @ W^T).

    NOTE: measured, not derived (bench/gemm_orientation.py, x86 with AVX-512): packed
    weights win from about 4 tokens (1.1x the best MKL form at 4, 1.5-2.3x from 16 to a
    1,024-token prefill) and lose below (oneDNN's ~10 us a call: 0.7x for one token).
    Without them, weight-left runs 1.1-2x faster than h @ W^T from 2 tokens to a few
    hundred and 7-10% slower for one or 1,024. CPU only: on a GPU neither buys anything
    and transposed activations would slow elementwise kernels.
    """
    if x.device.type != "cpu":
        return PLAIN
    if packed and x.shape[0] >= PACKED_MIN_TOKENS:
        return PACKED
    return WEIGHT_LEFT if 2 <= x.shape[0] <= 512 else PLAIN


def row_major_form(x: torch.Tensor, proj: nn.Linear) -> str:
    """`gemm_form` for a product whose result must be row-major (q/k/v, whose rows RoPE
    and the cache writes view; the logits): packed or plain, never weight-left."""
    return PACKED if gemm_form(x, proj.packed is not None) is PACKED else PLAIN


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ([N, K], CPU float32) in oneDNN's blocked layout, for `_linear_pointwise`;
    None where this torch has no oneDNN or the packed product disagrees with F.linear.

    NOTE: measured, not derived (bench/gemm_orientation.py, x86 with AVX-512): oneDNN on
    pre-packed weights runs the projections 1.5-2.3x faster than MKL's best form from 16
    tokens to a 1,024-token prefill: MKL packs the weight on every call (and on AMD runs
    its AVX2 code). It costs a second copy of the weights. Probed at load, at the token
    counts it will run (4 and a prefill's), with the bias: a platform whose oneDNN cannot
    run the packed layout falls back to MKL here, not in a step."""
    if not torch.backends.mkldnn.is_available() or weight.dtype != torch.float32 \
            or weight.device.type != "cpu":
        return None
    weight, gen = weight.detach(), torch.Generator().manual_seed(0)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        for tokens in (PACKED_MIN_TOKENS, 300):
            probe = torch.randn(tokens, weight.shape[1], generator=gen)
            bias = torch.randn(weight.shape[0], generator=gen)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
            if not torch.allclose(got, F.linear(probe, weight, bias), rtol=1e-4, atol=1e-4):
                return None
    except (RuntimeError, AttributeError):  # a build without these ops
        return None
    return packed


def linear(h: torch.Tensor, proj: nn.Linear, form: str) -> torch.Tensor:
    """h @ weight^T (+ bias): [T, K] -> [T, N], run as `form` says (see `gemm_form`); a
    transposed view when WEIGHT_LEFT. (The sampled kernel time's `ac::gemm` scope holds
    the operand transposes with the GEMM.)"""
    return scoped(SCOPE_GEMM, _linear, h, proj, form)


def _linear(h: torch.Tensor, proj: nn.Linear, form: str) -> torch.Tensor:
    if form is PACKED:
        return torch.ops.mkldnn._linear_pointwise(h, proj.packed, proj.bias, "none", [], "")
    if form is WEIGHT_LEFT and proj.bias is None:
        return torch.mm(proj.weight, h.t()).t()
    return F.linear(h, proj.weight, proj.bias)


def linear_add(x: torch.Tensor, a: torch.Tensor, proj: nn.Linear, form: str) -> torch.Tensor:
    """x + a @ weight^T: with MKL in one GEMM (the residual is addmm's input); with a
    packed weight, the product then an in-place add (oneDNN's fused add measured slower)."""
    return scoped(SCOPE_GEMM, _linear_add, x, a, proj, form)


def _linear_add(x: torch.Tensor, a: torch.Tensor, proj: nn.Linear, form: str) -> torch.Tensor:
    if form is PACKED:
        return torch.ops.mkldnn._linear_pointwise(a, proj.packed, None, "none", [],
                                                  "").add_(x)
    if form is WEIGHT_LEFT:
        return torch.addmm(x.t(), proj.weight, a.t()).t()
    return torch.addmm(x, a, proj.weight.t())


def swiglu(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """SiLU(gate) * up, in place in the gate's output."""
    return F.silu(gate_up[:, :intermediate_size]).mul_(gate_up[:, intermediate_size:])


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Keys and values of whole blocks, one contiguous context per sequence.

    cache: [2, G, num_blocks, bs, E]; block_tables: [B, M] (padded) -> [2, G, B, M * bs, E]
    """
    _, G, num_blocks, bs, E = cache.shape
    B = block_tables.shape[0]
    return cache.reshape(2, G, num_blocks, bs * E).index_select(2, block_tables.view(-1)) \
        .view(2, G, B, -1, E)


def host_long(values, pinned: bool = False) -> torch.Tensor:
    """int64 host tensor from a flat sequence of ints: 3-5x cheaper than torch.tensor(list);
    pinned, for a non-blocking copy to a GPU."""
    host = torch.frombuffer(array.array("q", values), dtype=torch.long) if values else \
        torch.empty(0, dtype=torch.long)
    return host.pin_memory() if pinned else host


def long_tensor(values, device) -> torch.Tensor:
    """int64 tensor on `device` from a flat sequence of ints.

    On CUDA: one pinned, non-blocking copy on the current stream (the step's)."""
    if device.type == "cuda":
        return host_long(values, pinned=True).to(device, non_blocking=True)
    return host_long(values)  # already where it belongs


def decode_mask(positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive decode mask [1, B, 1, L]: a query (at positions[b]) sees every cached
    position of its own sequence up to its own; padding beyond is -inf. Built on the
    device from the positions (no host round trip: CUDA graphs capture it)."""
    key_pos = torch.arange(num_keys, device=positions.device)
    masked = key_pos[None, :] > positions[:, None]  # [B, L]
    return torch.zeros(masked.shape, dtype=dtype, device=positions.device) \
        .masked_fill_(masked, float("-inf"))[None, :, None, :]


def padded_block_tables(seqs, device) -> torch.Tensor:
    """[B, M] block ids of each sequence, padded with block 0 (masked out by position)."""
    M = max(len(seq.block_table) for seq in seqs)
    flat = [block for seq in seqs for block in seq.block_table + [0] * (M - len(seq.block_table))]
    return long_tensor(flat, device).view(len(seqs), M)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        # This layer's view of the engine's pool, bound by `bind_kv_cache`:
        # [K/V, G, num_blocks, block size, E]. Head-major, so gathering a batch's blocks
        # yields [2, G, B, L, E] with no transpose copy.
        self.kv_cache = torch.empty(0)

    def forward(self, h: torch.Tensor, rotation: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """h: [T, D] normalised hidden states -> attention output [T, H * E] (before o_proj)."""
        G, E, H = self.num_kv_heads, self.head_dim, self.num_heads
        # qkv row-major whatever h's layout: RoPE and the cache writes view its rows.
        qkv = linear(h, self.qkv_proj, row_major_form(h, self.qkv_proj))  # [T, (H + 2G) E]
        scoped(SCOPE_ROPE, rotate_, qkv[:, :(H + G) * E], rotation, H + G)  # q and k at once
        return scoped(SCOPE_ATTENTION, self._attend, qkv, meta)

    def _attend(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write the step's keys and values to the cache, attend -> [T, H * E]."""
        G, E, H = self.num_kv_heads, self.head_dim, self.num_heads
        T = qkv.shape[0]
        new_kv = qkv[:, H * E:].view(T, 2, G, E).permute(1, 2, 0, 3)  # [2, G, T, E]
        cache = self.kv_cache
        cache.view(2, G, -1, E).index_copy_(2, meta.write_slots, new_kv)
        if meta.prefill is not None:
            return self._prefill(qkv, new_kv, meta.prefill)
        if meta.workspace is not None:  # decode: append to the contiguous copy, no gather
            context = meta.workspace.kv[self.layer_index]  # [2, G, B, capacity, E]
            context.view(2, G, -1, E).index_copy_(2, meta.workspace_index, new_kv)
            L = meta.attn_mask.shape[-1]
            # The H/G query heads of a group are the "query rows" of its key/value head.
            q = qkv[:, :H * E].view(T, G, H // G, E).transpose(0, 1)  # [G, B, H/G, E]
            out = F.scaled_dot_product_attention(
                q, context[0, :, :, :L], context[1, :, :, :L], attn_mask=meta.attn_mask,
                scale=self.scale)
            return out.transpose(0, 1).reshape(T, H * E)
        context = gather_blocks(cache, meta.block_tables)  # [2, G, B, L, E]
        # As over the workspace: a group's H/G query heads are its key/value head's query
        # rows, so no kernel expands K/V to every head (with enable_gqa and a mask, SDPA on
        # CUDA may be left with its math kernel, which copies K/V per query head in float32)
        # and the fused kernels that take a mask (memory-efficient, cuDNN) stay eligible.
        q = qkv[:, :H * E].view(T, G, H // G, E).transpose(0, 1)  # [G, B, H/G, E]
        out = F.scaled_dot_product_attention(
            q, context[0], context[1], attn_mask=meta.attn_mask, scale=self.scale)
        return out.transpose(0, 1).reshape(T, H * E)

    def _prefill(self, qkv: torch.Tensor, new_kv: torch.Tensor,
                 seqs: list[PrefillSequence]) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its context -> [T, H * E].

        A sequence with nothing cached attends to its own new keys (no gather, and SDPA's
        causal kernels need no mask); one with a cached prefix gathers its blocks and uses
        a bottom-right causal mask.
        """
        G, E, H = self.num_kv_heads, self.head_dim, self.num_heads
        outs = []
        for seq in seqs:
            n, b = seq.num_new, seq.num_seqs
            rows = slice(seq.row, seq.row + b * n)
            # 4-D inputs: with 3-D ones CPU SDPA falls back to its math kernel, which holds
            # the whole [H, n, L] score matrix (1.2 GB at 4k tokens instead of 8 MB).
            q = qkv[rows, :H * E].view(b, n, H, E).transpose(1, 2)  # [b, H, n, E]
            if seq.num_cached == 0:
                k, v = (new_kv[i, :, rows].view(G, b, n, E).transpose(0, 1) for i in (0, 1))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     enable_gqa=H != G, scale=self.scale)
            else:
                L = seq.num_cached + seq.num_new
                context = gather_blocks(self.kv_cache, seq.block_ids[None])  # [2, G, 1, L', E]
                context = context[:, :, :, :L].transpose(1, 2)  # [2, 1, G, L, E]
                out = F.scaled_dot_product_attention(
                    q, context[0], context[1], attn_mask=seq.mask, enable_gqa=H != G,
                    scale=self.scale)
            outs.append(out.transpose(1, 2).reshape(b * n, H * E))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def act(self, h: torch.Tensor, form: str) -> torch.Tensor:
        """SiLU(gate) * up for h: [T, D] -> [T, I] (before down_proj)."""
        gate_up = linear(h, self.gate_up_proj, form)
        return scoped(SCOPE_ACTIVATION, swiglu, gate_up, self.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rotation, meta):
        """x: [T, D] -> [T, D]. Each residual add rides in its projection's GEMM (after
        it, in place, when the weights are packed)."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        form = gemm_form(x, mlp.down_proj.packed is not None)  # all packed, or none
        out = attn(rms_norm(x, norm1.weight, norm1.eps), rotation, meta)  # [T, H * E]
        x = linear_add(x, out, attn.o_proj, form)
        act = mlp.act(rms_norm(x, norm2.weight, norm2.eps), form)
        return linear_add(x, act, mlp.down_proj, form)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names mirror Hugging Face's, with q/k/v and gate/up fused (see loader)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # float32 whatever the model's dtype (a plain attribute, so `.to(dtype)` leaves it):
        # transformers keeps it so, and bf16-rounded frequencies would skew every angle.
        self.inv_freq = rope_inv_freq(config)
        self._rotations = torch.empty(0)  # [positions, 1, E/2] cache of `rotations`
        for proj in self.projections():
            proj.packed = None  # see pack_weights

    def rotations(self, positions: torch.Tensor, needed: int, dtype: torch.dtype) -> torch.Tensor:
        """positions: [T], all below `needed` -> RoPE rotation per token, [T, 1, E/2]
        (see `rotate_`). The table grows on the host's word, never by a device sync."""
        table = self._rotations
        if table.shape[0] < needed or table.dtype not in (dtype, _COMPLEX.get(dtype)):
            # cos and sin computed in float32, then cast, as transformers does.
            size = max(needed, 2 * table.shape[0], 256)
            inv_freq = self.inv_freq.to(positions.device)
            freqs = torch.arange(size, device=inv_freq.device, dtype=torch.float32)[:, None] \
                * inv_freq
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            table = torch.complex(cos, sin) if dtype in _COMPLEX else torch.stack((cos, sin), -1)
            self._rotations = table = table[:, None]
        return table.index_select(0, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_positions: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (positions < num_positions) -> hidden states [T, D]
        after the final norm."""
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        rotation = scoped(SCOPE_ROPE, self.rotations, positions, num_positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rotation, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden, self.lm_head, row_major_form(hidden, self.lm_head))

    def precompute_rotations(self, num_positions: int, dtype: torch.dtype,
                             device: torch.device) -> None:
        """Build the RoPE table for every position once, before any step: it is then only
        read, so steps on two lanes' streams never race on its growth."""
        self.rotations(torch.zeros(1, dtype=torch.long, device=device), num_positions, dtype)

    def projections(self) -> list[nn.Linear]:
        """Each layer's q/k/v, o, gate/up and down projections, and the lm_head."""
        return [proj for layer in self.model.layers
                for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [self.lm_head]

    def _apply(self, fn, recurse=True):
        """Moving or casting the model (`.to`, `.double()`) drops the packed copies: they
        would no longer be the weights."""
        for proj in self.projections():
            proj.packed = None
        return super()._apply(fn, recurse)

    def packed_bytes(self) -> int:
        """What the packed copies hold (their weights' size)."""
        return sum(proj.weight.numel() * proj.weight.element_size()
                   for proj in self.projections() if proj.packed is not None)

    def pack_weights(self) -> bool:
        """Run the projections on oneDNN with pre-packed weights (CPU float32; see
        `packed_weight`). False, and nothing changed, where that is not available. The
        weights are read-only afterwards (the packed copies are not updated)."""
        packed = [packed_weight(proj.weight) for proj in self.projections()]
        if any(p is None for p in packed):
            return False
        for proj, weight in zip(self.projections(), packed, strict=False):
            proj.packed = weight
        return True

    def bind_kv_cache(self, kv_pool: torch.Tensor) -> None:
        """kv_pool: [layers, 2, G, num_blocks, block size, E], allocated once by the runner."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = kv_pool[i]
