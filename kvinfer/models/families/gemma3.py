"""Gemma 3 (text): config, the sandwich-norm block, weight names ((1 + w) norms folded at load) and GGUF names."""
from __future__ import annotations

from functools import partial
from typing import Iterable, Optional

import torch
from torch import nn

from kvinfer.config import ModelConfig, RopeScaling
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.layers.attention import Attention
from kvinfer.layers.norm import RMSNorm
from kvinfer.models.families.common import GELU_NAMES, rope_scaling, rope_theta
from kvinfer.models.families.llama import llama_like, map_llama
from kvinfer.models.families.registry import Family, GGUFNames, register


def _gemma3_rope(d: dict) -> tuple[float, Optional[RopeScaling], float]:
    """(global theta, global scaling, local theta): transformers 5 nests them per layer type, 4.x kept them flat."""
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp:
        glob, local = rp["full_attention"], rp.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedError(f"gemma3 with RoPE scaling {local.get('rope_type')!r} on the sliding layers is not "
                                   "supported (supported: default)")
        return float(glob.get("rope_theta", 1e6)), rope_scaling(d, glob), float(local.get("rope_theta", 1e4))
    return rope_theta(dict(d, rope_theta=d.get("rope_theta", 1e6))), rope_scaling(d), \
        float(d.get("rope_local_base_freq", 1e4))


def _from_gemma3(d):
    n = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    types = d.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n)]
    window = d.get("sliding_window")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if GELU_NAMES.get(act) != "gelu_tanh":
        raise UnsupportedError(f"gemma3 hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedError("gemma3 with attn_logit_softcapping is not supported (supported: null, as released)")
    theta, scaling, local_theta = _gemma3_rope(d)
    cap = d.get("final_logit_softcapping")
    return llama_like(d, "gemma3", head_dim_default=256, qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
                      layer_windows=tuple(int(window) if t == "sliding_attention" and window else None
                                          for t in types),
                      rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                      embed_scale=float(d["hidden_size"]) ** 0.5,
                      attn_scale=float(d.get("query_pre_attn_scalar") or 256) ** -0.5,
                      final_logit_softcap=float(cap) if cap else None,
                      tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))


# Beyond the Llama names: the norms after attention and around the MLP.
HF_LAYER_NAMES = {
    "pre_feedforward_layernorm.weight": "pre_mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}


class SandwichLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_mlp_norm(mlp(pre_mlp_norm(x)))."""

    def __init__(self, cfg: ModelConfig, idx: int, rotary, mlp: nn.Module):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, idx, rotary)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, positions, md, kv):
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), positions, md, kv))
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


def map_gemma3(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
               norms_hold_one: bool = False) -> dict[str, torch.Tensor]:
    """norms_hold_one: the norm weights are already 1 + w (llama.cpp's converter adds the one when it writes a GGUF
    file), so they are taken as they are."""
    out = map_llama(cfg, tensors, HF_LAYER_NAMES)
    if norms_hold_one:
        return out
    # Gemma's RMSNorm scales by (1 + w); adding the one here, in float32 as transformers does, leaves the usual norm.
    for name, t in out.items():
        if name.endswith("norm.weight"):
            out[name] = t.float() + 1.0
    return out


# llama.cpp's layer pattern for Gemma 3 when the file names none: every sixth layer global, the rest windowed.
_GGUF_SWA_PATTERN = 6


def _gguf_config(h, d: dict) -> None:
    """Gemma 3 as llama.cpp reads it: windowed layers by the file's pattern (or every sixth layer global), their
    own RoPE base (default 10000), the softmax scale from the head size, GELU-tanh, soft-capped logits."""
    n = d["num_hidden_layers"]
    window = h.opt("attention.sliding_window")
    pattern = h.opt("attention.sliding_window_pattern", _GGUF_SWA_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: windowed or not
        if len(pattern) < n:
            raise ModelLoadError(f"GGUF file {h.path}: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries for {n} layers")
        windowed = [bool(x) for x in pattern[:n]]
    else:
        windowed = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    d["layer_types"] = ["sliding_attention" if w and window else "full_attention" for w in windowed]
    d["sliding_window"] = window or None
    d["rope_local_base_freq"] = h.opt("rope.freq_base_swa", 10000.0)
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    # The file has no query_pre_attn_scalar; llama.cpp scales by the head size, except for the 62-layer (27B)
    # model, whose scalar is hidden / heads (as its Hugging Face config says).
    d["query_pre_attn_scalar"] = d["hidden_size"] // d["num_attention_heads"] if n == 62 else d["head_dim"]
    d["final_logit_softcapping"] = h.opt("final_logit_softcapping")
    d["hidden_activation"] = "gelu_pytorch_tanh"


register(Family("gemma3_text", "gemma3", _from_gemma3, map_gemma3, GGUFNames(
    "gemma3",
    # The sandwich: ffn_norm is the norm before the MLP, and the norms after attention and the MLP.
    layer_names={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"},
    config=_gguf_config, weight_map=partial(map_gemma3, norms_hold_one=True))))
