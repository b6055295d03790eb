"""Mixture-of-experts MLP: a router, top-k routing, SwiGLU experts run once per step for all the rows they got,
and an optional gated shared expert (Qwen2-MoE / DeepSeek style)."""
from __future__ import annotations

import torch
from torch import nn

from kvinfer import kernels
from kvinfer.layers.mlp import SwiGLU


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, top_k] float32, experts [tokens, top_k]): the softmax
    over every expert, its top_k largest (highest first), renormalised to sum to one when the family does
    (Mixtral always, Qwen-MoE with norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoE(nn.Module):
    """Each row goes to its top_k experts; the step's rows are grouped by expert so that an expert's weights are
    read once per step for every row that chose it.

    Exact by construction: every matmul here is row-invariant (the float kernels, or the quantised ones), each
    row's expert outputs land in that row's slot for its rank, and a row's experts are summed in rank order, so
    a row's result never depends on which other rows share the step or its experts.
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalise: bool,
                 shared_inter: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.renormalise = num_experts, top_k, renormalise
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(num_experts))
        self.shared = SwiGLU(hidden, shared_inter) if shared_inter else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_inter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        weights, experts = route(self.router(x), self.top_k, self.renormalise)  # [tokens, top_k]
        weights = weights.to(x.dtype).reshape(-1, 1)  # [tokens * top_k, 1]
        flat = experts.reshape(-1)  # entry i: row i // top_k, rank i % top_k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        picked = x.new_empty(n * self.top_k, h)  # [tokens * top_k, hidden]: each row's expert outputs by rank
        start = 0
        for e, c in enumerate(counts):
            if c:
                idx = order[start:start + c]  # every (row, rank) that chose expert e
                picked[idx] = self.experts[e](x[idx // self.top_k]) * weights[idx]
                start += c
        picked = picked.view(n, self.top_k, h)
        out = picked[:, 0]
        for r in range(1, self.top_k):
            out = out + picked[:, r]
        if self.shared is not None:
            out = out + _sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid, except that on float32 CPU a row's value does not depend on the lane it was computed in
    (torch's vector and tail loops differ in the last bit): silu(g) * 1 from the C row kernel, over g."""
    if g.dtype == torch.float32 and g.is_cpu and kernels.available():
        s = kernels.silu_mul(torch.cat([g, torch.ones_like(g)], dim=1), 1)  # [tokens, 1]: g * sigmoid(g)
        if s is not None:
            return torch.where(g == 0, torch.full_like(g, 0.5), s / g)
    return torch.sigmoid(g)
