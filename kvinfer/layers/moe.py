"""Mixture-of-experts MLP: a router, top-k routing, SwiGLU experts run once per step for all the rows they got,
and an optional gated shared expert (Qwen2-MoE / DeepSeek style)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from kvinfer import kernels
from kvinfer.layers.forward_context import get_forward_context, set_forward_context
from kvinfer.layers.mlp import SwiGLU
from kvinfer.layers.quant_linear import KernelLinear, QuantLinear


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, top_k] float32, experts [tokens, top_k]): the softmax
    over every expert, its top_k largest (highest first), renormalised to sum to one when the family does
    (Mixtral always, Qwen-MoE with norm_topk_prob). On float32 CPU it is the C row function the fused decode step
    routes with (kvq_moe_route): torch's softmax and topk are not what the C step can repeat bit for bit."""
    if logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and kernels.available():
        return kernels.moe_route(logits, top_k, renormalise)
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
        # Expert parallelism (kvinfer/parallel/shard.py): the experts this rank computes (None: every one), and the
        # collective that gives every rank each (row, rank) slot from the one rank that computed it.
        self.owned: Optional[frozenset] = None
        self.combine_picked: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        k = self.top_k
        weights, experts = route(self.router(x), k, self.renormalise)  # [tokens, top_k]
        flat = experts.reshape(-1)  # entry i: row i // top_k, rank i % top_k
        order = torch.argsort(flat, stable=True)  # by expert, then by row
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # One row (a single-stream decode step): every expert takes x itself; else the rows gathered once, in
        # expert order, each expert reading its run.
        xs = x if n == 1 else x.index_select(0, order // k)
        ctx = get_forward_context()
        roles = _row_roles(ctx.prompt_spans, n) if ctx.prompt_spans else None
        src = (order // k).tolist() if roles is not None else None
        # each expert's outputs for its rows, in expert order; under expert parallelism the slots of experts other
        # ranks compute stay zero, so that summing the ranks' copies gives each slot its one value exactly
        out = x.new_empty(n * k, h) if self.owned is None else x.new_zeros(n * k, h)
        runs = []  # (expert, start, rows)
        start = 0
        for e, c in enumerate(counts):
            if c:
                if self.owned is None or e in self.owned:
                    runs.append((e, start, c))
                start += c
        if roles is not None:  # the prompt rows among each expert's rows, as spans of its run
            for e, a, c in runs:
                with set_forward_context(replace(ctx, prompt_spans=_spans_of([roles[i] for i in src[a:a + c]]))):
                    out[a:a + c] = self.experts[e](xs if n == 1 else xs[a:a + c])
        else:
            self._experts_into(xs, n, runs, out)
        picked = torch.empty_like(out).index_copy_(0, order, out)  # [tokens * top_k, hidden]: by row, then rank
        if self.combine_picked is not None:
            picked = self.combine_picked(picked)
        picked.mul_(weights.to(x.dtype).reshape(-1, 1))
        picked = picked.view(n, k, h)
        acc = picked[:, 0] if k == 1 else picked[:, 0] + picked[:, 1]  # a row's experts summed in rank order
        for r in range(2, k):
            acc += picked[:, r]
        if self.shared is not None:
            acc = acc + _sigmoid(self.shared_gate(x)) * self.shared(x)
        return acc


    def _experts_into(self, xs: torch.Tensor, n: int, runs: list, out: torch.Tensor) -> None:
        """out[a:a + c] = experts[e](its rows) for each run (e, a, c). Where the experts' gate_up and down are
        kernel matmuls that QuantLinear.forward / KernelLinear.forward would run, the same calls are made here
        directly: every expert's gate_up into one buffer, one SwiGLU row pass over all of it (a row kernel: a
        row's bits are its own), every down straight into out. The same bits as the modules, fewer calls."""
        if not runs:
            return
        inter = self.experts[runs[0][0]].inter
        if not (xs.dtype == torch.float32 and xs.is_cpu and xs.is_contiguous()
                and all(self.experts[e].activation == "silu" for e, _, _ in runs)):
            for e, a, c in runs:
                out[a:a + c] = self.experts[e](xs if n == 1 else xs[a:a + c])
            return
        bi, threads = kernels.batch_invariant(), torch.get_num_threads()
        gu = xs.new_empty(len(out), 2 * inter)
        for e, a, c in runs:
            xe = xs if n == 1 else xs[a:a + c]
            if not _linear_into(self.experts[e].gate_up, xe, gu[a:a + c], bi, threads):
                gu[a:a + c] = self.experts[e].gate_up(xe)
        act = kernels.silu_mul(gu, inter)
        if act is None:
            gate, up = gu.split(inter, dim=-1)
            act = torch.nn.functional.silu(gate) * up
        for e, a, c in runs:
            if not _linear_into(self.experts[e].down, act[a:a + c], out[a:a + c], bi, threads):
                out[a:a + c] = self.experts[e].down(act[a:a + c])


def _linear_into(lin: nn.Module, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool, threads: int) -> bool:
    """out = lin(x) by the kernel call lin's forward would make (x float32 CPU contiguous); False (nothing
    written) where its forward would take another route."""
    if isinstance(lin, QuantLinear):
        if not (batch_invariant or len(x) <= lin.kernel_max_rows):
            return False
        kern = lin._kernel if lin._kernel is not None or lin._kernel_checked else None
        if kern is None and not lin._kernel_checked and lin.prepare_kernel():
            kern = lin._kernel
    elif isinstance(lin, KernelLinear):
        if not (batch_invariant and lin._kernel_checked):
            return False
        kern = lin._kernel
    else:
        return False
    if kern is None or x.shape[1] != lin.in_features:
        return False
    kern.run(x.data_ptr(), len(x), out.data_ptr(), threads)
    return True


def _row_roles(spans, n: int) -> list[bool]:
    """Whether each of a step's n rows is a prompt row (the forward context's prompt spans)."""
    roles = [False] * n
    for a, b in spans:
        roles[a:b] = [True] * (b - a)
    return roles


def _spans_of(roles: list[bool]) -> list[tuple[int, int]]:
    """The runs of True in roles as [start, end) spans."""
    out, start = [], None
    for i, r in enumerate(roles + [False]):
        if r and start is None:
            start = i
        elif not r and start is not None:
            out.append((start, i))
            start = None
    return out


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid, except that on float32 CPU a row's value does not depend on the lane it was computed in
    (torch's vector and tail loops differ in the last bit): silu(g) * 1 from the C row kernel, over g."""
    if g.dtype == torch.float32 and g.is_cpu and kernels.available():
        s = kernels.silu_mul(torch.cat([g, torch.ones_like(g)], dim=1), 1)  # [tokens, 1]: g * sigmoid(g)
        if s is not None:
            return torch.where(g == 0, torch.full_like(g, 0.5), s / g)
    return torch.sigmoid(g)
