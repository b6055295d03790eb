"""BLOOM: LayerNorm, ALiBi, a norm on the embeddings, and q/k/v fused per head in the checkpoint."""
from __future__ import annotations

from typing import Iterable

import torch

from kvinfer.config import ModelConfig
from kvinfer.models.families.common import Rule, eos_tuple, map_renamed, unsupported_if
from kvinfer.models.families.registry import Family, register


def _from_bloom(d):
    hidden = d.get("hidden_size") or d.get("n_embed") or 64
    heads = d.get("n_head") or d.get("num_attention_heads") or 8
    # The residual taken after the norm is a different block wiring; no released BLOOM uses it.
    unsupported_if("bloom", d, "apply_residual_connection_post_layernorm", False, False)
    return ModelConfig(
        architecture="bloom",
        vocab_size=d.get("vocab_size", 250880),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=d.get("n_layer") or d.get("num_hidden_layers") or 2,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        # ALiBi has no table to outgrow; this only bounds max_model_len by default.
        max_position_embeddings=d.get("seq_length") or 2048,
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        norm="layer",
        norm_bias=True,
        position="alibi",
        mlp="gelu",
        activation="gelu_tanh",  # bloom_gelu_forward: the tanh approximation
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        embedding_norm=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def _qkv(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    # BLOOM fuses q/k/v per head: rows are [heads, 3, head_dim]; ours are [q heads; k heads; v heads].
    h, d = cfg.num_heads, cfg.head_dim
    parts = t.reshape(h, 3, d, *t.shape[1:])  # [heads, 3, dim, (hidden)]
    return torch.cat([parts[:, j].reshape(h * d, *t.shape[1:]) for j in range(3)], dim=0)


_GLOBAL: dict[str, Rule] = {
    "word_embeddings.weight": ("embed.weight", None),
    "word_embeddings_layernorm.weight": ("embed_norm.weight", None),
    "word_embeddings_layernorm.bias": ("embed_norm.bias", None),
    "ln_f.weight": ("norm.weight", None),
    "ln_f.bias": ("norm.bias", None),
    "lm_head.weight": ("lm_head.weight", None),
}
_LAYER: dict[str, Rule] = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "input_layernorm.bias": ("input_norm.bias", None),
    "self_attention.query_key_value.weight": ("attn.qkv.weight", _qkv),
    "self_attention.query_key_value.bias": ("attn.qkv.bias", _qkv),
    "self_attention.dense.weight": ("attn.o.weight", None),
    "self_attention.dense.bias": ("attn.o.bias", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
    "post_attention_layernorm.bias": ("post_attn_norm.bias", None),
    "mlp.dense_h_to_4h.weight": ("mlp.up.weight", None),
    "mlp.dense_h_to_4h.bias": ("mlp.up.bias", None),
    "mlp.dense_4h_to_h.weight": ("mlp.down.weight", None),
    "mlp.dense_4h_to_h.bias": ("mlp.down.bias", None),
}


def map_bloom(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return map_renamed(cfg, tensors, _GLOBAL, _LAYER)


register(Family("bloom", "bloom", _from_bloom, map_bloom))
