"""Per-family maps from checkpoint (Hugging Face) tensor names onto the decoder's parameters."""
from __future__ import annotations

import re
from functools import partial
from typing import Callable, Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError
from kvinfer.models.families import gemma3, moe, phi3

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


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0, but a free view when the parts already sit back to back in one buffer.

    The GGUF loader lays q, k, v (and gate, up) out adjacently, so fusing them costs no copy.
    """
    first = parts[0]
    if all(p.is_meta for p in parts):  # shape-only placeholders (matrices kept as quantised blocks)
        return torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=first.dtype, device="meta")
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts)
    if adjacent:
        for a, b in zip(parts, parts[1:]):
            if a.storage_offset() + a.numel() != b.storage_offset():
                adjacent = False
                break
    if not adjacent:
        return torch.cat(parts, dim=0)
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def map_llama(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
              extra_layer_names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Llama-style names; extra_layer_names: a family's further per-layer names (checkpoint -> ours)."""
    layer_names = {**_LLAMA_LAYER, **(extra_layer_names or {})}
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
        if rest in layer_names:
            out[f"layers.{i}.{layer_names[rest]}"] = t
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
            out[f"layers.{i}.{ours}"] = cat_rows([parts.pop(s) for s in srcs])
        if parts:
            raise ModelLoadError(f"unexpected tensors in layer {i}: {sorted(parts)}")
    return out


def _transpose(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    # GPT-2's Conv1D stores [in, out]; nn.Linear wants [out, in].
    return t.t().contiguous()


def _bloom_qkv(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    # BLOOM fuses q/k/v per head: rows are [heads, 3, head_dim]; ours are [q heads; k heads; v heads].
    h, d = cfg.num_heads, cfg.head_dim
    parts = t.reshape(h, 3, d, *t.shape[1:])  # [heads, 3, dim, (hidden)]
    return torch.cat([parts[:, j].reshape(h * d, *t.shape[1:]) for j in range(3)], dim=0)


_Rule = tuple[str, Callable[[ModelConfig, torch.Tensor], torch.Tensor] | None]

# GPT-2: names are the same with or without the "transformer." prefix (the original hub files lack it).
_GPT2_GLOBAL: dict[str, _Rule] = {
    "wte.weight": ("embed.weight", None),
    "wpe.weight": ("pos_embed.weight", None),
    "ln_f.weight": ("norm.weight", None),
    "ln_f.bias": ("norm.bias", None),
    "lm_head.weight": ("lm_head.weight", None),
}
_GPT2_LAYER: dict[str, _Rule] = {
    "ln_1.weight": ("input_norm.weight", None),
    "ln_1.bias": ("input_norm.bias", None),
    "attn.c_attn.weight": ("attn.qkv.weight", _transpose),  # already [q; k; v] along the output dim
    "attn.c_attn.bias": ("attn.qkv.bias", None),
    "attn.c_proj.weight": ("attn.o.weight", _transpose),
    "attn.c_proj.bias": ("attn.o.bias", None),
    "ln_2.weight": ("post_attn_norm.weight", None),
    "ln_2.bias": ("post_attn_norm.bias", None),
    "mlp.c_fc.weight": ("mlp.up.weight", _transpose),
    "mlp.c_fc.bias": ("mlp.up.bias", None),
    "mlp.c_proj.weight": ("mlp.down.weight", _transpose),
    "mlp.c_proj.bias": ("mlp.down.bias", None),
}
# Old GPT-2 checkpoints carry the causal-mask buffers as tensors; the mask is ours to build.
_GPT2_SKIP = {"attn.bias", "attn.masked_bias"}

_BLOOM_GLOBAL: dict[str, _Rule] = {
    "word_embeddings.weight": ("embed.weight", None),
    "word_embeddings_layernorm.weight": ("embed_norm.weight", None),
    "word_embeddings_layernorm.bias": ("embed_norm.bias", None),
    "ln_f.weight": ("norm.weight", None),
    "ln_f.bias": ("norm.bias", None),
    "lm_head.weight": ("lm_head.weight", None),
}
_BLOOM_LAYER: dict[str, _Rule] = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "input_layernorm.bias": ("input_norm.bias", None),
    "self_attention.query_key_value.weight": ("attn.qkv.weight", _bloom_qkv),
    "self_attention.query_key_value.bias": ("attn.qkv.bias", _bloom_qkv),
    "self_attention.dense.weight": ("attn.o.weight", None),
    "self_attention.dense.bias": ("attn.o.bias", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
    "post_attention_layernorm.bias": ("post_attn_norm.bias", None),
    "mlp.dense_h_to_4h.weight": ("mlp.up.weight", None),
    "mlp.dense_h_to_4h.bias": ("mlp.up.bias", None),
    "mlp.dense_4h_to_h.weight": ("mlp.down.weight", None),
    "mlp.dense_4h_to_h.bias": ("mlp.down.bias", None),
}
_H_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")


def _map_renamed(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], global_rules: dict[str, _Rule],
                 layer_rules: dict[str, _Rule], skip: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """One checkpoint tensor per parameter, renamed and optionally reshaped (GPT-2, BLOOM)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        m = _H_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest in skip:
                continue
            rule = layer_rules.get(rest)
            if rule is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in a {cfg.architecture} checkpoint")
            ours, fn = rule
            out[f"layers.{i}.{ours}"] = fn(cfg, t) if fn else t
            continue
        short = name[len("transformer."):] if name.startswith("transformer.") else name
        rule = global_rules.get(short)
        if rule is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in a {cfg.architecture} checkpoint")
        ours, fn = rule
        out[ours] = fn(cfg, t) if fn else t
    return out


def map_gpt2(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return _map_renamed(cfg, tensors, _GPT2_GLOBAL, _GPT2_LAYER, frozenset(_GPT2_SKIP))


def map_bloom(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return _map_renamed(cfg, tensors, _BLOOM_GLOBAL, _BLOOM_LAYER)


WEIGHT_MAPS: dict[str, Callable[[ModelConfig, Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]] = {
    "llama": map_llama,
    "mistral": map_llama,
    "qwen2": map_llama,
    "qwen3": map_llama,
    "gpt2": map_gpt2,
    "bloom": map_bloom,
    "gemma3": gemma3.map_gemma3,
    "phi3": phi3.map_phi3,
    "qwen3_moe": moe.map_moe,
    "qwen2_moe": moe.map_moe,
    "mixtral": moe.map_moe,
}


# Where the GGUF loader's tensors (already under Hugging Face names) need another map than the family's checkpoints.
GGUF_WEIGHT_MAPS = {"gemma3": partial(gemma3.map_gemma3, norms_hold_one=True)}


def load_into(model: torch.nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
              from_gguf: bool = False) -> None:
    """Map checkpoint tensors onto `model`'s parameters; every parameter must be filled exactly once.

    from_gguf: the tensors come from the GGUF loader (as llama.cpp's converter wrote them)."""
    mapper = (from_gguf and GGUF_WEIGHT_MAPS.get(cfg.architecture)) or WEIGHT_MAPS.get(cfg.architecture)
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
    for name, t in state.items():
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
    # assign=True adopts the checkpoint tensors instead of copying them (the loader converts dtype and
    # device afterwards, once).
    model.load_state_dict({k: _aligned(t) for k, t in state.items()}, strict=True, assign=True)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # BLAS kernels pick code paths by alignment; a misaligned weight (e.g. inside a safetensors file) could
    # change results in the last bit, so adopt only contiguous 64-byte-aligned tensors, copy the rest.
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
