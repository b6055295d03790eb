"""Self-attention over a flat batch of tokens; the KV backend and metadata come in as arguments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from kvinfer.layers.norm import RMSNorm


@dataclass
class AttnGroup:
    """Sequences attended together: one prefill (or chunk), or every single-token decode of a step.

    Tokens of a group are a contiguous range of the flat batch, `num_seqs * q_len` of them.
    """

    start: int
    end: int
    num_seqs: int
    q_len: int
    ctx_len: int  # keys per sequence after padding
    mask: Optional[torch.Tensor] = None  # [b, 1|heads, q_len, ctx_len]: bool (True = attend) or additive float
    is_causal: bool = False  # the plain causal case: q_len == ctx_len, no padding, no window, no bias
    gather_idx: Optional[torch.Tensor] = None  # [b, blocks]: the block tables the paged backend gathers
    slot_ids: Optional[torch.Tensor] = None  # [b] rows of a contiguous cache
    q_pos: Optional[torch.Tensor] = None  # [b, q_len] query positions (what a per-layer window mask is built from)
    lens: Optional[torch.Tensor] = None  # [b] keys per sequence before padding
    window_masks: dict = field(default_factory=dict)  # window -> mask, for layers with their own window

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a layer that windows while the model's other layers do not (Gemma 3), built once a step."""
        if window not in self.window_masks:
            k_pos = torch.arange(self.ctx_len, device=self.q_pos.device).expand(self.num_seqs, self.ctx_len)
            self.window_masks[window] = build_mask(self.q_pos, k_pos, k_pos < self.lens[:, None], window, None)
        return self.window_masks[window]


@dataclass
class KernelAttn:
    """The whole step for the attention kernel (kvinfer.kernels.attention): every query token, its sequence and
    position, and how to find a sequence's keys: table[p // block_size] * strides[0] + (p % block_size) *
    strides[1] + kv_head * strides[2] floats into the backend's K (V) tensor."""

    tables: torch.Tensor  # [sequences, blocks] int64
    tok_seq: torch.Tensor  # [tokens] int64
    tok_pos: torch.Tensor  # [tokens] int64
    block_size: int
    num_blocks: int
    decode_only: bool  # every sequence decodes one token (with one row of tables each, in token order)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    groups: list[AttnGroup]
    slot_mapping: Optional[torch.Tensor] = None  # [tokens] flat cache slot each new K/V is written to
    slot_ids: Optional[torch.Tensor] = None  # [tokens] contiguous backend: cache row per token
    positions: Optional[torch.Tensor] = None  # [tokens]
    kernel: Optional[KernelAttn] = None  # set when the attention kernel serves every token of the step
    extra: dict = field(default_factory=dict)


def build_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
               sliding_window: Optional[int], alibi: Optional[torch.Tensor]) -> torch.Tensor:
    """q_pos [b, q], k_pos [b, L], k_valid [b, L] -> [b, 1|heads, q, L] mask (bool, or float with ALiBi)."""
    rel = k_pos[:, None, :] - q_pos[:, :, None]  # [b, q, L] key position minus query position
    allowed = (rel <= 0) & k_valid[:, None, :]
    if sliding_window is not None:
        allowed &= rel > -sliding_window
    if alibi is None:
        return allowed[:, None]
    bias = alibi[None, :, None, None] * rel[:, None].float()  # [b, heads, q, L]
    return bias.masked_fill(~allowed[:, None], float("-inf"))


class Attention(nn.Module):
    """Multi-head attention with grouped/multi-query K/V, optional biases, q/k norm and RoPE."""

    def __init__(self, cfg, layer_idx: int, rotary: Optional[nn.Module]):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.scale = cfg.attn_scale or self.head_dim ** -0.5
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None  # this layer's own window
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)  # fused: one GEMM
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, kv: Any) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [tokens, heads, dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, dim]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary.rotate_(positions, q, k)  # q, k are this layer's own: may rotate in place
        kv.store(self.layer_idx, k, v, md)
        if md.kernel is not None:
            return self.o(kv.attend(self.layer_idx, q, k, v, md, self.scale, self.window).view(n, self.q_size))
        if len(md.groups) == 1:
            out = self._attend(md.groups[0], q, k, v, kv)
        else:
            out = torch.cat([self._attend(g, q, k, v, kv) for g in md.groups], dim=0)
        return self.o(out)

    def _attend(self, g: AttnGroup, q, k, v, kv) -> torch.Tensor:
        keys, values = kv.gather(self.layer_idx, g, k, v)  # [b, kv_heads, L, dim]
        qg = q[g.start:g.end].view(g.num_seqs, g.q_len, self.num_heads, self.head_dim).transpose(1, 2)
        mask, causal = (g.mask, g.is_causal) if self.window is None else (g.window_mask(self.window), False)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(qg.dtype)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return o.transpose(1, 2).reshape(g.num_seqs * g.q_len, self.q_size)  # [tokens, heads * dim]
