"""Tensor-parallel sharding of a loaded Decoder, from outside: heads, MLP and vocabulary split across ranks."""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvinfer.config import ModelConfig
from kvinfer.errors import UnsupportedError, ValidationError
from kvinfer.layers.mlp import SwiGLU
from kvinfer.layers.moe import MoE
from kvinfer.layers.quant_linear import KernelLinear, QuantLinear, QuantParts
from kvinfer.loaders.dequant import block_info
from kvinfer.options import options


def _fits(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
    if cfg.num_experts:  # experts are dealt out to the ranks whole (every layer is a mixture: no dense MLP to split)
        return tp <= cfg.num_experts and cfg.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    return (cfg.num_heads % tp == 0 and cfg.intermediate_size % tp == 0
            and (kv % tp == 0 or tp % kv == 0))


def valid_sizes(cfg: ModelConfig) -> list[int]:
    return [t for t in range(1, cfg.num_heads + 1) if _fits(cfg, t)]


def check_tp_size(cfg: ModelConfig, tp: int, param: str = "tensor_parallel_size") -> None:
    """A one-line error naming the head counts and the sizes that work."""
    if tp < 1:
        raise ValidationError(param, tp, "must be >= 1")
    if not _fits(cfg, tp):
        sizes = ", ".join(map(str, valid_sizes(cfg)))
        width = (f"be at most the {cfg.num_experts} experts" if cfg.num_experts
                 else f"divide the {cfg.intermediate_size} MLP width")
        raise ValidationError(param, tp, f"must divide the {cfg.num_heads} attention heads, {width}, and divide or "
                                         f"be a multiple of the {cfg.num_kv_heads} KV heads; sizes that work for "
                                         f"this model: {sizes}")


def kv_heads_per_rank(cfg: ModelConfig, tp: int, param: str = "tensor_parallel_size") -> int:
    """KV heads each rank holds: split when they divide, one replicated head when there are fewer than ranks."""
    check_tp_size(cfg, tp, param)
    return max(1, cfg.num_kv_heads // tp)


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank computes with (heads, KV heads, MLP width); what the KV cache of a rank is sized by."""
    return cfg.replace(num_heads=cfg.num_heads // tp, num_kv_heads=kv_heads_per_rank(cfg, tp),
                       intermediate_size=cfg.intermediate_size // tp)


def exact_mode() -> bool:
    """Whether the attention output and MLP down projections keep TP 1's bits (KVINFER_TP_EXACT, default 1).

    Exact: the projection's input is all-gathered and each rank computes whole output values for its share of the
    outputs, then those are all-gathered (2 all-gathers). Off: Megatron's row-parallel split, each rank a partial
    sum over its inputs and one all-reduce: half the collectives, but the sum's other order changes last bits,
    which the quantized kernels' int16 rounding of activations then amplifies (~1e-3 in logprobs, same tokens).
    """
    return options().tp_exact


@dataclass
class CommStats:
    """Time rank 0 spends in the forward's collectives, the logits gather and sending each step's plan."""

    allreduce_s: float = 0.0  # the decoder layers' collectives (all-reduces, or all-gathers in exact mode)
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    head_s: float = 0.0  # gathering the vocabulary slices of the logits to rank 0
    broadcast_s: float = 0.0
    steps: int = 0
    collective: str = "all-reduce"  # what allreduce_* count: "all-reduce" or "all-gather"

    def reset(self) -> None:
        self.allreduce_s = self.head_s = self.broadcast_s = 0.0
        self.allreduce_calls = self.allreduce_bytes = self.steps = 0


class CollectiveModule(nn.Module):
    """A sharded module whose forward runs a collective on `group` (set once the ranks have met)."""

    def __init__(self, group, stats: CommStats):
        super().__init__()
        self.group = group
        self.stats = stats

    def _timed(self, y: torch.Tensor, op) -> float:
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)  # time the collective, not the queued GEMM before it
        t0 = time.perf_counter()
        op()
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)
        return time.perf_counter() - t0

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, k] on every rank -> [tokens, tp * k], rank 0's columns first."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        self.stats.allreduce_s += self._timed(x, lambda: dist.all_gather(parts, x, group=self.group))
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += x.numel() * x.element_size() * len(parts)
        return torch.cat(parts, dim=-1)


class RowParallel(CollectiveModule):
    """y = all_reduce(x_r @ W_r^T) + b: rank r holds the input columns of its own heads or MLP slice."""

    def __init__(self, inner: nn.Module, bias: Optional[torch.Tensor], group, stats: CommStats):
        super().__init__(group, stats)
        self.inner = inner  # no bias of its own: added once, after the sum
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # [tokens, out]: this rank's partial sum
        self.stats.allreduce_s += self._timed(y, lambda: dist.all_reduce(y, group=self.group))
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += y.numel() * y.element_size()
        return y if self.bias is None else y + self.bias


class ExpertSum(CollectiveModule):
    """Expert parallelism's one collective per layer: each (row, rank) slot of a step's expert outputs was
    computed by exactly one rank and is zero on the others, so the all-reduce's sum is that value exactly, on every
    rank, whatever order the sum takes. A row's experts are then weighted and summed in rank order, as at TP 1."""

    def forward(self, picked: torch.Tensor) -> torch.Tensor:
        picked = picked.contiguous()
        self.stats.allreduce_s += self._timed(picked, lambda: dist.all_reduce(picked, group=self.group))
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += picked.numel() * picked.element_size()
        return picked


def shard_experts(moe: MoE, rank: int, tp: int, group, stats: CommStats) -> None:
    """Rank r keeps experts r, r + tp, r + 2 tp, ... whole (the others' weights are dropped); the router and a
    shared expert stay on every rank. Whole experts keep every matmul TP 1's: no block of a GGUF row is cut."""
    owned = frozenset(range(rank, moe.num_experts, tp))
    for e in range(moe.num_experts):
        if e not in owned:
            moe.experts[e] = nn.Identity()  # a placeholder that keeps the experts' numbering
    moe.owned = owned
    moe.combine_picked = ExpertSum(group, stats)


def _padded(y: torch.Tensor, total: int, group) -> torch.Tensor:
    """A rank's share of `total` outputs, zero-padded to the first ranks' ceil(total / tp): gathers need equal sizes."""
    per = -(-total // dist.get_world_size(group))
    return y if y.shape[-1] == per else torch.nn.functional.pad(y, (0, per - y.shape[-1]))


class GatherParallel(CollectiveModule):
    """y = all_gather(all_gather(x_r) @ W_r^T + b_r): TP 1's bits, since each output value is computed whole.

    Rank r holds the input columns x_r of its heads or MLP slice, and output rows [r*per, (r+1)*per) of W (the last
    rank fewer when tp does not divide them; padded for the gather). No partial sums, so no split of a GGUF block.
    """

    def __init__(self, inner: nn.Module, out_features: int, group, stats: CommStats):
        super().__init__(group, stats)
        self.inner = inner
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(self._all_gather(x))  # [tokens, my rows], from the whole input row
        return self._all_gather(_padded(y, self.out_features, self.group))[:, :self.out_features]


class VocabParallelHead(CollectiveModule):
    """The LM head over rank r's vocabulary rows; rank 0 gathers every slice: [tokens, vocab] there, the slice
    elsewhere (only rank 0 samples). Each logit is computed whole, as at TP 1."""

    def __init__(self, inner: nn.Module, vocab: int, rank: int, group, stats: CommStats):
        super().__init__(group, stats)
        self.inner = inner
        self.vocab, self.rank = vocab, rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = _padded(self.inner(h).float(), self.vocab, self.group).contiguous()  # [tokens, my vocabulary rows]
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))] if self.rank == 0 else None
        # dst is a global rank: the engine's rank 0, a member of every group
        self.stats.head_s += self._timed(y, lambda: dist.gather(y, parts, dst=0, group=self.group))
        return torch.cat(parts, dim=-1)[:, :self.vocab] if self.rank == 0 else y


def _take_rows(m: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Column-parallel: the output rows `rows` of a linear (float or GGML blocks; GGML rows are independent)."""
    if isinstance(m, QuantParts):  # parts of other types (Q4_K_M's q/k Q4_K, v Q6_K): each run of rows from its part
        starts = list(itertools.accumulate((p.out_features for p in m.parts[:-1]), initial=0))
        runs: list[tuple[int, list[int]]] = []  # (part, its local rows), in the order of `rows`
        for r in rows.tolist():
            i = bisect.bisect_right(starts, r) - 1
            if runs and runs[-1][0] == i:
                runs[-1][1].append(r - starts[i])
            else:
                runs.append((i, [r - starts[i]]))
        return QuantParts([_take_rows(m.parts[i], torch.tensor(local)) for i, local in runs])
    rows = rows.to(m.raw.device if isinstance(m, QuantLinear) else m.weight.device)
    bias = None if m.bias is None else m.bias.detach()[rows].clone()
    if isinstance(m, QuantLinear):
        q = QuantLinear(m.source().index_select(0, rows), m.qtype, (len(rows), m.in_features), bias,
                        kernel_max_rows=m.kernel_max_rows, keep_dequantized=m.keep_dequantized)
        if m._weight is not None:
            q._weight = m._weight.index_select(0, rows)  # the prefill copy, without dequantizing again
        return q
    return _float_linear(m, m.weight.detach().index_select(0, rows), bias)


def _float_linear(like: nn.Module, w: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Module:
    """A float linear over `w` of the same kind as `like` (KernelLinear keeps rows batch-invariant on CPU)."""
    w = w.contiguous()
    if isinstance(like, KernelLinear):
        return KernelLinear(w, bias)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _take_cols(m: nn.Module, k0: int, k1: int, name: str, group, stats: CommStats) -> RowParallel:
    """Row-parallel: input columns [k0, k1) of a linear, summed over ranks; GGML splits fall on whole blocks."""
    bias = None
    if m.bias is not None:
        bias = m.bias.detach().float().clone() if isinstance(m, QuantLinear) else m.bias.detach().clone()
    if isinstance(m, QuantLinear):
        elems, nbytes = block_info(m.qtype)
        if k0 % elems or k1 % elems:
            raise UnsupportedError(
                f"tensor parallel: {name} ({m.qtype}, {m.in_features} inputs) would be split at input "
                f"{k0 if k0 % elems else k1}, inside a {elems}-value {m.qtype} block; GGUF blocks cannot be cut (use another "
                f"--tensor-parallel-size, or --quantization none to shard dequantized weights)")
        raw = m.source()[:, k0 // elems * nbytes:k1 // elems * nbytes]
        inner = QuantLinear(raw.contiguous(), m.qtype, (m.out_features, k1 - k0), None,
                            kernel_max_rows=m.kernel_max_rows, keep_dequantized=m.keep_dequantized)
        if m._weight is not None:
            inner._weight = m._weight[:, k0:k1].contiguous()
    else:
        inner = _float_linear(m, m.weight.detach()[:, k0:k1], None)
    return RowParallel(inner, bias, group, stats)


def _row_range(m: nn.Module, r0: int, r1: int) -> nn.Module:
    """Output rows [r0, r1) of a linear as a view where it can be (a tied head's rows are the embedding's bytes)."""
    if isinstance(m, QuantLinear):
        q = QuantLinear(m.source()[r0:r1], m.qtype, (r1 - r0, m.in_features),
                        None if m.bias is None else m.bias[r0:r1].clone(), kernel_max_rows=m.kernel_max_rows,
                        keep_dequantized=m.keep_dequantized)
        if m._weight is not None:
            q._weight = m._weight[r0:r1]
        return q
    w = m.weight.detach()[r0:r1]
    bias = None if getattr(m, "bias", None) is None else m.bias.detach()[r0:r1]
    return KernelLinear(w, bias) if isinstance(m, KernelLinear) else _float_linear(m, w, bias)


def shard_lm_head(model: nn.Module, cfg: ModelConfig, rank: int, tp: int, group, stats: CommStats) -> None:
    """Vocabulary-parallel LM head: rank r computes the logits of vocabulary rows [r*per, (r+1)*per)."""
    head = model.lm_head if model.lm_head is not None else model.embed  # tied, float: the embedding's matrix
    per = -(-cfg.vocab_size // tp)
    r0, r1 = min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size)
    model.lm_head = VocabParallelHead(_row_range(head, r0, r1), cfg.vocab_size, rank, group, stats)


def shard_decoder(model: nn.Module, cfg: ModelConfig, rank: int, tp: int, group, stats: CommStats,
                  exact: Optional[bool] = None) -> nn.Module:
    """Shard a loaded Decoder in place for rank `rank` of `tp` (Megatron-style; the embedding stays replicated).

    Attention: the fused QKV keeps the rows of this rank's query heads and KV heads (column-parallel). When there
    are fewer KV heads than ranks, rank r keeps KV head r // (tp / kv_heads): KV heads are replicated, as vLLM
    does. MLP: gate-up (or up) column-parallel. The attention output and MLP down projections: exact (default,
    see exact_mode) or row-parallel with one all-reduce each. Mixture of experts: whole experts dealt out to the
    ranks (shard_experts), exact either way. LM head: vocabulary-parallel, gathered to rank 0.
    """
    check_tp_size(cfg, tp)
    exact = exact_mode() if exact is None else exact
    stats.collective = "all-gather" if exact else "all-reduce"
    hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    h_loc = h // tp
    kv_loc = kv_heads_per_rank(cfg, tp)
    kv_first = rank * kv_loc if kv >= tp else rank // (tp // kv)
    q0, kv0 = rank * h_loc * hd, kv_first * hd
    inter, i_loc = cfg.intermediate_size, cfg.intermediate_size // tp
    i0 = rank * i_loc

    def ar(*ranges):  # row indices of several [start, end) ranges, in order
        return torch.cat([torch.arange(a, b) for a, b in ranges])

    def second(m: nn.Module, k0: int, k1: int, name: str) -> nn.Module:  # the projection after the split one
        if not exact:
            return _take_cols(m, k0, k1, name, group, stats)
        per = -(-m.out_features // tp)
        o0, o1 = min(rank * per, m.out_features), min((rank + 1) * per, m.out_features)
        return GatherParallel(_take_rows(m, torch.arange(o0, o1)), m.out_features, group, stats)

    for i, layer in enumerate(model.layers):
        a = layer.attn
        qkv_rows = ar((q0, q0 + h_loc * hd), (cfg.q_size + kv0, cfg.q_size + kv0 + kv_loc * hd),
                      (cfg.q_size + cfg.kv_size + kv0, cfg.q_size + cfg.kv_size + kv0 + kv_loc * hd))
        a.qkv = _take_rows(a.qkv, qkv_rows)
        a.o = second(a.o, q0, q0 + h_loc * hd, f"layer {i} attention output")
        a.num_heads, a.num_kv_heads = h_loc, kv_loc
        a.q_size, a.kv_size = h_loc * hd, kv_loc * hd
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            shard_experts(mlp, rank, tp, group, stats)
            continue
        if isinstance(mlp, SwiGLU):
            mlp.gate_up = _take_rows(mlp.gate_up, ar((i0, i0 + i_loc), (inter + i0, inter + i0 + i_loc)))
            mlp.inter = i_loc
        else:
            mlp.up = _take_rows(mlp.up, ar((i0, i0 + i_loc)))
        mlp.down = second(mlp.down, i0, i0 + i_loc, f"layer {i} MLP down")
    if getattr(model, "alibi", None) is not None:
        model.alibi = model.alibi[rank * h_loc:(rank + 1) * h_loc].clone()  # this rank's heads' slopes
    shard_lm_head(model, cfg, rank, tp, group, stats)
    return model
