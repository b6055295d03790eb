"""Qwen2 and Qwen3 (dense): the Llama shape with q/k/v biases (Qwen2) or q/k norms (Qwen3), and their window rule."""
from __future__ import annotations

from typing import Optional

from kvinfer.errors import UnsupportedError
from kvinfer.models.families.llama import llama_like, map_llama
from kvinfer.models.families.registry import Family, GGUFNames, register


def qwen_window(d: dict, arch: str) -> Optional[int]:
    """Qwen2/3 window every layer or none: HF applies it only with use_sliding_window, from max_window_layers on."""
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    if window is None:
        return None
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                                     for i in range(n)]
    sliding = sum(t == "sliding_attention" for t in types)
    if sliding == 0:
        return None
    if sliding != len(types):
        raise UnsupportedError(f"{arch} with sliding-window attention on only some layers ({sliding} of {len(types)}) "
                               "is not supported (supported: all layers or none)")
    return int(window)


def _from_qwen2(d):
    # Qwen2 hard-wires biases on q/k/v only.
    return llama_like(d, "qwen2", sliding_window=qwen_window(d, "qwen2"), qkv_bias=True, o_bias=False,
                      mlp_bias=False)


def _from_qwen3(d):
    return llama_like(d, "qwen3", head_dim_default=128, sliding_window=qwen_window(d, "qwen3"), qk_norm=True,
                      mlp_bias=False)


register(Family("qwen2", "qwen2", _from_qwen2, map_llama, GGUFNames("qwen2")))
register(Family("qwen3", "qwen3", _from_qwen3, map_llama, GGUFNames("qwen3")))
