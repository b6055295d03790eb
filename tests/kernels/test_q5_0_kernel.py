"""Q5_0 weights read as stored (w = d * (q - 16), q 0..31: the nibble plus a fifth bit): every level, row count and
thread count gives the bits of the same blocks rewritten as Q8_0 (the loader's former route, kernel_helpers.as_q8_0),
and the embedding rows are the gguf package's floats. Q5_0 and Q5_1 weights kept in the avx512 level's 16-column
layout (nibbles, a row of fifth bits, d, Q5_1's m) give the GGUF rows' bits and read back byte for byte."""
from __future__ import annotations

import gguf  # a hard dependency: if missing, these tests must fail, not skip
import numpy as np
import pytest
import torch

import kvinfer.kernels as kernels
from kvinfer.layers.quant_linear import QuantEmbedding, QuantLinear
from tests.kernel_helpers import (AMX, as_q8_0, assert_every_tile_height_gives_a_row_its_bits,
                                  assert_gives_the_rewrites_bits, assert_kept_routes, levels_here)


AVX512 = kernels.best_level() == "avx512"
QH = {"Q5_0": (22, 2), "Q5_1": (24, 4)}  # block bytes, offset of the fifth bits


def make_raw(n: int, k: int, seed: int = 0, qtype: str = "Q5_0") -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[:, : min(k, 32)] += 0.05  # Q5_1: a block with a non-zero mean, a real minimum
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    bb, o = QH[qtype]
    blk = raw.reshape(n, k // 32, bb)
    assert (blk[:, :, o:o + 4] != 0).any() and (blk[:, :, o:o + 4] != 255).any()  # the fifth bits are mixed
    return raw


def gguf_weights(raw: np.ndarray, n: int, k: int, qtype: str = "Q5_0") -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k).copy())


def as_q8(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(as_q8_0(raw, "Q5_0"))


@pytest.mark.parametrize("k", [256, 896, 1152])
def test_q5_0_matmul_gives_the_q8_0_rewrites_bits_on_every_level(k):
    # K = 896 and 1152 (Qwen2.5-0.5B's and Gemma-3-1B's hidden sizes) are not whole 256-weight super-blocks: the
    # rows llama-quantize writes as Q5_0 in a Q4_K_M file.
    raw = make_raw(37, k, seed=k)
    assert_gives_the_rewrites_bits(raw, "Q5_0", 37, k, gguf_weights(raw, 37, k))


def test_q5_0_every_tile_height_gives_a_row_the_same_bits():
    assert_every_tile_height_gives_a_row_its_bits(make_raw(23, 1152, seed=5), "Q5_0", 1152)


def test_q5_0_fifth_bits_count():
    # A fifth bit read wrong (or not at all) moves a weight by 16 d: the same blocks with every qh bit clear and with
    # every qh bit set must each give their own rewrite's bits, and differ.
    n, k = 16, 896
    blk = make_raw(n, k, seed=3).reshape(n, k // 32, 22)
    clear, full = blk.copy(), blk.copy()
    clear[:, :, 2:6], full[:, :, 2:6] = 0, 255
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    for lv in levels_here():
        lib = kernels.library(lv)
        ys = []
        for b in (clear, full):
            raw = b.reshape(n, -1)
            ys.append(lib.matmul(x, torch.from_numpy(raw), "Q5_0"))
            assert torch.equal(ys[-1], lib.matmul(x, as_q8(raw), "Q8_0")), lv
        assert not torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("qtype,k", [("Q5_0", 896), ("Q5_1", 96)])
def test_q5_embedding_rows_are_the_gguf_floats_on_every_level(qtype, k):
    n = 50
    raw = make_raw(n, k, seed=9, qtype=qtype)
    w, full = torch.from_numpy(raw), gguf_weights(raw, n, k, qtype)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    for lv in levels_here():
        got = kernels.library(lv).embed_rows(w, qtype, ids, k)
        assert torch.equal(got.view(torch.int32), full[ids].view(torch.int32)), lv
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        kernels.embed_rows(w, qtype, torch.tensor([50]), k)
    emb = QuantEmbedding(w, qtype, (n, k))
    assert torch.equal(emb(ids), full[ids])


def test_q5_0_layer_holds_the_files_bytes_and_gives_the_rewrites_bits():
    n, k = 129, 896
    raw = make_raw(n, k)
    bias = torch.randn(n)
    lin = QuantLinear.from_raw(raw, "Q5_0", (n, k), bias)
    ref = QuantLinear.from_raw(as_q8_0(raw, "Q5_0"), "Q8_0", (n, k), bias)
    x = torch.randn(33, k)
    assert torch.equal(lin(x), ref(x))
    assert lin.prepare_kernel() and lin._weight is None
    assert lin.raw.numel() == raw.nbytes == n * k // 32 * 22  # 22 bytes per 32 weights, not the rewrite's 34


@pytest.mark.skipif(not AMX, reason="needs a CPU whose OS grants the AMX tile state (Intel Xeon 4th gen and later)")
def test_q5_0_amx_tiles_give_the_rewrites_bits():
    lib = kernels.library("avx512")
    was = lib.amx
    assert lib.set_amx(True)
    lo = lib.amx_min_rows
    try:
        for n, k, m in [(37, 896, lo), (129, 1152, 33), (100, 256, 47), (1290, 4096, lo)]:
            raw = make_raw(n, k, seed=n)
            x, b = torch.randn(m, k), torch.randn(n)
            tiles = lib.matmul(x, torch.from_numpy(raw), "Q5_0", bias=b)
            assert torch.equal(tiles, kernels.library("generic").matmul(x, as_q8(raw), "Q8_0", bias=b)), (n, k, m)
    finally:
        lib.set_amx(was)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_a_kept_5_bit_weight_gives_the_gguf_rows_bits_and_reads_back_byte_for_byte(qtype):
    # The copy is read by kept_rows (below the AMX tiles' rows, or with them off) and by the tiles; its GGUF rows are
    # zeroed (then given back) so that every route must read the copy. Every row count and thread count gives the
    # bits of the generic level over the GGUF rows (for Q5_0: of the Q8_0 rewrite, kept or not), the embedding rows
    # the gguf package's floats, and the pages come back byte for byte from the copy.
    lib, generic = kernels.library("avx512"), kernels.library("generic")
    lo = lib.amx_min_rows or 24
    for n, k in [(37, 896), (129, 1152), (16, 256), (3, 32), (100, 608)]:
        raw = make_raw(n, k, seed=n, qtype=qtype)
        w = torch.from_numpy(raw.copy())
        kept = lib.keep_tiles(w, n, k, qtype)
        assert kept is not None and kept.nbytes == (n + 15) // 16 * ((k // 32 * 16 * QH[qtype][0] + 63) // 64 * 64)
        q8 = q8_kept = None
        if qtype == "Q5_0":
            q8 = as_q8(raw)
            q8_kept = lib.keep_tiles(q8, n, k, "Q8_0")
        b = torch.randn(n)
        xs = {m: torch.randn(m, k) * 10.0 ** (m % 7 - 3) for m in (1, 2, 3, 8, 16, 17, lo, 33)}
        xs[3][1] = 0.0  # an all-zero row: every block's scale 0
        want = {m: generic.matmul(x, torch.from_numpy(raw), qtype, bias=b) for m, x in xs.items()}
        w.zero_()

        def as_the_rewrite(m, x, y):
            if q8_kept is not None:
                assert torch.equal(lib.matmul(x, q8, "Q8_0", bias=b, kept=q8_kept), want[m]), (n, k, m)

        assert_kept_routes(lib, w, qtype, kept, xs, want, bias=b, also=as_the_rewrite, tag=(n, k))
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        got = lib.embed_rows(w, qtype, ids, k, kept=kept)
        assert torch.equal(got.view(torch.int32), gguf_weights(raw, n, k, qtype)[ids].view(torch.int32)), (n, k)
        kept.dropped = True  # (the rows are zeros, as dropped pages read)
        kept.restore_source()
        assert torch.equal(w, torch.from_numpy(raw)), (n, k)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_a_kept_5_bit_layer_gives_its_pages_back_and_restores_them(qtype):
    n, k = 320, 1152
    raw = make_raw(n, k, seed=11, qtype=qtype)
    lib = kernels.library("avx512")
    assert lib.drops_kept_source(qtype)
    w = torch.from_numpy(raw.copy())
    x = torch.randn(5, k)
    want = lib.matmul(x, w, qtype)
    kept = lib.keep_tiles(w, n, k, qtype, drop_source=True)
    assert kept.dropped
    assert torch.equal(lib.matmul(x, w, qtype, kept=kept), want)
    kept.release()  # restores the rows first
    assert torch.equal(w, torch.from_numpy(raw))
