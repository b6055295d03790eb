"""Activations rounded to 8 bits (kernels.set_activation_bits(8), `--activation-bits 8`): every quantised route
computes x rounded per 32-block to q in [-127, 127] times the weights, the same bits at every level, kept copy or
GGUF rows, and not the 16-bit result."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ref_quantize

import kvinfer.kernels as kernels
from tests.kernel_helpers import KQ_BLOCK_BYTES, SBTYPES, kquant_deq, kquant_raw, levels_here, rel_err

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels")
TOL = 2e-5  # against float64 of x rounded as the kernel rounds it: only float rounding left


@pytest.fixture
def eight_bits():
    kernels.set_activation_bits(8)
    try:
        yield
    finally:
        kernels.set_activation_bits(16)


def rounded(x: torch.Tensor, k: int, levels: float) -> torch.Tensor:
    """x rounded per 32-block as quantize_rows rounds it: q = rint(x * (levels / amax)) in float32, times amax /
    levels."""
    xb = x.reshape(x.shape[0], k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).double() * (amax.double() / levels)).reshape(x.shape)


def reference(x: torch.Tensor, raw: np.ndarray, qtype: str, n: int, k: int, levels: float) -> torch.Tensor:
    """x . w in float64, x rounded to `levels`; a minimum (Q4_K, Q5_K, Q2_K, Q4_1) meets the exact x, as in the
    kernels."""
    xr = rounded(x, k, levels)
    y = xr @ kquant_deq(raw, qtype, n, k).double().T
    if qtype in ("Q4_K", "Q5_K", "Q2_K"):
        zero = raw.reshape(n, k // 256, KQ_BLOCK_BYTES[qtype]).copy()
        zero[:, :, 16:80 if qtype == "Q2_K" else None] = 0  # the quants: what is left is -dmin * m_j
        y += (x.double() - xr) @ kquant_deq(np.ascontiguousarray(zero.reshape(n, -1)), qtype, n, k).double().T
    if qtype == "Q4_1":
        zero = raw.reshape(n, k // 32, 20).copy()
        zero[:, :, 4:] = 0  # the quants: what is left is m
        y += (x.double() - xr) @ kquant_deq(np.ascontiguousarray(zero.reshape(n, -1)), qtype, n, k).double().T
    return y


def weights(qtype: str, n: int, k: int) -> np.ndarray:
    if qtype in SBTYPES:
        return kquant_raw(qtype, n, k, seed=3)
    a = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32) * 0.1
    return np.ascontiguousarray(ref_quantize(a, T[qtype]))


@pytest.mark.parametrize("qtype", SBTYPES + ("Q4_0", "Q4_1", "Q8_0"))
def test_eight_bit_activations_at_every_level_kept_or_not(qtype, eight_bits):
    n, k = 40, 512
    raw = weights(qtype, n, k)
    w = torch.from_numpy(raw)
    got = {}
    for lv in levels_here():
        lib = kernels.library(lv)
        assert lib.activation_bits == 8
        kept = lib.keep_tiles(w, n, k, qtype)
        for m in (1, 2, 3, 19):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for threads in (1, 3):
                y = lib.matmul(x, w, qtype, num_threads=threads, kept=kept)
                assert rel_err(y, reference(x, raw, qtype, n, k, 127.0)) < TOL, (lv, m)
                # and not the 16-bit result: the rounding really is coarser
                assert rel_err(y, reference(x, raw, qtype, n, k, 32767.0)) > 20 * TOL, (lv, m)
                got.setdefault(m, []).append((lv, threads, kept is not None, y))
            if kept is not None:  # the GGUF rows' route too
                got[m].append((lv, 1, False, lib.matmul(x, w, qtype, num_threads=1)))
    for m, ys in got.items():
        for lv, threads, with_kept, y in ys[1:]:
            assert torch.equal(y, ys[0][3]), (m, lv, threads, with_kept)


def test_the_setting_reaches_every_library_and_back():
    libs = [kernels.library(lv) for lv in levels_here()]
    with pytest.raises(ValueError, match="16 or 8"):
        kernels.set_activation_bits(12)
    x, raw = torch.randn(3, 256), kquant_raw("Q4_K", 16, 256, seed=1)
    before = libs[0].matmul(x, torch.from_numpy(raw), "Q4_K")
    try:
        kernels.set_activation_bits(8)
        assert kernels.activation_bits() == 8 and all(lib.activation_bits == 8 for lib in libs)
        assert "int8-rounded" in kernels.describe()
        assert not torch.equal(libs[0].matmul(x, torch.from_numpy(raw), "Q4_K"), before)
    finally:
        kernels.set_activation_bits(16)
    assert all(lib.activation_bits == 16 for lib in libs) and "int16-rounded" in kernels.describe()
    assert torch.equal(libs[0].matmul(x, torch.from_numpy(raw), "Q4_K"), before)
