"""GPT-2: LayerNorm, learned positions, a GELU MLP, and Conv1D weights stored [in, out]."""
from __future__ import annotations

from typing import Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.errors import UnsupportedError
from kvinfer.models.families.common import GELU_NAMES, Rule, eos_tuple, map_renamed, unsupported_if
from kvinfer.models.families.registry import Family, register


def _from_gpt2(d):
    hidden, heads = d["n_embd"], d["n_head"]
    act = d.get("activation_function", "gelu_new")
    if act not in GELU_NAMES:
        raise UnsupportedError(f"gpt2 activation_function {act!r} is not supported "
                               f"(supported: {', '.join(GELU_NAMES)})")
    # These change the attention scale or add layers; no released checkpoint we target uses them.
    unsupported_if("gpt2", d, "scale_attn_weights", True, True)
    unsupported_if("gpt2", d, "scale_attn_by_inverse_layer_idx", False, False)
    unsupported_if("gpt2", d, "add_cross_attention", False, False)
    return ModelConfig(
        architecture="gpt2",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        num_layers=d["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=d.get("n_positions", 1024),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        norm="layer",
        norm_bias=True,
        position="learned",
        mlp="gelu",
        activation=GELU_NAMES[act],
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _transpose(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    # GPT-2's Conv1D stores [in, out]; nn.Linear wants [out, in].
    return t.t().contiguous()


# Names are the same with or without the "transformer." prefix (the original hub files lack it).
_GLOBAL: dict[str, Rule] = {
    "wte.weight": ("embed.weight", None),
    "wpe.weight": ("pos_embed.weight", None),
    "ln_f.weight": ("norm.weight", None),
    "ln_f.bias": ("norm.bias", None),
    "lm_head.weight": ("lm_head.weight", None),
}
_LAYER: dict[str, Rule] = {
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
_SKIP = frozenset({"attn.bias", "attn.masked_bias"})


def map_gpt2(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return map_renamed(cfg, tensors, _GLOBAL, _LAYER, _SKIP)


register(Family("gpt2", "gpt2", _from_gpt2, map_gpt2))
