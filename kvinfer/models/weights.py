"""Per-family maps from checkpoint (Hugging Face) tensor names onto the decoder's parameters."""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError

# Llama-style names (Llama, Mistral, Qwen2, Qwen3 and the GGUF loader's output).
_LLAMA_LAYER = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.o_proj.bias": "attn.o.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.down_proj.bias": "mlp.down.bias",
}
_LLAMA_GLOBAL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Fused parameters: our name <- the checkpoint names concatenated along dim 0, in order.
_LLAMA_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def map_llama(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name in _LLAMA_GLOBAL:
            out[_LLAMA_GLOBAL[name]] = t
            continue
        m = _LAYER_RE.match(name)
        if not m:
            if "rotary_emb" in name:
                continue
            raise ModelLoadError(f"unexpected tensor {name!r} in a {cfg.architecture} checkpoint")
        i, rest = int(m.group(1)), m.group(2)
        if rest in _LLAMA_LAYER:
            out[f"layers.{i}.{_LLAMA_LAYER[rest]}"] = t
        elif "rotary_emb" in rest:
            continue
        else:
            pending.setdefault(i, {})[rest] = t
    for i, parts in pending.items():
        for ours, srcs in _LLAMA_FUSED.items():
            have = [s for s in srcs if s in parts]
            if not have:
                continue
            if len(have) != len(srcs):
                missing = sorted(set(srcs) - set(have))
                raise ModelLoadError(f"layer {i} lacks {missing}")
            out[f"layers.{i}.{ours}"] = torch.cat([parts.pop(s) for s in srcs], dim=0)
        if parts:
            raise ModelLoadError(f"unexpected tensors in layer {i}: {sorted(parts)}")
    return out


WEIGHT_MAPS: dict[str, Callable[[ModelConfig, Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]] = {
    "llama": map_llama,
    "mistral": map_llama,
    "qwen2": map_llama,
    "qwen3": map_llama,
}


def load_into(model: torch.nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Map checkpoint tensors onto `model`'s parameters; every parameter must be filled exactly once."""
    mapper = WEIGHT_MAPS.get(cfg.architecture)
    if mapper is None:
        raise ModelLoadError(f"no weight map for architecture {cfg.architecture!r}")
    state = mapper(cfg, tensors)
    params = dict(model.named_parameters())
    if "lm_head.weight" in state and "lm_head.weight" not in params:
        state.pop("lm_head.weight")  # tied checkpoints sometimes store the head anyway
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, t in state.items():
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
            p.copy_(t)
