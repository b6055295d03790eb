"""The eager path's C row kernels (SwiGLU, RoPE, RMSNorm, LayerNorm, GELU) against torch, on every ISA level."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvinfer import kernels
from kvinfer.layers.mlp import SwiGLU
from kvinfer.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable on this machine")


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 37), (70, 1536), (300, 200)])
def test_silu_mul_matches_torch(rows, inter):
    gu = torch.randn(rows, 2 * inter) * 4
    got = kernels.silu_mul(gu, inter)
    torch.testing.assert_close(got, F.silu(gu[:, :inter]) * gu[:, inter:], rtol=1e-5, atol=1e-6)
    strided = torch.randn(rows, 2 * inter + 5)[:, 2:2 + 2 * inter]  # rows with a stride of their own
    torch.testing.assert_close(kernels.silu_mul(strided, inter),
                               F.silu(strided[:, :inter]) * strided[:, inter:], rtol=1e-5, atol=1e-6)


def test_silu_mul_declines_what_it_cannot_do():
    assert kernels.silu_mul(torch.randn(4, 10, dtype=torch.float64), 5) is None
    assert kernels.silu_mul(torch.randn(4, 10), 4) is None  # not 2 * inter wide
    assert kernels.silu_mul(torch.randn(10, 4).T, 2) is None  # columns not contiguous
    mlp = SwiGLU(16, 24)
    x = torch.randn(5, 16, dtype=torch.float64)
    mlp.double()  # the module falls back to torch and still computes the right thing
    gate, up = mlp.gate_up(x).split(24, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.down(F.silu(gate) * up))


@pytest.mark.parametrize("tokens,H,KVH,D", [(1, 4, 2, 16), (7, 9, 3, 64), (300, 8, 8, 32)])
def test_rope_in_place_matches_torch(tokens, H, KVH, D):
    rot = RotaryEmbedding(D, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (H + 2 * KVH) * D)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(tokens, H, D), k.view(tokens, KVH, D)
    want_q, want_k = rot(positions, q, k)  # torch, not in place
    assert not torch.equal(want_q, q)
    got_q, got_k = rot.rotate_(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_rope_falls_back_without_touching_inputs():
    rot = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.arange(5)
    q = torch.randn(5, 16, 4).transpose(1, 2)  # heads not contiguous within a row: the kernel declines
    k = torch.randn(5, 2, 16)
    q0, k0 = q.clone(), k.clone()
    got_q, got_k = rot.rotate_(positions, q, k)
    want_q, want_k = rot(positions, q0, k0)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # neither rotated in place
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def _levels():
    return [kernels.library(lv) for lv in kernels.LEVELS
            if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]


@pytest.mark.parametrize("n", [576, 37])  # 37: the sequential tail of every reduction
def test_norms_and_gelu_match_torch_on_every_level_with_the_same_bits(n):
    x = torch.randn(9, n) * 3
    w, b = torch.randn(n), torch.randn(n)
    for lib in _levels():
        got = {"rms": lib.rms_norm(x, w, 1e-5), "ln": lib.layer_norm(x, w, b, 1e-5),
               "gelu": lib.gelu(x), "gelu_tanh": lib.gelu(x, "tanh"),
               "silu_mul": lib.silu_mul(torch.cat([x, x.flip(1)], 1) * 30, n)}  # past exp's clamps too
        torch.testing.assert_close(got["rms"], F.rms_norm(x, (n,), w, 1e-5), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["ln"], F.layer_norm(x, (n,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
        # GELU against float64: torch's own float32 GELU errs by up to 1.2e-6 on AVX-512 machines (ours: 4.6e-7)
        x64 = x.double()
        torch.testing.assert_close(got["gelu"].double(), F.gelu(x64), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["gelu_tanh"].double(), F.gelu(x64, approximate="tanh"), rtol=1e-5, atol=1e-6)
        if lib.level == "generic":
            ref = got
        else:
            assert all(torch.equal(got[key], ref[key]) for key in got), lib.level
        # a row alone gives the same bits as in the batch
        assert torch.equal(lib.rms_norm(x[4:5].clone(), w, 1e-5)[0], got["rms"][4])
        assert torch.equal(lib.gelu(x[4:5].clone())[0], got["gelu"][4])
