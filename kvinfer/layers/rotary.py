"""Rotary position embedding (RoPE) with 'linear' and 'llama3' frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvinfer import kernels


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    # Explicitly on the CPU: a model built on the meta device would otherwise trace these ops through
    # torch's decompositions (and import torch._dynamo, seconds of start-up).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        mid = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unknown rope scaling {scaling.type}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE in the rotate-half layout (Hugging Face's) to q and k at given positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
        freqs = torch.outer(t, inv_freq)  # [max_pos, dim/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._last_positions = self._last_dtype = self._last = None

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, dim/2] (contiguous) at positions. Every layer of a step passes the same positions
        tensor: they are looked up once per step."""
        if positions is not self._last_positions or dtype != self._last_dtype:
            self._last = (self.cos[positions].to(dtype), self.sin[positions].to(dtype))
            self._last_positions, self._last_dtype = positions, dtype
        return self._last

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [tokens, heads, dim], k: [tokens, kv_heads, dim]
        cos, sin = (t.unsqueeze(1) for t in self._tables(positions, q.dtype))  # [tokens, 1, dim/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """forward(), except that q and k may be overwritten: float32 CPU tensors are rotated in place by the C
        kernel, in one pass instead of torch's six."""
        if q.dtype == torch.float32 and q.device.type == "cpu" and kernels.available():
            if kernels.rope_pair_(q, k, *self._tables(positions, q.dtype)):
                return q, k
        return self(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
