"""Tensor-parallel sharding of a loaded Decoder, from outside: heads and MLP columns split, one all-reduce each."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvinfer.config import ModelConfig
from kvinfer.errors import UnsupportedError, ValidationError
from kvinfer.layers.mlp import SwiGLU
from kvinfer.layers.quant_linear import KernelLinear, QuantLinear
from kvinfer.loaders.dequant import block_info


def _fits(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
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
        raise ValidationError(param, tp, f"must divide the {cfg.num_heads} attention heads and the "
                                         f"{cfg.intermediate_size} MLP width, and divide or be a multiple of the "
                                         f"{cfg.num_kv_heads} KV heads; sizes that work for this model: {sizes}")


def kv_heads_per_rank(cfg: ModelConfig, tp: int, param: str = "tensor_parallel_size") -> int:
    """KV heads each rank holds: split when they divide, one replicated head when there are fewer than ranks."""
    check_tp_size(cfg, tp, param)
    return max(1, cfg.num_kv_heads // tp)


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank computes with (heads, KV heads, MLP width); what the KV cache of a rank is sized by."""
    return cfg.replace(num_heads=cfg.num_heads // tp, num_kv_heads=kv_heads_per_rank(cfg, tp),
                       intermediate_size=cfg.intermediate_size // tp)


@dataclass
class CommStats:
    """Time rank 0 spends in the forward's all-reduces and in sending each step's plan."""

    allreduce_s: float = 0.0
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    broadcast_s: float = 0.0
    steps: int = 0

    def reset(self) -> None:
        self.allreduce_s = self.broadcast_s = 0.0
        self.allreduce_calls = self.allreduce_bytes = self.steps = 0


class RowParallel(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: rank r holds the input columns of its own heads or MLP slice."""

    def __init__(self, inner: nn.Module, bias: Optional[torch.Tensor], group, stats: CommStats):
        super().__init__()
        self.inner = inner  # no bias of its own: added once, after the sum
        self.register_buffer("bias", bias)
        self.group = group
        self.stats = stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # [tokens, out]: this rank's partial sum
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)  # time the collective, not the queued GEMM before it
        t0 = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)
        self.stats.allreduce_s += time.perf_counter() - t0
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += y.numel() * y.element_size()
        return y if self.bias is None else y + self.bias


def _take_rows(m: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Column-parallel: the output rows `rows` of a linear (float or GGML blocks; GGML rows are independent)."""
    rows = rows.to(m.raw.device if isinstance(m, QuantLinear) else m.weight.device)
    bias = None if m.bias is None else m.bias.detach()[rows].clone()
    if isinstance(m, QuantLinear):
        q = QuantLinear(m.raw.index_select(0, rows), m.qtype, (len(rows), m.in_features), bias,
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
        raw = m.raw[:, k0 // elems * nbytes:k1 // elems * nbytes]
        inner = QuantLinear(raw.contiguous(), m.qtype, (m.out_features, k1 - k0), None,
                            kernel_max_rows=m.kernel_max_rows, keep_dequantized=m.keep_dequantized)
        if m._weight is not None:
            inner._weight = m._weight[:, k0:k1].contiguous()
    else:
        inner = _float_linear(m, m.weight.detach()[:, k0:k1], None)
    return RowParallel(inner, bias, group, stats)


def shard_decoder(model: nn.Module, cfg: ModelConfig, rank: int, tp: int, group, stats: CommStats) -> nn.Module:
    """Shard a loaded Decoder in place for rank `rank` of `tp` (Megatron-style; embedding and LM head replicated).

    Attention: the fused QKV keeps the rows of this rank's query heads and KV heads (column-parallel), the output
    projection the matching input columns (row-parallel, one all-reduce). When there are fewer KV heads than
    ranks, rank r keeps KV head r // (tp / kv_heads): KV heads are replicated, as vLLM does. MLP: gate-up (or up)
    column-parallel, down row-parallel, one all-reduce.
    """
    check_tp_size(cfg, tp)
    hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    h_loc = h // tp
    kv_loc = kv_heads_per_rank(cfg, tp)
    kv_first = rank * kv_loc if kv >= tp else rank // (tp // kv)
    q0, kv0 = rank * h_loc * hd, kv_first * hd
    inter, i_loc = cfg.intermediate_size, cfg.intermediate_size // tp
    i0 = rank * i_loc

    def ar(*ranges):  # row indices of several [start, end) ranges, in order
        return torch.cat([torch.arange(a, b) for a, b in ranges])

    for i, layer in enumerate(model.layers):
        a = layer.attn
        qkv_rows = ar((q0, q0 + h_loc * hd), (cfg.q_size + kv0, cfg.q_size + kv0 + kv_loc * hd),
                      (cfg.q_size + cfg.kv_size + kv0, cfg.q_size + cfg.kv_size + kv0 + kv_loc * hd))
        a.qkv = _take_rows(a.qkv, qkv_rows)
        a.o = _take_cols(a.o, q0, q0 + h_loc * hd, f"layer {i} attention output", group, stats)
        a.num_heads, a.num_kv_heads = h_loc, kv_loc
        a.q_size, a.kv_size = h_loc * hd, kv_loc * hd
        mlp = layer.mlp
        if isinstance(mlp, SwiGLU):
            mlp.gate_up = _take_rows(mlp.gate_up, ar((i0, i0 + i_loc), (inter + i0, inter + i0 + i_loc)))
            mlp.inter = i_loc
        else:
            mlp.up = _take_rows(mlp.up, ar((i0, i0 + i_loc)))
        mlp.down = _take_cols(mlp.down, i0, i0 + i_loc, f"layer {i} MLP down", group, stats)
    if getattr(model, "alibi", None) is not None:
        model.alibi = model.alibi[rank * h_loc:(rank + 1) * h_loc].clone()  # this rank's heads' slopes
    return model

