"""Calls of many rows (prompts): their rows are rounded by several threads, met by the columns in passes whose
activations stay in the core's cache, and the columns are handed out in runs to whichever thread is free
(kquants.c, kquants_kept.c, matmul.c). None of that may move a bit: each row of a 70-row call at K = 8192 (passes
of 32 rows, or 16 for float weights) equals that row computed alone, at every level, with and without the kept copy,
1 to 3 threads, 16 and 8 activation bits, with a bias."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ref_quantize

import kvinfer.kernels as kernels
from tests.kernel_helpers import kquant_raw, levels_here

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels")
M, N, K = 70, 40, 8192  # N: two full groups of 16 columns and a part


def weight(qtype: str) -> torch.Tensor:
    if qtype in ("Q4_K", "Q6_K", "Q2_K"):
        return torch.from_numpy(kquant_raw(qtype, N, K, seed=3))
    w = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32) * 0.1
    if qtype == "F32":
        return torch.from_numpy(w)
    return torch.from_numpy(ref_quantize(w, T[qtype]))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q2_K", "Q4_0", "Q8_0", "F32"])
def test_a_long_call_gives_each_row_its_bits_alone(qtype, bits):
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(11))
    x[5] *= 40.0  # rows of very different sizes: each row's rounding is its own
    bias = torch.randn(N, generator=torch.Generator().manual_seed(12))
    w = weight(qtype)
    kernels.set_activation_bits(bits)
    try:
        for lv in levels_here():
            lib = kernels.library(lv)
            kept = lib.keep_tiles(w, N, K, qtype) if qtype != "F32" else None
            for copy in ([None, kept] if kept is not None else [None]):
                alone = torch.cat([lib.matmul(x[i:i + 1].clone(), w, qtype, bias=bias, num_threads=1, kept=copy)
                                   for i in range(M)])
                for nt in (1, 2, 3):
                    y = lib.matmul(x, w, qtype, bias=bias, num_threads=nt, kept=copy)
                    assert torch.equal(y, alone), (lv, copy is not None, nt)
    finally:
        kernels.set_activation_bits(16)
