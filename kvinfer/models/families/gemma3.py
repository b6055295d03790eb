"""Gemma 3 (text): the sandwich-norm block and the Hugging Face weight names ((1 + w) norms folded at load)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kvinfer.config import ModelConfig
from kvinfer.layers.attention import Attention
from kvinfer.layers.norm import RMSNorm

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
    from kvinfer.models.weights import map_llama

    out = map_llama(cfg, tensors, HF_LAYER_NAMES)
    if norms_hold_one:
        return out
    # Gemma's RMSNorm scales by (1 + w); adding the one here, in float32 as transformers does, leaves the usual norm.
    for name, t in out.items():
        if name.endswith("norm.weight"):
            out[name] = t.float() + 1.0
    return out
