"""Phi-3 / Phi-4-mini: q, k, v and gate, up come fused in the checkpoint, in the decoder's own order."""
from __future__ import annotations

from typing import Iterable

import torch

from kvinfer.config import ModelConfig

# Rows [q; k; v] and [gate; up]: the decoder's fused parameters already, taken whole.
HF_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": "attn.qkv.weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up.weight",
}


def map_phi3(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from kvinfer.models.weights import map_llama

    return map_llama(cfg, tensors, HF_LAYER_NAMES)
