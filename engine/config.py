"""Engine and model configuration (torch-free)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ac_observe.metrics import LANES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
TINY_PRESET = "tiny"
RANDOM_1B_PRESET = "random-1b"


@dataclass(slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama, Qwen2, Mistral checkpoints)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    name: str = TINY_PRESET

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The built-in preset: byte-level vocabulary, fast on two CPU cores."""
        return cls(vocab_size=259, hidden_size=256, intermediate_size=688,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                   max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                   bos_token_id=256, eos_token_ids=(257,), name=TINY_PRESET)

    @classmethod
    def random_1b(cls) -> ModelConfig:
        """A ~1.1B-parameter Llama shape (TinyLlama's), randomly initialised: large enough
        that a GPU is busy with it (the GPU check and benchmarks); byte tokenizer."""
        return cls(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                   num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                   bos_token_id=256, eos_token_ids=(257,), name=RANDOM_1B_PRESET)

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> ModelConfig:
        """Read a Hugging Face `config.json` (Llama / Qwen2 / Mistral)."""
        folder = Path(path)
        raw = json.loads((folder / "config.json").read_text())
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        # transformers 5 nests RoPE settings in rope_parameters; 4.x keeps them flat.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        gen_cfg = folder / "generation_config.json"
        if gen_cfg.exists():
            gen_eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            if isinstance(gen_eos, list):
                eos_ids = tuple(dict.fromkeys(eos_ids + tuple(gen_eos)))
            elif gen_eos is not None and gen_eos not in eos_ids:
                eos_ids = eos_ids + (gen_eos,)
        arch = archs[0]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or 0,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            name=raw.get("_name_or_path") or folder.name,
        )


@dataclass(slots=True)
class LaneConfig:
    name: str
    max_num_seqs: int


@dataclass(slots=True)
class EngineConfig:
    model: str = TINY_PRESET          # "tiny" or a local Hugging Face folder
    model_name: str = ""              # the `model` label; defaults to the preset/folder name
    engine_name: str = "engine"       # the `engine` label
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    dtype: str = "auto"               # auto | float32 | float64 | bfloat16 | float16
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int = 0            # 0: size from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 0    # 0: CPU 256 MiB; CUDA from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory this engine may hold
    max_model_len: int = 0            # 0: the model's max_position_embeddings
    max_num_batched_tokens: int = 4096
    max_waiting: int = 256
    decode_workspace: str = "auto"    # auto (on for CPU) | on | off: see engine/workspace.py
    # auto (on for CPU float32 where oneDNN is built in) | on | off: the projections run
    # on oneDNN with pre-packed weights (engine/model.py packed_weight; a second copy).
    cpu_packed_weights: str = "auto"
    # auto (on for CUDA) | on | off: decode steps replay CUDA graphs captured at start-up
    # (engine/cuda_graphs.py); "on" on CPU runs the same padded static-buffer steps eagerly.
    cuda_graphs: str = "auto"
    cuda_graph_max_len: int = 8192    # longest context a graph covers; longer runs eagerly
    enable_prefix_caching: bool = True
    # Evicted block hashes remembered to tell "evicted" misses from new traffic (16-32
    # bytes each; see engine/evicted_hashes.py). 0: 4x the pool, at least 262144.
    evicted_hash_memory: int = 0
    # auto (on for CUDA) | on | off: a step runs a batch of every lane with work, launched
    # together so the lanes' streams overlap; off: one lane per step (low_latency first).
    overlap_lanes: str = "auto"
    lanes: tuple[LaneConfig, ...] = field(default_factory=lambda: (
        LaneConfig(LANES[0], 4), LaneConfig(LANES[1], 64)))
    throughput_share: int = 4         # throughput gets 1/N of the time while both have work
                                      # (1: throughput first, always)
    # Sampled kernel time (engine/kernel_sampler.py): every Nth step of each lane and phase
    # runs under the profiler (0: never), within a budget of this share of wall time.
    kernel_sample_steps: int = 200
    kernel_sample_budget: float = 0.005
    skeleton_top_k: int = 20
    skeleton_min_count: int = 3       # sightings before a skeleton id earns its own label
    # /admin/faults may add a per-step delay, force prefix-cache misses and flush the
    # prefix cache now and then (drift demos and tests); off unless asked for, and then
    # only from this host with this bearer token (a port forwarded over ssh or kubectl
    # arrives from loopback too).
    fault_injection: bool = False
    fault_token: str | None = None
    telemetry_dir: str | None = None  # None: no telemetry files
    api_address: str = ""
    # False: no instrumentation at all (no telemetry, statistics, device step timers, kernel
    # samples or skeleton parsing): the baseline that bench/instrumentation_overhead.py
    # compares with, and the option for a user who measures the engine without us.
    instrumentation: bool = True

    @property
    def kernel_sampling_steps(self) -> int:
        """Every how many steps a kernel sample is taken; 0: never (instrumentation off)."""
        return self.kernel_sample_steps if self.instrumentation else 0

    def __post_init__(self) -> None:
        self._check_cache_lanes_and_modes()
        self._check_limits()

    def _check_cache_lanes_and_modes(self) -> None:
        """The cache's block size, the queue, the lanes and the auto/on/off switches."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_waiting <= 0:
            raise ValueError("max_waiting must be positive")
        if sorted(lane.name for lane in self.lanes) != sorted(LANES):
            raise ValueError(f"lanes must be {' and '.join(LANES)}")
        for name in ("decode_workspace", "overlap_lanes", "cuda_graphs", "cpu_packed_weights"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ValueError(f"{name} must be auto, on or off")
        if self.decode_workspace == "on" and self.cuda_graphs == "on":
            raise ValueError("decode_workspace and cuda_graphs cannot both be on: a graph "
                             "decodes over the paged cache, the workspace beside it")

    def _check_limits(self) -> None:
        """Sizes, shares and budgets in their ranges; telemetry only with instrumentation."""
        if self.cuda_graph_max_len < 1:
            raise ValueError("cuda_graph_max_len must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.evicted_hash_memory and self.evicted_hash_memory < 16:
            raise ValueError("evicted_hash_memory must be 0 (automatic) or at least 16")
        if self.skeleton_top_k < 0 or self.skeleton_min_count < 1:
            raise ValueError("skeleton_top_k must be >= 0 and skeleton_min_count >= 1")
        if self.kernel_sample_steps < 0 or not 0 < self.kernel_sample_budget <= 1:
            raise ValueError("kernel_sample_steps must be >= 0 (0: off) and "
                             "kernel_sample_budget in (0, 1]")
        if self.throughput_share < 1:
            raise ValueError("throughput_share must be >= 1")
        if not self.instrumentation and self.telemetry_dir:
            raise ValueError("an engine without instrumentation writes no telemetry: "
                             "drop telemetry_dir")

