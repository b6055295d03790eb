"""Phi-3 / Phi-4-mini: config (partial rotary, longrope), q, k, v and gate, up fused in the checkpoint in the
decoder's own order, and the GGUF names and metadata."""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import ModelLoadError, UnsupportedError
from kvinfer.models.families.llama import llama_like, map_llama
from kvinfer.models.families.registry import Family, GGUFNames, register


def _from_phi3(d):
    rp = d.get("rope_parameters") or {}
    partial = float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rotary = int(head_dim * partial)
    window = d.get("sliding_window")
    # Phi-3's modelling code has no biases and windows every layer when sliding_window is set.
    return llama_like(d, "phi3", sliding_window=int(window) if window else None,
                      rotary_dim=rotary if rotary != head_dim else None, qkv_bias=False, o_bias=False,
                      mlp_bias=False)


# Rows [q; k; v] and [gate; up]: the decoder's fused parameters already, taken whole.
HF_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": "attn.qkv.weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up.weight",
}


def map_phi3(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return map_llama(cfg, tensors, HF_LAYER_NAMES)


# The longrope factors, read into the config rather than loaded as weights.
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_config(h, d: dict) -> None:
    """Phi-3 / Phi-4-mini: partial rotary from rope.dimension_count, the window (0: none), longrope factors from
    the rope_factors_long / rope_factors_short tensors."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rot = h.opt("rope.dimension_count", head_dim)
    if not (isinstance(rot, int) and 0 < rot <= head_dim and rot % 2 == 0):
        raise UnsupportedError(f"GGUF file {h.path}: phi3.rope.dimension_count={rot!r} is not supported "
                               f"(need an even number up to the head size {head_dim})")
    partial = rot / head_dim
    while int(head_dim * partial) < rot:  # the config normaliser takes int(head_dim * factor), as transformers
        partial = math.nextafter(partial, 2.0)
    d["partial_rotary_factor"] = partial
    d["sliding_window"] = h.opt("attention.sliding_window") or None
    have = [n for n in _ROPE_FACTORS if n in h.infos]
    if not have:
        if h.opt("rope.scaling.type") not in (None, "none"):
            raise UnsupportedError(f"GGUF file {h.path}: phi3 RoPE scaling {h.opt('rope.scaling.type')!r} without "
                                   "rope_factors_long/short tensors is not supported")
        return
    if len(have) != 2:
        raise ModelLoadError(f"GGUF file {h.path} has {have[0]} without its pair")
    orig = h.opt("rope.scaling.original_context_length")
    if orig is None:
        raise ModelLoadError(f"GGUF file {h.path} has longrope factors but lacks "
                             "phi3.rope.scaling.original_context_length")
    long_f, short_f = (h.values(n) for n in _ROPE_FACTORS)
    if len(long_f) != rot // 2 or len(short_f) != rot // 2:
        raise ModelLoadError(f"GGUF file {h.path}: longrope factors have {len(long_f)} and {len(short_f)} entries, "
                             f"the rotary size {rot} needs {rot // 2}")
    d["rope_scaling"] = {"rope_type": "longrope", "long_factor": long_f, "short_factor": short_f,
                         "original_max_position_embeddings": orig}
    stored = h.opt("rope.scaling.attn_factor")
    if stored is not None:
        # The converter stores transformers' factor, sqrt(1 + ln(s) / ln(orig)) for a context stretched s times, as
        # float32: where the file holds that value, keep it unrounded.
        s = d["max_position_embeddings"] / orig
        exact = math.sqrt(1 + math.log(s) / math.log(orig)) if s > 1 else 1.0
        d["rope_scaling"]["attention_factor"] = exact if np.float32(exact) == np.float32(stored) else float(stored)


register(Family("phi3", "phi3", _from_phi3, map_phi3, GGUFNames(
    "phi3",
    # Phi-3 keeps its fused [q; k; v] and [gate; up] (ffn_up has 2 * feed_forward_length rows).
    layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    config=_gguf_config, own_rope=True, config_tensors=_ROPE_FACTORS)))
