"""Build the model: the built-in tiny preset (random weights) or a local Hugging Face folder.

Nothing is ever downloaded: a model is a preset name or a path on disk.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ac_observe.engine.config import RANDOM_1B_PRESET, TINY_PRESET, ModelConfig
from ac_observe.engine.model import CausalLM, rope_row_order

PRESETS = {TINY_PRESET: ModelConfig.tiny, RANDOM_1B_PRESET: ModelConfig.random_1b}

# Hugging Face parameter -> (our fused parameter, index of the shard inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        raise ValueError(f"unknown dtype {name!r}") from None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def load_model_config(model: str) -> ModelConfig:
    if model in PRESETS:
        return PRESETS[model]()
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder "
            "holding a Hugging Face config.json (nothing is downloaded)")
    return ModelConfig.from_hf_folder(folder)


def build_model(model: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """The model with its weights created directly in `dtype` on `device`: never a
    float32 copy of a bfloat16 model, so what fits in bfloat16 loads."""
    config = load_model_config(model)
    torch.manual_seed(seed)
    with torch.device("meta"):  # shapes only: no memory yet
        net = CausalLM(config).to(dtype)
    net = net.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty makes a tensor per registration: tie again
        net.lm_head.weight = net.model.embed_tokens.weight
    if model in PRESETS:
        _init_random(net, std=0.02)
    else:
        load_hf_weights(net, Path(model))  # fills every parameter (it checks)
    return net.eval()


def _init_random(net: CausalLM, std: float) -> None:
    for name, param in net.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(param)
        else:
            torch.nn.init.normal_(param, mean=0.0, std=std)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


@torch.no_grad()
def load_hf_weights(net: CausalLM, folder: Path) -> None:
    params = dict(net.named_parameters())
    loaded: set[str] = set()
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as shards:
            for hf_name in shards.keys():
                if "rotary_emb" in hf_name:
                    continue
                tensor = shards.get_tensor(hf_name)
                name, shard = _map_name(hf_name)
                if name not in params:
                    if name == "lm_head.weight" and net.config.tie_word_embeddings:
                        continue
                    raise KeyError(f"{file.name}: unexpected tensor {hf_name}")
                target = params[name]
                if shard is None:
                    target.copy_(tensor)
                else:
                    if "qkv_proj" in name and shard < 2:  # queries and keys: RoPE row order
                        tensor = _interleave_heads(tensor, net.config.head_dim)
                    _shard_view(net, name, target, shard).copy_(tensor)
                loaded.add(f"{name}#{shard}")
    missing = [n for n in _expected_keys(net) if n not in loaded]
    if missing:
        raise KeyError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _interleave_heads(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head in the order `engine.model.rotate_` expects."""
    heads = tensor.shape[0] // head_dim
    order = rope_row_order(head_dim)
    return tensor.reshape(heads, head_dim, -1)[:, order].reshape(tensor.shape)


def _map_name(hf_name: str) -> tuple[str, int | None]:
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(hf_part, ours), shard
    return hf_name, None


def _shard_view(net: CausalLM, name: str, target: torch.Tensor, shard: int) -> torch.Tensor:
    cfg = net.config
    if "qkv_proj" in name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        sizes = (q, kv, kv)
    else:
        sizes = (cfg.intermediate_size, cfg.intermediate_size)
    start = sum(sizes[:shard])
    return target.narrow(0, start, sizes[shard])


def _expected_keys(net: CausalLM) -> list[str]:
    keys = []
    for name, _ in net.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            keys += [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            keys += [f"{name}#{i}" for i in range(2)]
        else:
            keys.append(f"{name}#None")
    return keys
