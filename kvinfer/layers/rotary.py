"""Rotary position embedding (RoPE) with 'linear', 'llama3', 'longrope' and 'yarn' frequency scaling, full or
partial."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvinfer import kernels


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    # Explicitly on the CPU: a model built on the meta device would otherwise trace these ops through
    # torch's decompositions (and import torch._dynamo, seconds of start-up).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None or scaling.type == "longrope":  # longrope: per position, see _tables_longrope
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
    if scaling.type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unknown rope scaling {scaling.type}")


def _yarn_inv_freq(dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original length are divided by the factor
    (interpolated), those turning more than beta_fast times are kept (extrapolated), and a linear ramp over the
    dimensions between blends the two."""
    original = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension band: a step instead of a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (kept), 0: interpolated (divided by the factor)
    # theta^(2i/dim) divided into 1 here, not inv_freq reused, to give transformers' floats
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


class RotaryEmbedding(nn.Module):
    """Applies RoPE in the rotate-half layout (Hugging Face's) to q and k at given positions; with rotary_dim <
    head_dim only the first rotary_dim of each head turn (partial rotary, Phi)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None, rotary_dim=None):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling, rotary_dim)  # to rebuild the tables elsewhere
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
        if scaling is not None and scaling.type == "longrope":
            cos, sin = _longrope_tables(inv_freq, t, scaling)
        else:
            freqs = torch.outer(t, inv_freq)  # [max_pos, dim/2]
            cos, sin = freqs.cos(), freqs.sin()
            if scaling is not None and scaling.type == "yarn":
                cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
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
        cos, sin = (t.unsqueeze(1) for t in self._tables(positions, q.dtype))  # [tokens, 1, rotary_dim/2]
        if self.rotary_dim != self.head_dim:
            r = self.rotary_dim
            return (torch.cat((_rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                    torch.cat((_rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """forward(), except that q and k may be overwritten: float32 CPU tensors are rotated in place by the C
        kernel, in one pass instead of torch's six."""
        if (q.dtype == torch.float32 and q.device.type == "cpu" and self.rotary_dim == self.head_dim
                and kernels.available()):
            if kernels.rope_pair_(q, k, *self._tables(positions, q.dtype)):
                return q, k
        return self(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _longrope_tables(base_inv_freq: torch.Tensor, t: torch.Tensor, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, dim/2] for longrope: positions within the original length turn by the short factors,
    later ones by the long factors, both times the attention factor. transformers picks one set for a whole
    forward by its longest sequence; a per-position choice keeps a token's rotation independent of the rest of
    the batch and of how its prompt was chunked (and agrees with transformers on sequences within the original
    length)."""
    original = scaling.original_max_position_embeddings
    if len(scaling.short_factor) != base_inv_freq.numel() or len(scaling.long_factor) != base_inv_freq.numel():
        raise ValueError(f"longrope factors have {len(scaling.short_factor)} and {len(scaling.long_factor)} "
                         f"entries, the rotary dimension needs {base_inv_freq.numel()}")
    short = base_inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float32, device="cpu")
    long = base_inv_freq / torch.tensor(scaling.long_factor, dtype=torch.float32, device="cpu")
    freqs = torch.where((t < original)[:, None], torch.outer(t, short), torch.outer(t, long))
    return freqs.cos() * scaling.attention_factor, freqs.sin() * scaling.attention_factor
