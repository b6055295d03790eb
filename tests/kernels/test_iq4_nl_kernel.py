"""IQ4_NL weights read as stored (w = d * T[q], T ggml's 16-value int8 table, q a nibble): every level, row count and
thread count gives the bits of the same blocks rewritten as Q8_0 (the loader's former route, kernel_helpers.as_q8_0),
the embedding rows are the gguf package's floats, and a weight kept in the avx512 level's 16-column layout gives
the same bits and reads back byte for byte."""
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
T = gguf.GGMLQuantizationType.IQ4_NL


def make_raw(n: int, k: int, seed: int = 0) -> np.ndarray:
    # The gguf package cannot quantise IQ4_NL: random nibbles (every table entry, at both ends of the table) under
    # random fp16 scales of both signs, one block's scale 0.
    rng = np.random.default_rng(seed)
    blk = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
    d = (rng.uniform(0.001, 0.003, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32))).astype(np.float16)
    d[0, 0] = 0
    blk[:, :, :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return blk.reshape(n, -1)


def gguf_weights(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, T).reshape(n, k).copy())


def as_q8(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(as_q8_0(raw, "IQ4_NL"))


@pytest.mark.parametrize("k", [256, 896, 1152])
def test_iq4_nl_matmul_gives_the_q8_0_rewrites_bits_on_every_level(k):
    # K = 896: Qwen2.5-0.5B's hidden size, the rows llama-quantize writes as IQ4_NL in an IQ4_XS file (not whole
    # 256-weight super-blocks).
    raw = make_raw(37, k, seed=k)
    assert_gives_the_rewrites_bits(raw, "IQ4_NL", 37, k, gguf_weights(raw, 37, k))


def test_iq4_nl_every_tile_height_gives_a_row_the_same_bits():
    assert_every_tile_height_gives_a_row_its_bits(make_raw(23, 1152, seed=5), "IQ4_NL", 1152)


def test_iq4_nl_reads_every_table_entry_where_it_belongs():
    # One nibble value per block position: block i holds nibble (i + j) % 16 at element j, so a table entry read
    # wrong, or a low and a high nibble swapped, changes some output.
    n, k = 16, 512
    blk = np.zeros((n, k // 32, 18), dtype=np.uint8)
    blk[:, :, :2] = np.full((n, k // 32, 1), 0.01, np.float16).view(np.uint8)
    for i in range(n):
        for b in range(k // 32):
            q = [(i + b + j) % 16 for j in range(32)]
            blk[i, b, 2:] = [q[j] | (q[j + 16] << 4) for j in range(16)]
    raw = blk.reshape(n, -1)
    eye = torch.eye(k)[:40]  # row r picks weight r of every column
    for lv in levels_here():
        got = kernels.library(lv).matmul(eye, torch.from_numpy(raw), "IQ4_NL")
        assert torch.equal(got, gguf_weights(raw, n, k)[:, :40].T.contiguous()), lv


def test_iq4_nl_embedding_rows_are_the_gguf_floats_on_every_level():
    n, k = 50, 896
    raw = make_raw(n, k, seed=9)
    w, full = torch.from_numpy(raw), gguf_weights(raw, n, k)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    for lv in levels_here():
        got = kernels.library(lv).embed_rows(w, "IQ4_NL", ids, k)
        assert torch.equal(got.view(torch.int32), full[ids].view(torch.int32)), lv
    emb = QuantEmbedding(w, "IQ4_NL", (n, k))
    assert torch.equal(emb(ids), full[ids])


def test_iq4_nl_layer_holds_the_files_bytes_and_gives_the_rewrites_bits():
    n, k = 129, 896
    raw = make_raw(n, k)
    bias = torch.randn(n)
    lin = QuantLinear.from_raw(raw, "IQ4_NL", (n, k), bias)
    ref = QuantLinear.from_raw(as_q8_0(raw, "IQ4_NL"), "Q8_0", (n, k), bias)
    x = torch.randn(33, k)
    assert torch.equal(lin(x), ref(x))
    assert lin.prepare_kernel() and lin._weight is None
    assert lin.raw.numel() == raw.nbytes == n * k // 32 * 18  # 18 bytes per 32 weights, not the rewrite's 34


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
def test_a_kept_iq4_nl_weight_gives_the_rewrites_bits_and_reads_back_byte_for_byte():
    # The GGUF rows are zeroed (as dropped pages read) so that every route must read the copy: the vector route over
    # it, and from amx_min_rows rows with the tiles on (where granted) the same vectors, since the AMX routes do not
    # take IQ4_NL.
    lib, generic = kernels.library("avx512"), kernels.library("generic")
    lo = lib.amx_min_rows or 24
    for n, k in [(37, 896), (129, 1152), (16, 256), (3, 32), (100, 608)]:
        raw = make_raw(n, k, seed=n)
        w = torch.from_numpy(raw.copy())
        kept = lib.keep_tiles(w, n, k, "IQ4_NL")
        assert kept is not None and kept.nbytes == (n + 15) // 16 * ((k // 32 * 16 * 18 + 63) // 64 * 64)
        b = torch.randn(n)
        xs = {m: torch.randn(m, k) * 10.0 ** (m % 7 - 3) for m in (1, 2, 3, 8, 16, 17, lo, 33)}
        xs[3][1] = 0.0  # an all-zero row: every block's scale 0
        want = {m: generic.matmul(x, as_q8(raw), "Q8_0", bias=b) for m, x in xs.items()}
        w.zero_()
        assert_kept_routes(lib, w, "IQ4_NL", kept, xs, want, bias=b, tag=(n, k))
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        got = lib.embed_rows(w, "IQ4_NL", ids, k, kept=kept)
        assert torch.equal(got.view(torch.int32), gguf_weights(raw, n, k)[ids].view(torch.int32)), (n, k)
        kept.dropped = True
        kept.restore_source()
        assert torch.equal(w, torch.from_numpy(raw)), (n, k)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
def test_a_kept_iq4_nl_layer_gives_its_pages_back_and_restores_them():
    n, k = 320, 1152
    raw = make_raw(n, k, seed=11)
    lib = kernels.library("avx512")
    assert lib.drops_kept_source("IQ4_NL")
    w = torch.from_numpy(raw.copy())
    x = torch.randn(5, k)
    want = lib.matmul(x, w, "IQ4_NL")
    kept = lib.keep_tiles(w, n, k, "IQ4_NL", drop_source=True)
    assert kept.dropped
    assert torch.equal(lib.matmul(x, w, "IQ4_NL", kept=kept), want)
    kept.release()  # restores the rows first
    assert torch.equal(w, torch.from_numpy(raw))


@pytest.mark.skipif(not AMX, reason="needs a CPU whose OS grants the AMX tile state (Intel Xeon 4th gen and later)")
def test_iq4_nl_stays_on_the_vectors_with_the_tiles_on():
    lib = kernels.library("avx512")
    was = lib.amx
    assert lib.set_amx(True)
    try:
        n, k = 129, 1152
        raw = make_raw(n, k, seed=3)
        w = torch.from_numpy(raw)
        x = torch.randn(lib.amx_min_rows + 9, k)
        kept = lib.keep_tiles(w, n, k, "IQ4_NL")
        want = kernels.library("generic").matmul(x, as_q8(raw), "Q8_0")
        assert torch.equal(lib.matmul(x, w, "IQ4_NL"), want)
        assert torch.equal(lib.matmul(x, w, "IQ4_NL", kept=kept), want)
        assert lib.matmul_prompt(x, w, "IQ4_NL", kept=kept) is None  # the bfloat16 tiles decline it too
    finally:
        lib.set_amx(was)
