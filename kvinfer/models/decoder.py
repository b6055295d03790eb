"""One config-driven decoder-only transformer for every supported family."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvinfer.config import ModelConfig
from kvinfer.layers.alibi import alibi_slopes
from kvinfer.layers.attention import Attention, AttentionMetadata
from kvinfer.layers.mlp import GeluMLP, SwiGLU
from kvinfer.layers.norm import make_norm
from kvinfer.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary):
        super().__init__()
        self.input_norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.attn = Attention(cfg, idx, rotary)
        self.post_attn_norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        if cfg.mlp == "swiglu":
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            approx = "tanh" if cfg.activation == "gelu_tanh" else "none"
            self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, approx)

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
        rotary = None
        if cfg.position == "rope":
            rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary  # shared by all layers: one cos/sin table
        self.register_buffer("alibi", alibi_slopes(cfg.num_heads) if cfg.position == "alibi" else None,
                             persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, kv: Any) -> torch.Tensor:
        x = self.embed(input_ids)  # [tokens, hidden]
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, positions, md, kv)
        return self.norm(x)

    def weight_bytes(self) -> int:
        """Bytes held for weights: parameters, quantised blocks, and any copies kept for prefill (float) or for
        AMX tiles."""
        seen, total = set(), 0
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
            return (hidden @ self.embed.weight.t()).float()  # [n, vocab]
        return self.lm_head(hidden).float()
