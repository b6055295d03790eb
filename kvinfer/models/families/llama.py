"""Llama and Mistral, and the Llama shape the other RoPE families build on: config, weight names, GGUF names."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.models.families.common import cat_rows, eos_tuple, rope_scaling, rope_theta
from kvinfer.models.families.registry import Family, GGUFNames, register


def llama_like(d: dict, arch: str, *, head_dim_default: Optional[int] = None,
               sliding_window: Optional[int] = None, **flags) -> ModelConfig:
    """Llama-shaped families; `flags` are what the family's HF modelling code hard-wires."""
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    bias = bool(d.get("attention_bias", False))
    kw = dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False)), rope_theta=rope_theta(d),
              rope_scaling=rope_scaling(d), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    kw.update(flags)
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or head_dim_default or hidden // heads,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        sliding_window=sliding_window,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        **kw,
    )


def _from_llama(d):
    return llama_like(d, "llama")


def _from_mistral(d):
    # HF's Mistral has no biases whatever attention_bias says, and windows every layer unless sliding_window is null.
    window = d.get("sliding_window", 4096)
    return llama_like(d, "mistral", sliding_window=int(window) if window is not None else None,
                      qkv_bias=False, o_bias=False, mlp_bias=False)


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


# llama.cpp's tensor names for the Llama shape, which every GGUF family starts from (GGUFNames.layer_names holds a
# family's differences): GGUF name -> Hugging Face name.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3's per-head RMSNorm on q and k
    "attn_k_norm": "self_attn.k_norm",
    # Mixture of experts: the router, and each projection of every expert stacked in one 3-D tensor
    # [experts, rows, cols] (split into per-expert matrices by the loader).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

def _llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs.weight for Llama-3 scaling."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float64)


def rope_scaling_from_freqs(freqs: np.ndarray, theta: float, dim: int, meta: dict, arch: str, path: Path) -> dict:
    """Llama-3 RoPE scaling from a GGUF file's rope_freqs.weight: the converter keeps only the resulting factors;
    find the Llama-3 parameters that reproduce them."""
    factor = float(str(np.float32(freqs.max())))
    origs = [8192]
    orig_key = meta.get(f"{arch}.rope.scaling.original_context_length")
    if isinstance(orig_key, int):
        origs.insert(0, orig_key)
    for orig in origs:
        for low, high in ((1.0, 4.0),):
            want = _llama3_rope_factors(theta, dim, factor, low, high, orig)
            if want.shape == freqs.shape and np.allclose(freqs, want, rtol=1e-3, atol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise UnsupportedError(
        f"GGUF file {path}: rope_freqs.weight does not match Llama-3 RoPE scaling, "
        "and other per-frequency RoPE factors are not supported"
    )



def unpermute_rows(n_head: int, rows: int) -> torch.Tensor:
    """Row order undoing llama.cpp's permute(): GGUF row idx[i] is HF row i.

    The converter reshapes rows to (n_head, 2, head_dim/2) and swaps the last two axes, turning HF's
    rotate-half pairs (j, j + head_dim/2) into adjacent pairs (2j, 2j + 1).
    """
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot undo the q/k permutation: {rows} rows for {n_head} heads")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


# The llama GGUF architecture covers Mixtral too (the llama architecture with expert tensors, moe.py); llama.cpp's
# converter permutes q/k rows for it alone (qwen2/qwen3 keep HF's layout).
register(Family("llama", "llama", _from_llama, map_llama, GGUFNames("llama", permuted=True)))
register(Family("mistral", "mistral", _from_mistral, map_llama))
