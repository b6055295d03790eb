"""One config-driven decoder-only transformer for every supported family."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvinfer.config import ModelConfig
from kvinfer.layers.alibi import alibi_slopes
from kvinfer.layers.attention import Attention, AttentionMetadata
from kvinfer.layers.mlp import GeluMLP, SwiGLU
from kvinfer.layers.moe import MoE
from kvinfer.layers.norm import make_norm
from kvinfer.layers.rotary import RotaryEmbedding
from kvinfer.models.families.gemma3 import SandwichLayer


def make_mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.num_experts:
        return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.activation)
    approx = "tanh" if cfg.activation == "gelu_tanh" else "none"
    return GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, approx)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary):
        super().__init__()
        self.input_norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.attn = Attention(cfg, idx, rotary)
        self.post_attn_norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.mlp = make_mlp(cfg)

    def forward(self, x, positions, md, kv):
        x = x + self.attn(self.input_norm(x), positions, md, kv)
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nn.Module):
    """model(input_ids [tokens], positions [tokens], metadata, kv backend) -> hidden [tokens, hidden]."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.position == "learned" else None
        self.embed_norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias) if cfg.embedding_norm else None
        rotary = local = None
        if cfg.position == "rope":
            rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
            # Gemma 3's windowed layers turn by their own base, unscaled.
            local = rotary if cfg.rope_local_theta is None else RotaryEmbedding(cfg.head_dim, max_positions,
                                                                                cfg.rope_local_theta)
        self.rotary = rotary  # shared by all layers: one cos/sin table
        self.local_rotary = local
        self.register_buffer("alibi", alibi_slopes(cfg.num_heads) if cfg.position == "alibi" else None,
                             persistent=False)
        windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.layers = nn.ModuleList(
            SandwichLayer(cfg, i, local if windows[i] else rotary, make_mlp(cfg)) if cfg.sandwich_norm
            else DecoderLayer(cfg, i, local if windows[i] else rotary) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, kv: Any) -> torch.Tensor:
        x = self.embed(input_ids)  # [tokens, hidden]
        if self.cfg.embed_scale is not None:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)  # rounded to the model dtype, as Gemma does
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, positions, md, kv)
        return self.norm(x)

    def weight_bytes(self) -> int:
        """Bytes held for weights: parameters, quantised blocks (but not those whose pages were given back to their
        kept copy), and any copies kept for prefill (float) or for the kernels' layouts."""
        seen, total = set(), 0
        # A kept weight whose GGUF pages were given back holds no memory of its own (its copy is counted).
        for m in self.modules():
            kept = getattr(m, "_tiles", None)
            if kept is not None and kept.tiles is not None and kept.dropped:
                w = kept.weight
                seen.add((w.untyped_storage().data_ptr(), w.storage_offset(), w.numel()))
        tensors = list(self.parameters()) + list(self.buffers())
        tensors += [m._weight for m in self.modules() if getattr(m, "_weight", None) is not None]
        tensors += [m._tiles.tiles for m in self.modules()
                    if getattr(m, "_tiles", None) is not None and m._tiles.tiles is not None]
        for t in tensors:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied
            logits = (hidden @ self.embed.weight.t()).float()  # [n, vocab]
        else:
            logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
