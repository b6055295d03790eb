"""Feed-forward blocks: SwiGLU (fused gate+up; GeGLU with a GELU gate) and the classic GELU MLP."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvinfer import kernels


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.inter = inter
        self.activation = activation  # silu | gelu_tanh (Gemma's gated GELU)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=bias)  # gate and up fused: one GEMM
        self.down = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)  # [tokens, 2 * inter]
        if self.activation != "silu":
            gate, up = gu.split(self.inter, dim=-1)
            return self.down(_gelu(gate, "tanh" if self.activation == "gelu_tanh" else "none") * up)
        act = kernels.silu_mul(gu, self.inter)  # one pass in C for float32 CPU [tokens, 2 * inter]; else None
        if act is None:
            gate, up = gu.split(self.inter, dim=-1)
            act = F.silu(gate) * up
        return self.down(act)


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        self.up = nn.Linear(hidden, inter, bias=bias)
        self.down = nn.Linear(inter, hidden, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_gelu(self.up(x), self.approximate))


def _gelu(h: torch.Tensor, approximate: str) -> torch.Tensor:
    if h.dtype == torch.float32 and h.is_cpu and kernels.available():
        return kernels.gelu(h, approximate)  # elementwise in C: same bits in any lane
    return F.gelu(h, approximate=approximate)
