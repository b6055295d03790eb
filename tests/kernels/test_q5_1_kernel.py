"""Q5_1 weights in the legacy-block kernels (w = d * q + m, q 0..31: Q4_1's arithmetic with a fifth bit per quant):
against the gguf package's dequantization, every level, every batch and tile, and the layer (its embedding rows:
test_q5_0_kernel.py)."""
from __future__ import annotations

import gguf  # a hard dependency: if missing, these tests must fail, not skip
import numpy as np
import pytest
import torch

import kvinfer.kernels as kernels
from kvinfer.layers.quant_linear import QuantLinear
from tests.kernel_helpers import AMX, TOL, TOL_I16, levels_here, rel_err


def make_raw(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[:, : min(k, 32)] += 0.05  # a block with a non-zero mean: a real minimum
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_1)
    blk = raw.reshape(n, k // 32, 24)
    assert (blk[:, :, 4:8] != 0).any() and (blk[:, :, 4:8] != 255).any()  # the fifth bits are mixed
    return raw


def gguf_weights(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The gguf package's floats (not kvinfer's dequantizer: the reference the file's writer defines)."""
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_1).reshape(n, k).copy())


def reference_i16(x: torch.Tensor, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The documented rounding of the legacy types, in float64: each 32-block of x rounded to int16 steps of
    max|x_block| / 32767 (to nearest, ties to even) meets d * q, and the minimum m meets the block's exact sum."""
    xb = x.double().reshape(x.shape[0], k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))  # float32, as the kernel computes it
    xr = torch.round((xb.float() * inv).double()) * (amax / 32767.0).double()
    y = xr.reshape(x.shape) @ gguf_weights(raw, n, k).double().T
    m = np.ascontiguousarray(raw.reshape(n, k // 32, 24)[:, :, 2:4]).view(np.float16)[..., 0]
    return y + (xb.sum(-1) - xr.sum(-1)) @ torch.from_numpy(m.astype(np.float64)).T


@pytest.mark.parametrize("n,k", [(37, 64), (129, 576), (61, 1536), (5, 32)])
@pytest.mark.parametrize("m", [1, 3, 13])
def test_q5_1_matmul_is_the_gguf_weights_times_the_rounded_activations(n, k, m):
    raw = make_raw(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = kernels.matmul(x, torch.from_numpy(raw), "Q5_1")
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, x.double() @ gguf_weights(raw, n, k).double().T) < TOL_I16
    assert rel_err(y, reference_i16(x, raw, n, k)) < TOL


def test_q5_1_fifth_bits_count():
    # A fifth bit read wrong (or not at all) moves a weight by 16 d: the same blocks with every qh bit clear and
    # with every qh bit set must each give their own reference, on every level.
    n, k = 16, 64
    blk = make_raw(n, k, seed=3).reshape(n, k // 32, 24)
    clear, full = blk.copy(), blk.copy()
    clear[:, :, 4:8], full[:, :, 4:8] = 0, 255
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    for lv in levels_here():
        lib = kernels.library(lv)
        ys = [lib.matmul(x, torch.from_numpy(b.reshape(n, -1)), "Q5_1") for b in (clear, full)]
        for y, b in zip(ys, (clear, full)):
            assert rel_err(y, reference_i16(x, b.reshape(n, -1), n, k)) < TOL, lv
        assert not torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("k", [32, 64, 576, 608])
def test_q5_1_every_level_tile_and_batch_gives_a_row_the_same_bits(k):
    # Tiles of 1-8 rows (16 at avx512) share each decoded block; N = 23 ends on a partial column group. Every M up
    # to 17 on every level gives each row the bits it gets alone on the first level.
    n = 23
    w = torch.from_numpy(make_raw(n, k, seed=k))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(k))
    libs = [kernels.library(lv) for lv in levels_here()]
    assert len(libs) >= 2
    alone = torch.cat([libs[0].matmul(x[i:i + 1].clone(), w, "Q5_1") for i in range(17)])
    assert rel_err(alone, reference_i16(x, w.numpy(), n, k)) < TOL
    for lib in libs:
        for m in range(1, 18):
            assert torch.equal(lib.matmul(x[:m], w, "Q5_1"), alone[:m]), (lib.level, m)
        assert torch.equal(lib.matmul(x, w, "Q5_1", num_threads=1), alone), lib.level


def test_q5_1_layer_runs_on_the_kernel_without_a_float_copy():
    n, k = 129, 576
    raw = make_raw(n, k)
    bias = torch.randn(n)
    lin = QuantLinear.from_raw(raw, "Q5_1", (n, k), bias)
    x = torch.randn(33, k)
    ref = x.double() @ gguf_weights(raw, n, k).double().T + bias.double()
    assert rel_err(lin(x), ref) < TOL_I16
    assert lin.prepare_kernel() and lin._weight is None
    assert lin.raw.numel() == raw.nbytes  # the file's 24 bytes per 32 weights, no more
    # A kept copy at the avx512 level only, of the GGUF rows' size (test_q5_0_kernel.py tests its bits).
    for lv in levels_here():
        kept = kernels.library(lv).keep_tiles(lin.raw, n, k, "Q5_1")
        assert (kept is not None) == (lv == "avx512"), lv
        if kept is not None:
            assert kept.nbytes == (n + 15) // 16 * (k // 32 * 16 * 24)


@pytest.mark.skipif(not AMX, reason="needs a CPU whose OS grants the AMX tile state (Intel Xeon 4th gen and later)")
def test_q5_1_amx_tiles_give_the_same_bits_as_the_vector_route():
    lib, generic = kernels.library("avx512"), kernels.library("generic")
    was = lib.amx
    assert lib.set_amx(True)
    lo = lib.amx_min_rows
    try:
        for n, k, m in [(37, 64, lo), (129, 576, 33), (5, 32, lo + 1), (100, 608, 47), (1290, 4096, lo)]:
            w = torch.from_numpy(make_raw(n, k, seed=n))
            x, b = torch.randn(m, k), torch.randn(n)
            tiles = lib.matmul(x, w, "Q5_1", bias=b)
            assert torch.equal(tiles, generic.matmul(x, w, "Q5_1", bias=b)), (n, k, m)
            assert torch.equal(tiles[m - 1:], lib.matmul(x[m - 1:].clone(), w, "Q5_1", bias=b))
    finally:
        lib.set_amx(was)
