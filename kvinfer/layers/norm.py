"""RMSNorm and LayerNorm, computed in float32 whatever the model dtype."""
from __future__ import annotations

import torch
from torch import nn

from kvinfer import kernels


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    # The C row kernel: the same function the fused decode step calls, a fixed order per row.
    return x.dtype == torch.float32 and w.dtype == torch.float32 and x.is_cpu and kernels.available()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if _kernel_fits(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF casts back before the weight multiply; matching it keeps bf16 results identical.
        return self.weight * x32.to(dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _kernel_fits(x, self.weight) and (self.bias is None or self.bias.dtype == torch.float32):
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rms" else LayerNorm(dim, eps, bias)
