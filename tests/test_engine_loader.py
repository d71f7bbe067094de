"""Loading builds weights in their final dtype, and the KV pool is sized the way the
device allows."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ac_observe.engine.config import EngineConfig, ModelConfig
from ac_observe.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_block_counts
from ac_observe.engine.loader import build_model
from ac_observe.engine.model_runner import (
    activation_bytes,
    decode_step_bytes,
    gpu_kv_pool_bytes,
    kv_pool_bytes_from_free,
)
from support.checkpoints import write_hf_checkpoint


class LargeFloat32Tensors(TorchDispatchMode):
    """Records every float32 tensor of at least `min_numel` elements an op produces."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.seen = min_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                    and value.numel() >= self.min_numel and value.device.type != "meta":
                self.seen.append((str(func), tuple(value.shape)))
        return out


@pytest.mark.parametrize("source", ["tiny", "checkpoint"])
def test_bfloat16_loading_never_creates_a_float32_weight(tmp_path, source):
    model = "tiny"
    if source == "checkpoint":
        model = str(write_hf_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16))
    smallest = 64 * 64  # every weight matrix of both models is at least this big
    with LargeFloat32Tensors(smallest) as recorder:
        net = build_model(model, torch.device("cpu"), torch.bfloat16)
    assert recorder.seen == []
    weights = dict(net.named_parameters())
    assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
    if source == "checkpoint":  # and they hold the checkpoint's values
        from safetensors.torch import load_file
        saved = load_file(next((tmp_path / "bf16").glob("*.safetensors")))
        assert torch.equal(weights["model.embed_tokens.weight"],
                           saved["model.embed_tokens.weight"])


def test_float32_build_still_creates_float32_weights():
    """The recorder is not blind: the same build in float32 is seen."""
    with LargeFloat32Tensors(64 * 64) as recorder:
        build_model("tiny", torch.device("cpu"), torch.float32)
    assert recorder.seen


def test_kv_pool_from_gpu_memory_utilization():
    gib, margin = 1 << 30, 256 << 20
    # 80 GiB card, 0.9 of it ours: 72 GiB, minus our 17 GiB of weights and 2 GiB of steps.
    assert kv_pool_bytes_from_free(80 * gib, 63 * gib, 0.9, 17 * gib, 2 * gib) == 53 * gib
    # Two engines at 0.45: the second's share is its own, not cut by the first's.
    assert kv_pool_bytes_from_free(80 * gib, 43 * gib, 0.45, 1 * gib, 1 * gib) == 34 * gib
    # But never more than is free now: another process holds 60 GiB.
    assert kv_pool_bytes_from_free(80 * gib, 20 * gib, 0.9, 2 * gib, 1 * gib) == \
        20 * gib - margin - 1 * gib
    # Nothing left: a clear error, not a crash later.
    with pytest.raises(RuntimeError, match="gpu-memory-utilization"):
        kv_pool_bytes_from_free(80 * gib, 3 * gib, 0.9, 2 * gib, 3 * gib)
    tiny = ModelConfig.tiny()
    assert activation_bytes(tiny, 4096, 4) == 2 * 4096 * (
        4 * 256 + 3 * 688 + (8 + 2 * 2) * 32) * 4


def test_cuda_graph_buckets():
    """nano-vllm's batch buckets (1, 2, 4, 8, multiples of 16) up to each lane's limit,
    context buckets every power of two up to the graphs' limit; beyond either, eager."""
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(1) == [1]
    assert graph_block_counts(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert graph_block_counts(6) == [1, 2, 4, 6]
    assert graph_block_counts(1) == [1]
    graphs = DecodeGraphs(build_model("tiny", torch.device("cpu"), torch.float32, 0),
                          max_seqs=40, max_blocks=6, block_size=16, trash_block=99,
                          num_positions=96, device=torch.device("cpu"))
    assert graphs.key_for(3, 3) == (4, 4)
    assert graphs.key_for(17, 5) == (32, 6)
    assert graphs.key_for(40, 1) == (40, 1)
    assert graphs.key_for(41, 1) is None and graphs.key_for(1, 7) is None


def test_cuda_graph_options():
    with pytest.raises(ValueError, match="cannot both be on"):
        EngineConfig(decode_workspace="on", cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs must be auto, on or off"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graph_max_len"):
        EngineConfig(cuda_graph_max_len=0)


def test_graph_pools_come_off_the_kv_budget():
    """A decode step's transient bound: the gathered K/V (G heads) and the mask in the
    model's dtype; the math kernel's float32 K, scaled K and V, and its float32 scores and
    softmax (H each per position); the activations; per position of every sequence."""
    tiny = ModelConfig.tiny()  # G = 2, H = 8, E = 32
    per_position = (2 * 2 * 32 + 1) * 2 + (3 * 2 * 32 + 2 * 8) * 4
    assert decode_step_bytes(tiny, 64, 4096, 2) == 64 * 4096 * per_position + \
        activation_bytes(tiny, 64, 2)
    # On a 16 GiB GPU holding 2 GiB of weights, the 1B shape in bf16, lanes of 4 and 256
    # (so the pool is not capped by what the lanes could use): graphs take exactly their
    # lanes' bounds off the pool, at the graphs' longest context.
    from ac_observe.engine.config import LaneConfig
    gib = 1 << 30
    config = EngineConfig(cuda_graph_max_len=2048, lanes=(
        LaneConfig("low_latency", 4), LaneConfig("throughput", 256)))
    big = ModelConfig.random_1b()
    without = gpu_kv_pool_bytes(config, big, 2, False, 16 * gib, 14 * gib, 2 * gib)
    with_graphs = gpu_kv_pool_bytes(config, big, 2, True, 16 * gib, 14 * gib, 2 * gib)
    assert without == int(16 * gib * 0.9) - 2 * gib - activation_bytes(big, 4096, 2)
    assert without - with_graphs == decode_step_bytes(big, 4, 2048, 2) + \
        decode_step_bytes(big, 256, 2048, 2)
