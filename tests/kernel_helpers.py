"""What the kernel tests share: error bounds, the levels this machine runs, a reference for the types whose every
weight is a Q8_0 weight, and running a model with the fused decode step on or off (and seeing that it ran)."""
from __future__ import annotations

from contextlib import contextmanager

import gguf
import numpy as np
import torch

from kvinfer import kernels
from kvinfer.loaders.dequant import IQ4NL_VALUES, block_info
from kvinfer.engine.model_runner import ModelRunner
from kvinfer.models.fused_decode import FusedDecode

# Float arithmetic against a float64 reference: observed up to 2e-6 of max|y| at K=1536; the bound leaves 10x
# room while still catching any wrong element, block scale or offset (those give errors of order 1e-2 and up).
TOL = 2e-5
# Quantised weights: x is rounded to 16 bits per 32-element block first: observed up to 5e-5 of max|y|, so 2e-4
# still catches any wrong element, scale or offset. Against the float64 product of x rounded the same way it is
# as exact as float arithmetic (TOL).
TOL_I16 = 2e-4
AMX = kernels.cpu_features()["amx_granted"] and kernels.best_level() == "avx512"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def as_q8_0(data: np.ndarray, tname: str) -> np.ndarray:
    """Q5_0 or IQ4_NL blocks (uint8, any shape whose last axis holds whole blocks) as Q8_0 blocks with the same d and
    the same integer per weight (Q5_0: q - 16; IQ4_NL: its table's entry): uint8 [..., blocks * 34]. Every weight of
    those types is d times a small integer, so the kernels must give these blocks' Q8_0 bits (the loader once
    rewrote both types this way)."""
    bb = block_info(tname)[1]
    lead = data.shape[:-1]
    blk = np.ascontiguousarray(data).reshape(-1, bb)
    out = np.empty((blk.shape[0], 34), dtype=np.uint8)
    out[:, :2] = blk[:, :2]  # d
    if tname == "Q5_0":
        qh = blk[:, 2:6].copy().view("<u4")  # [n, 1]: bit j is the fifth bit of weight j
        qs = blk[:, 6:22]
        bits = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [n, 32]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16) | (bits.astype(np.int16) << 4)
        out[:, 2:] = (q - 16).astype(np.int8).view(np.uint8)
    else:
        assert tname == "IQ4_NL", tname
        qs = blk[:, 2:18]
        out[:, 2:] = np.array(IQ4NL_VALUES, dtype=np.int8)[np.concatenate([qs & 15, qs >> 4], axis=1)].view(np.uint8)
    return out.reshape(*lead, -1)


def assert_gives_the_rewrites_bits(raw: np.ndarray, qtype: str, n: int, k: int, file_floats: torch.Tensor) -> None:
    """raw (n x k blocks of Q5_0 or IQ4_NL) through every level, row count (1, 3, 8, 64) and thread count gives the
    generic level's bits over its Q8_0 rewrite (as_q8_0), which holds file_floats (the gguf package's) exactly and
    is within TOL_I16 of their product with x. N odd ends on a partial column group."""
    import gguf

    w, w8 = torch.from_numpy(raw), torch.from_numpy(as_q8_0(raw, qtype))
    back = gguf.quants.dequantize(w8.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(n, k)
    assert torch.equal(torch.from_numpy(back.copy()), file_floats)
    b = torch.randn(n, generator=torch.Generator().manual_seed(k))
    xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 3, 8, 64)}
    want = {m: kernels.library("generic").matmul(x, w8, "Q8_0", bias=b) for m, x in xs.items()}
    assert rel_err(want[8], xs[8].double() @ file_floats.double().T + b.double()) < TOL_I16
    for lv in levels_here():
        lib = kernels.library(lv)
        for m, x in xs.items():
            for nt in (1, 2):
                assert torch.equal(lib.matmul(x, w, qtype, bias=b, num_threads=nt), want[m]), (lv, m, nt)
            assert torch.equal(lib.matmul(x, w8, "Q8_0", bias=b), want[m]), (lv, m)


def assert_every_tile_height_gives_a_row_its_bits(raw: np.ndarray, qtype: str, k: int) -> None:
    """Tiles of 1-8 rows (16 at avx512) share each decoded block: every M up to 17 gives each row the bits it gets
    alone (from the Q8_0 rewrite at the generic level), at every level."""
    w = torch.from_numpy(raw)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(7))
    w8 = torch.from_numpy(as_q8_0(raw, qtype))
    alone = torch.cat([kernels.library("generic").matmul(x[i:i + 1].clone(), w8, "Q8_0") for i in range(17)])
    for lv in levels_here():
        lib = kernels.library(lv)
        for m in range(1, 18):
            assert torch.equal(lib.matmul(x[:m], w, qtype), alone[:m]), (lv, m)


def levels_here() -> list[str]:
    """The kernel levels this CPU can run, lowest first."""
    return [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]


def run_fused(llm, prompts, params, fused: bool):
    """llm.generate with the fused C decode step on or off."""
    old = ModelRunner.use_fused_decode
    ModelRunner.use_fused_decode = fused
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        ModelRunner.use_fused_decode = old


@contextmanager
def fused_calls():
    """Yields a list that gets the batch size of every call into the fused C decode step (one step or several)
    made inside the block."""
    calls: list[int] = []
    one, many = FusedDecode.__call__, FusedDecode.decode_steps

    def counting(self, input_ids, *a, **kw):
        calls.append(input_ids.shape[0])
        return one(self, input_ids, *a, **kw)

    def counting_steps(self, ids, *a, **kw):
        calls.append(len(ids))
        return many(self, ids, *a, **kw)

    FusedDecode.__call__, FusedDecode.decode_steps = counting, counting_steps
    try:
        yield calls
    finally:
        FusedDecode.__call__, FusedDecode.decode_steps = one, many


def assert_kept_routes(lib, w, qtype: str, kept, xs: dict, want: dict, bias=None, also=None, tag=()) -> None:
    """lib.matmul of each x in xs with W's kept copy gives want[m] bitwise on every route: the AMX tiles on and off
    (where the OS grants them), 1 and 2 threads. also(m, x, y), if given, checks more for each row count."""
    amx = lib.amx
    try:
        for tiles in ([True, False] if amx else [False]):
            lib.set_amx(tiles)
            for m, x in xs.items():
                for nt in (1, 2):
                    y = lib.matmul(x, w, qtype, bias=bias, num_threads=nt, kept=kept)
                    assert torch.equal(y, want[m]), (*tag, m, tiles, nt)
                if also is not None:
                    also(m, x, y)
    finally:
        lib.set_amx(amx)


# ---- K-quant super-blocks (256 weights) ----
KTYPES = ("Q4_K", "Q5_K", "Q6_K")  # the K-quants with a scale and a minimum or a signed scale per sub-block
SBTYPES = KTYPES + ("IQ4_XS", "Q3_K", "Q2_K")  # every 256-weight super-block type kquants.c reads
KQ_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136, "Q3_K": 110, "Q2_K": 84}


def kquant_raw(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random super-blocks (gguf cannot quantise K-quants): random quants and packed scales, small fp16 d / dmin."""
    rng = np.random.default_rng(seed)
    bb, nsb = KQ_BLOCK_BYTES[qtype], k // 256
    raw = rng.integers(0, 256, (n, nsb, bb), dtype=np.uint8)
    d = rng.uniform(0.002, 0.02, (n, nsb)).astype(np.float16)
    if qtype == "Q6_K":
        raw[:, :, 208:210] = d.view(np.uint8).reshape(n, nsb, 2)
    elif qtype == "IQ4_XS":  # d, then random 6-bit scales and indexes
        raw[:, :, 0:2] = (d / 8).astype(np.float16).view(np.uint8).reshape(n, nsb, 2)
    elif qtype == "Q3_K":  # random hmask, quants and scales, then d
        raw[:, :, 108:110] = d.view(np.uint8).reshape(n, nsb, 2)
    elif qtype == "Q2_K":  # random scale/min nibbles and quants, then d, dmin
        dmin = rng.uniform(0.001, 0.01, (n, nsb)).astype(np.float16)
        raw[:, :, 80:82] = d.view(np.uint8).reshape(n, nsb, 2)
        raw[:, :, 82:84] = dmin.view(np.uint8).reshape(n, nsb, 2)
    else:
        dmin = rng.uniform(0.001, 0.01, (n, nsb)).astype(np.float16)
        raw[:, :, 0:2] = d.view(np.uint8).reshape(n, nsb, 2)
        raw[:, :, 2:4] = dmin.view(np.uint8).reshape(n, nsb, 2)
    return np.ascontiguousarray(raw.reshape(n, nsb * bb))


def kquant_deq(raw: np.ndarray, qtype: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k).copy())
