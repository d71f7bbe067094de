"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Covers Llama, Qwen2 (q/k/v biases, tied embeddings) and Mistral-shaped checkpoints. Numerics
follow Hugging Face `transformers` (RoPE tables and RMSNorm in float32) so logits agree.

Shapes: B sequences in the step, N new tokens per sequence (padded), L context positions per
sequence (cached + new, padded), D hidden, H query heads, G key/value heads, E head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each one may attend to.

    NOTE: every layer writes the step's new keys/values before it gathers the context, so
    a sequence always reads its own new tokens, and a padded slot is never read.
    """
    write_index: torch.Tensor    # [T] flat positions (into B*N) of the real new tokens
    write_slots: torch.Tensor    # [T] cache slot of each real new token
    block_tables: torch.Tensor | None  # [B, M] blocks per sequence (padded), L = M * block size;
                                       # None when the decode workspace holds the context
    attn_mask: torch.Tensor      # [B, 1, N, L] additive: 0 where a query may attend a key, -inf elsewhere
    workspace: object = None     # decode only: engine.workspace.DecodeWorkspace of the lane
    rows: torch.Tensor | None = None       # [B] 0..B-1, with workspace
    positions: torch.Tensor | None = None  # [B] position of each new token, with workspace


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The KV of whole blocks, one contiguous context per sequence.

    cache: [G, num_blocks, bs, E]; block_tables: [B, M] (padded) -> [G, B, M * bs, E]
    """
    G, num_blocks, bs, E = cache.shape
    B = block_tables.shape[0]
    return cache.reshape(G, num_blocks, bs * E).index_select(1, block_tables.view(-1)) \
        .view(G, B, -1, E)


def padded_block_tables(seqs, device) -> torch.Tensor:
    """[B, M] block ids of each sequence, padded with block 0 (masked out by position)."""
    M = max(len(seq.block_table) for seq in seqs)
    return torch.tensor([seq.block_table + [0] * (M - len(seq.block_table)) for seq in seqs],
                        dtype=torch.long, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, N, heads, E]; cos/sin: [B, N, 1, E]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:  # one fused kernel; float32 math as transformers does
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers normalises float64 activations in float32: mirror it exactly.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        # Views into the engine's pool, bound by `bind_kv_cache`: [G, num_blocks, block size, E].
        # Head-major, so gathering a batch's blocks yields [G, B, L, E] with no transpose copy.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        B, N, _ = x.shape
        G, E = self.num_kv_heads, self.head_dim
        H = self.num_heads
        qkv = self.qkv_proj(x)
        # Rotate queries and keys together: one RoPE pass over H + G heads.
        qk = apply_rope(qkv[..., :(H + G) * E].view(B, N, H + G, E), cos, sin)
        q, k = qk[:, :, :H], qk[:, :, H:]
        v = qkv[..., (H + G) * E:].view(B, N, G, E)
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            cache.view(G, -1, E).index_copy_(
                1, meta.write_slots, new.reshape(B * N, G, E)[meta.write_index].transpose(0, 1))
        if meta.workspace is not None:  # decode: append to the contiguous copy, no gather
            L = meta.attn_mask.shape[-1]
            keys = meta.workspace.keys[self.layer_index]
            values = meta.workspace.values[self.layer_index]
            keys[:, meta.rows, meta.positions] = k[:, 0].transpose(0, 1)
            values[:, meta.rows, meta.positions] = v[:, 0].transpose(0, 1)
            keys, values = keys[:, :, :L], values[:, :, :L]  # [G, B, L, E]
        else:
            keys = gather_blocks(self.k_cache, meta.block_tables)    # [G, B, L, E]
            values = gather_blocks(self.v_cache, meta.block_tables)  # [G, B, L, E]
        if N == 1:  # decode: two batched matmuls beat the fused kernel's setup at this size
            out = self._decode_attention(q, keys, values, meta.attn_mask)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=meta.attn_mask, enable_gqa=self.num_heads != G).transpose(1, 2)
        return self.o_proj(out.reshape(B, N, -1))

    def _decode_attention(self, q, keys, values, mask):
        # q: [B, 1, H, E] -> [G, B, H/G, E]; keys/values: [G, B, L, E]; mask: [B, 1, 1, L]
        B, G, E = q.shape[0], self.num_kv_heads, self.head_dim
        grouped = q.view(B, G, -1, E).transpose(0, 1)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * E ** -0.5
        probs = torch.softmax(scores + mask.view(1, B, 1, -1), dim=-1)
        out = torch.matmul(probs, values)  # [G, B, H/G, E]
        return out.transpose(0, 1).reshape(B, 1, self.num_heads, E)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [B, N] -> cos, sin: [B, N, 1, E]; computed in float32 as transformers does.
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [B, N] -> hidden states [B, N, D] after the final norm
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_tables(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def bind_kv_cache(self, kv_pool: torch.Tensor) -> None:
        """kv_pool: [layers, 2, G, num_blocks, block size, E], allocated once by the runner."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache = kv_pool[i, 0]
            layer.self_attn.v_cache = kv_pool[i, 1]
