"""The matmul kernels (kvinfer.kernels: GGML-quantised and float weights), their ISA levels and build, and the layers
built on them (QuantLinear, QuantEmbedding, KernelLinear)."""
from __future__ import annotations

import copy
import ctypes
import os
import pickle
import sys
import threading

import gguf  # a hard dependency: if missing, these tests must fail, not skip
import numpy as np
import pytest
import torch
from torch.nn import functional as F

import kvinfer.kernels as kernels
from kvinfer import options
from kvinfer.layers.quant_linear import QuantEmbedding, QuantLinear, quantized_embedding_rows
from kvinfer.loaders.dequant import dequantize
from tests.kernel_helpers import AMX, TOL, TOL_I16, assert_kept_routes, levels_here, rel_err

QTYPES = ("Q4_0", "Q4_1", "Q8_0")


def make_raw(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[:, : min(k, 32)] += 0.05  # blocks with a non-zero mean give Q4_1 a real offset
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def reference(x: torch.Tensor, raw, qtype: str, n: int, k: int) -> torch.Tensor:
    return x.double() @ dequantize(raw, qtype, (n, k)).double().T


def reference_i16(x: torch.Tensor, raw, qtype: str, n: int, k: int) -> torch.Tensor:
    """What the int16 route computes, in float64: each 32-block of x rounded to int16 steps of max|x_block| /
    32767 (to nearest, ties to even), Q4_1's minimum times the exact block sum of x."""
    xb = x.double().reshape(x.shape[0], k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True).float()
    scale = (amax / 32767.0).double()
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))  # float32 like the kernel
    xr = (torch.round((xb.float() * inv).double()) * scale).reshape(x.shape)
    y = reference(xr, raw, qtype, n, k)
    if qtype == "Q4_1":
        m = np.ascontiguousarray(raw.reshape(n, k // 32, 20)[:, :, 2:4]).view(np.float16)[..., 0]
        y += (xb.sum(-1) - xr.reshape(xb.shape).sum(-1)) @ torch.from_numpy(m.astype(np.float64)).T
    return y




def test_kernels_build_on_this_machine():
    # This machine has gcc and AVX2: not building is a failure, never a skip.
    assert kernels.available(), kernels.unavailable_reason()
    assert kernels.unavailable_reason() is None
    assert kernels.library_path().exists()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(37, 64), (129, 576), (61, 1536), (5, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13])
def test_quantised_matmul_matches_dequantized_matmul(qtype, n, k, m):
    raw = make_raw(qtype, n, k, seed=n + k)
    w = torch.from_numpy(raw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = kernels.matmul(x, w, qtype)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, reference(x, raw, qtype, n, k)) < TOL_I16
    assert rel_err(y, reference_i16(x, raw, qtype, n, k)) < TOL


@pytest.mark.parametrize("qtype", QTYPES + ("F32", "BF16", "F16"))
def test_a_rows_result_never_depends_on_the_batch(qtype):
    # The exactness contract at its root: row r of a call with M rows is bitwise the row computed alone, for
    # every M (tiles of 1-4 rows, several tiles, leftover K blocks: K = 608 is 19 blocks).
    n, k = 75, 608
    if qtype in QTYPES:
        w = torch.from_numpy(make_raw(qtype, n, k))
    else:
        w = torch.randn(n, k).to({"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[qtype])
    x = torch.randn(11, k)
    alone = torch.cat([kernels.matmul(x[i:i + 1].clone(), w, qtype) for i in range(11)])
    for m in (2, 3, 4, 5, 8, 11):
        assert torch.equal(kernels.matmul(x[:m], w, qtype), alone[:m]), m
    assert torch.equal(kernels.matmul(x[5:], w, qtype), alone[5:])


def test_float_weights_and_bias():
    n, k = 70, 100  # K not a multiple of 8: the sequential tail
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(9, k)
    ref = x.double() @ w.double().T + b.double()
    assert rel_err(kernels.matmul(x, w, bias=b), ref) < TOL
    for dt in (torch.bfloat16, torch.float16):  # widened exactly: the same as the float32 copy of the weight
        assert torch.equal(kernels.matmul(x, w.to(dt), bias=b), kernels.matmul(x, w.to(dt).float(), bias=b))
    with pytest.raises(ValueError, match="columns"):
        kernels.matmul(x, torch.randn(n, k + 1))
    with pytest.raises(ValueError, match="bias"):
        kernels.matmul(x, w, bias=torch.randn(3))


def test_int16_route_rounding_matters():
    # The emulated reference is not trivially close: it differs from the exact product by more than TOL in
    # these cases, so the assertion above really checks the rounding of x.
    n, k = 129, 1536
    raw = make_raw("Q4_1", n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    x[0, ::32] *= 300.0  # one large value per block: its neighbours keep few significant bits
    exact, emulated = reference(x, raw, "Q4_1", n, k), reference_i16(x, raw, "Q4_1", n, k)
    assert rel_err(emulated, exact) > TOL
    y16 = kernels.matmul(x, torch.from_numpy(raw), "Q4_1")
    assert rel_err(y16, emulated) < TOL < rel_err(y16, exact)


@pytest.mark.parametrize("qtype", QTYPES)
def test_large_batches_and_cache_blocking(qtype):
    # 40 rows: ten 4-row tiles; N=1001 at K=576: more than one weight slab.
    for n, k in [(1001, 576), (70, 1536)]:
        raw = make_raw(qtype, n, k, seed=3)
        x = torch.randn(40, k)
        assert rel_err(kernels.matmul(x, torch.from_numpy(raw), qtype), reference_i16(x, raw, qtype, n, k)) < TOL


def test_strided_rows_and_out():
    n, k, m = 67, 576, 5
    raw = make_raw("Q4_1", n, k)
    xbig = torch.randn(m, k + 40)
    x = xbig[:, 7:7 + k]  # row stride k + 40
    outbig = torch.full((m, n + 9), 123.0)
    out = outbig[:, 2:2 + n]
    y = kernels.matmul(x, torch.from_numpy(raw), "Q4_1", out=out)
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(out, reference(x, raw, "Q4_1", n, k)) < TOL_I16
    assert torch.equal(out, kernels.matmul(x.contiguous(), torch.from_numpy(raw), "Q4_1"))
    assert (outbig[:, :2] == 123.0).all() and (outbig[:, 2 + n:] == 123.0).all()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_thread_counts_agree(qtype, m):
    # Big enough for the kernel to really use two threads; each output is computed the same way whichever
    # thread owns its row, so the results are bitwise equal.
    n, k = 960, 576
    w = torch.from_numpy(make_raw(qtype, n, k))
    x = torch.randn(m, k)
    y1 = kernels.matmul(x, w, qtype, num_threads=1)
    y2 = kernels.matmul(x, w, qtype, num_threads=2)
    assert torch.equal(y1, y2)
    assert torch.equal(kernels.matmul(x, w, qtype), y1)  # default: torch.get_num_threads()


def test_matmul_rejects_bad_arguments():
    w = torch.from_numpy(make_raw("Q4_1", 8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError):
        kernels.matmul(x, w, "Q6_K")
    with pytest.raises(ValueError):
        kernels.matmul(x.double(), w, "Q4_1")
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(2, 96), w, "Q4_1")  # rows too short for K
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(2, 48), w, "Q4_1")  # K not whole blocks
    with pytest.raises(ValueError):
        kernels.matmul(x, w, "Q4_1", out=torch.empty(2, 7))
    with pytest.raises(ValueError):
        kernels.matmul(x, w.int(), "Q4_1")
    assert kernels.matmul(torch.empty(0, 64), w, "Q4_1").shape == (0, 8)


def test_one_openmp_runtime_shared_with_torch():
    # Our -fopenmp library must bind to the libgomp torch already loaded (same soname), not bring a second
    # runtime with its own thread pool.
    assert kernels.available()
    with open("/proc/self/maps") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) == 1, gomps


@pytest.fixture(autouse=True)
def _switches_follow_env():
    """Tests here set KVINFER_* variables and reload the options; afterwards (the environment restored by then)
    the switches are read again, so no test's setting outlives it."""
    yield
    options.reload()


@pytest.fixture
def reloaded_kernels(monkeypatch):
    """kernels with its load state cleared (the on-disk cache kept: the levels are built once per suite);
    restored afterwards."""
    kernels._reset()
    yield kernels
    monkeypatch.undo()
    options.reload()
    kernels._reset()
    assert kernels.available()


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """kernels with its load state cleared and an empty cache; restored afterwards."""
    monkeypatch.setenv("KVINFER_CACHE", str(tmp_path))
    options.reload()
    kernels._reset()
    yield kernels
    monkeypatch.undo()
    options.reload()
    kernels._reset()
    assert kernels.available()


def test_missing_compiler_reports_unavailable(fresh_kernels, monkeypatch):
    monkeypatch.setattr(sys.modules["kvinfer.kernels.build"], "CC", "kvinfer-no-such-cc")
    assert fresh_kernels.available() is False
    reason = fresh_kernels.unavailable_reason()
    assert "kvinfer-no-such-cc" in reason and "not found" in reason
    with pytest.raises(RuntimeError, match="not found"):
        fresh_kernels.matmul(torch.randn(1, 32), torch.zeros(1, 20, dtype=torch.uint8), "Q4_1")
    # Layers fall back to the dequantized weight and still compute the right thing.
    raw = make_raw("Q4_1", 33, 64)
    lin = QuantLinear.from_raw(raw, "Q4_1", (33, 64))
    x = torch.randn(2, 64)
    assert not lin.prepare_kernel()
    assert rel_err(lin(x), reference(x, raw, "Q4_1", 33, 64)) < TOL


def test_failing_compiler_and_switch_off_report_unavailable(fresh_kernels, monkeypatch):
    monkeypatch.setattr(sys.modules["kvinfer.kernels.build"], "CC", "false")  # exists, exits 1
    assert not fresh_kernels.available()
    assert "failed" in fresh_kernels.unavailable_reason()
    fresh_kernels._reset()
    monkeypatch.setenv("KVINFER_KERNELS", "0")
    options.reload()
    assert not fresh_kernels.available()
    assert "KVINFER_KERNELS" in fresh_kernels.unavailable_reason()


def test_dispatch_picks_the_best_level_and_honours_a_lower_one(reloaded_kernels, monkeypatch):
    k = reloaded_kernels
    monkeypatch.delenv("KVINFER_ISA", raising=False)  # the suite may run with a lower level forced
    options.reload()
    k._reset()
    feats = k.cpu_features()
    assert feats["avx2"], "this project's machines have AVX2; the probe must see it"
    assert k.level() == k.best_level()
    assert "level " + k.level() in k.describe()
    for forced in ("generic", "avx2"):
        k._reset()
        monkeypatch.setenv("KVINFER_ISA", forced)
        options.reload()
        assert k.level() == forced
    k._reset()
    monkeypatch.setenv("KVINFER_ISA", "avx9000")
    with pytest.raises(ValueError, match="KVINFER_ISA must be one of"):  # one line, naming the switch
        options.reload()
    assert not k.available() and "KVINFER_ISA must be one of" in k.unavailable_reason()
    # A CPU without AVX2 (or an OS that does not save its registers) runs everything on the portable level.
    k._reset()
    monkeypatch.delenv("KVINFER_ISA")
    options.reload()
    monkeypatch.setattr(sys.modules["kvinfer.kernels.levels"], "cpu_features",
                        lambda: {"avx2": False, "avx512": False, "amx_listed": True, "amx_granted": False})
    assert k.level() == "generic"
    assert "AMX listed but not granted" in k.describe()
    with pytest.raises(RuntimeError, match="cannot run the avx2 level"):
        k.library("avx2")


def test_amx_probe_never_crashes():
    # On a VM that lists AMX but refuses the tile state, arch_prctl fails and the probe says "not granted"; the
    # kernels never execute an AMX instruction either way.
    f = kernels.cpu_features()
    assert set(f) == {"avx2", "avx512", "amx_listed", "amx_granted"}
    assert not f["amx_granted"] or f["amx_listed"]




@pytest.mark.parametrize("qtype", QTYPES + ("F32",))
def test_every_level_computes_the_same_bits(qtype):
    n, k = 45, 608
    w = torch.from_numpy(make_raw(qtype, n, k)) if qtype in QTYPES else torch.randn(n, k)
    x = torch.randn(6, k)
    outs = {lv: kernels.library(lv).matmul(x, w, qtype) for lv in levels_here()}
    assert len(outs) >= 2  # generic and avx2 at least
    first = next(iter(outs.values()))
    for lv, y in outs.items():
        assert torch.equal(y, first), lv


@pytest.mark.parametrize("qtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("k", [608, 600, 603, 100, 7])
def test_float_weights_give_every_row_the_same_bits_on_every_level(qtype, k):
    # Float weights: tiles of 1-4 rows (8 lanes) below AVX-512, of 1-8 rows and two columns (16 lanes) at it. K
    # picks the tail after whole groups of 16 (none; one group of 8; 8 and 3 singles; 4 groups, 4 singles; 7
    # singles); N = 23 ends on a lone column. Every M up to 19 (8 + 8 + 3) and every level: the bits a row gets alone.
    n = 23
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(
        {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[qtype])
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(k + 1))
    libs = [kernels.library(lv) for lv in levels_here()]
    alone = torch.cat([libs[0].matmul(x[i:i + 1].clone(), w) for i in range(19)])
    assert rel_err(alone, x.double() @ w.double().T) < TOL
    for lib in libs:
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 19):
            assert torch.equal(lib.matmul(x[:m], w), alone[:m]), (lib.level, m)


@pytest.mark.parametrize("k", [32, 64, 256, 576, 608])
def test_every_tile_height_and_tail_gives_a_row_the_same_bits(k):
    # Tiles of 1-8 rows share each decoded weight block; K picks the tail after whole groups of 8 blocks (none,
    # a pair, a pair and a single block, a single block alone). Every M from 1 to 17 (one tile up to 8 rows, then
    # 8 + 8 + 1) and every level must give each row the bits it gets alone.
    n = 23
    w = torch.from_numpy(make_raw("Q4_1", n, k, seed=k))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(k))
    libs = [kernels.library(lv) for lv in levels_here()]
    alone = torch.cat([libs[0].matmul(x[i:i + 1].clone(), w, "Q4_1") for i in range(17)])
    assert rel_err(alone, reference_i16(x, w.numpy(), "Q4_1", n, k)) < TOL
    for lib in libs:
        for m in range(1, 18):
            assert torch.equal(lib.matmul(x[:m], w, "Q4_1"), alone[:m]), (lib.level, m)




@pytest.mark.skipif(not AMX, reason="needs a CPU whose OS grants the AMX tile state (Intel Xeon 4th gen and later)")
@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_tiles_give_the_same_bits_as_the_vector_route(qtype):
    # From amx_min_rows rows the avx512 level multiplies on AMX tiles (int16 activations split into two int8
    # halves, one exact int32 per block): every row, whatever the tail of rows (past a multiple of 16) or of
    # columns (past a multiple of 32), must be the bits the vector route and the portable level give it, bias
    # included.
    lib = kernels.library("avx512")
    was = lib.amx  # (KVINFER_AMX=0 starts the library with the tiles off; this test turns them on itself)
    assert lib.set_amx(True), "AMX is granted here, so the avx512 level must be able to use it"
    lo = lib.amx_min_rows
    assert 1 < lo <= 33
    generic = kernels.library("generic")
    try:
        # (1290 x 4096: more column passes per thread than one span of the AMX scratch holds, and a partial span)
        for n, k, m in [(37, 64, lo), (129, 576, 33), (61, 1536, 40), (5, 32, lo + 1), (100, 608, 47), (45, 576, 64),
                        (1290, 4096, lo)]:
            w = torch.from_numpy(make_raw(qtype, n, k, seed=n))
            x, b = torch.randn(m, k), torch.randn(n)
            tiles = lib.matmul(x, w, qtype, bias=b)
            try:
                lib.set_amx(False)
                vector = lib.matmul(x, w, qtype, bias=b)
            finally:
                assert lib.set_amx(True)
            assert torch.equal(tiles, vector), (n, k, m)
            assert torch.equal(tiles, generic.matmul(x, w, qtype, bias=b)), (n, k, m)
            assert torch.equal(tiles[m - 1:], lib.matmul(x[m - 1:].clone(), w, qtype, bias=b))  # one row: vectors
    finally:
        lib.set_amx(was)
    # (KVINFER_ISA may force a lower level, KVINFER_AMX=0 the tiles off)
    assert ("AMX tiles" in kernels.describe()) == (kernels.level() == "avx512" and kernels.active().amx)


def test_amx_can_be_switched_off(monkeypatch, reloaded_kernels):
    k = reloaded_kernels
    monkeypatch.delenv("KVINFER_ISA", raising=False)
    monkeypatch.setenv("KVINFER_AMX", "0")
    options.reload()
    k._reset()
    assert not k.active().amx and "AMX tiles" not in k.describe()
    assert k.active().lib.kvq_amx_enable(-1) == 0  # the library's own switch (-1: ask, change nothing)
    monkeypatch.delenv("KVINFER_AMX")
    options.reload()
    k._reset()
    assert k.active().amx == (k.cpu_features()["amx_granted"] and k.best_level() == "avx512")


def test_the_avx512_level_compiles(tmp_path):
    # It cannot run on an AVX2-only machine, but it must build (it is the level an AVX-512 machine picks).
    path = kernels.build(flags=kernels.LEVEL_FLAGS["avx512"], cache_dir=tmp_path)
    assert path.exists()


PLAIN_FLAGS = kernels.LEVEL_FLAGS["generic"]


def test_build_is_cached_and_safe_in_parallel(tmp_path):
    # The small CPU-probe source: the same build path as the kernels' (hash, temporary name, rename) at a
    # fraction of their compile time; the kernel libraries themselves are built by the first test that loads them.
    out = tmp_path / "k"
    src = [kernels.DISPATCH_SOURCE]
    paths, errors = [], []

    def go():
        try:
            paths.append(kernels.build(flags=PLAIN_FLAGS, cache_dir=out, sources=src))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    path = paths[0]
    assert sorted(p.name for p in out.iterdir()) == [path.name]  # no temporaries left behind
    mtime = os.stat(path).st_mtime_ns
    assert kernels.build(flags=PLAIN_FLAGS, cache_dir=out, sources=src) == path and os.stat(path).st_mtime_ns == mtime
    assert kernels.build(cc="kvinfer-no-such-cc", flags=PLAIN_FLAGS, cache_dir=out, sources=src) == path  # cached
    lib = ctypes.CDLL(str(path))
    lib.kvq_cpu_features.restype = ctypes.c_int
    assert lib.kvq_cpu_features() & 1  # this project's machines have AVX2, and the probe says so


# --- QuantLinear / QuantEmbedding ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("t", [1, 5, 32, 33, 100])
def test_quant_linear_matches_dequantized_linear(qtype, t):
    n, k = 129, 576
    raw = make_raw(qtype, n, k)
    bias = torch.randn(n)
    lin = QuantLinear.from_raw(raw, qtype, (n, k), bias)
    x = torch.randn(t, k)
    ref = F.linear(x.double(), dequantize(raw, qtype, (n, k)).double(), bias.double())
    assert rel_err(lin(x), ref) < TOL_I16
    # Every batch goes to the kernel (batch invariance) without ever making the float32 copy.
    assert lin.prepare_kernel() and lin._weight is None


def test_quant_linear_shapes_strides_and_options():
    n, k = 40, 64
    raw = make_raw("Q4_1", n, k)
    wd = dequantize(raw, "Q4_1", (n, k))
    lin = QuantLinear.from_raw(torch.from_numpy(raw), "Q4_1", (n, k))
    x = torch.randn(2, 3, k)
    y = lin(x)
    assert y.shape == (2, 3, n)
    assert rel_err(y, x.double() @ wd.double().T) < TOL_I16
    xt = torch.randn(k, 4).T  # non-contiguous rows
    assert rel_err(lin(xt), xt.double() @ wd.double().T) < TOL_I16
    assert lin(torch.randn(0, k)).shape == (0, n)

    xb = torch.randn(200, k)
    assert rel_err(lin(xb), xb.double() @ wd.double().T) < TOL_I16 and lin._weight is None

    # Other dtypes take the dequantized route in that dtype.
    yb = lin(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        QuantLinear.from_raw(raw[:-1], "Q4_1", (n, k))


def test_quant_linear_copies_and_pickles():
    n, k = 48, 64
    raw = make_raw("Q8_0", n, k)
    lin = QuantLinear.from_raw(raw, "Q8_0", (n, k), torch.randn(n))
    x = torch.randn(2, k)
    y = lin(x)
    assert lin.prepare_kernel()
    for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert other.raw.data_ptr() != lin.raw.data_ptr()
        assert torch.equal(other(x), y)
    del lin
    assert torch.equal(other(x), y)


def test_quant_linear_other_types_fall_back():
    n, k = 24, 64
    # F16 rows: dequant.py knows them, the quantised kernels do not (every quantised GGUF type it knows is a kernel
    # type): the layer widens them and multiplies in torch
    raw = np.random.default_rng(0).standard_normal((n, k)).astype(np.float16).view(np.uint8)
    lin = QuantLinear.from_raw(raw, "F16", (n, k))
    x = torch.randn(1, k)
    assert not lin.prepare_kernel()
    assert rel_err(lin(x), reference(x, raw, "F16", n, k)) < TOL


def test_quant_linear_concat_fuses_outputs():
    k = 576
    parts = [QuantLinear.from_raw(make_raw("Q4_1", n, k, seed=n), "Q4_1", (n, k), b)
             for n, b in [(64, None), (32, torch.randn(32)), (32, None)]]
    fused = QuantLinear.concat(parts)
    assert (fused.out_features, fused.in_features) == (128, k)
    for t in (1, 40):
        x = torch.randn(t, k)
        want = torch.cat([p(x) for p in parts], dim=-1)
        assert torch.equal(fused(x), want)  # the rows are independent: stacking them changes no bit


def test_quant_embedding_and_tied_head():
    vocab, dim = 300, 576
    raw = make_raw("Q8_0", vocab, dim)
    full = dequantize(raw, "Q8_0", (vocab, dim))
    emb = QuantEmbedding.from_raw(raw, "Q8_0", (vocab, dim))
    ids = torch.tensor([[0, 299, 5], [5, 17, 42]])
    assert torch.equal(emb(ids), full[ids])  # only a gather of bytes + the same decode: exact
    assert torch.equal(quantized_embedding_rows(raw, "Q8_0", ids[0]), full[ids[0]])
    ro = raw.copy()
    ro.flags.writeable = False  # like read_gguf's mmap-backed arrays
    assert torch.equal(quantized_embedding_rows(ro, "Q8_0", ids), full[ids])
    head = emb.as_linear()
    assert head.raw.data_ptr() == emb.raw.data_ptr()  # no second copy of the matrix
    h = torch.randn(3, dim)
    assert rel_err(head(h), h.double() @ full.double().T) < TOL_I16
    hb = torch.randn(70, dim)  # the head stays on the kernel for every batch size
    assert rel_err(head(hb), hb.double() @ full.double().T) < TOL_I16 and head._weight is None
    if head.prepare_kernel(drop_source=True) and head._tiles is not None and head._tiles.dropped:
        # the head's copy holds the shared bytes now: the lookup reads the rows from it (the GGUF pages are gone)
        assert emb.kept() is head._tiles and int(emb.raw.count_nonzero()) < emb.raw.numel()
        assert torch.equal(emb(ids), full[ids])


def test_batch_invariance_off_sends_prefill_batches_to_blas(monkeypatch):
    n, k = 40, 64
    raw = make_raw("Q4_1", n, k)
    lin = QuantLinear.from_raw(raw, "Q4_1", (n, k))
    monkeypatch.setenv("KVINFER_BATCH_INVARIANT", "0")
    options.reload()
    xb = torch.randn(200, k)
    assert rel_err(lin(xb), reference(xb, raw, "Q4_1", n, k)) < TOL and lin._weight is not None


def test_kernel_linear_matches_linear_and_is_row_invariant():
    from torch import nn

    from kvinfer.layers.quant_linear import KernelLinear

    ref = nn.Linear(96, 50)
    lin = KernelLinear.from_linear(ref)
    x = torch.randn(7, 96)
    torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x)[3], lin(x[3:4])[0])
    assert lin(x.reshape(7, 1, 96)).shape == (7, 1, 50)
    assert lin(x.double()).dtype == torch.float64  # other dtypes: F.linear


@pytest.mark.parametrize("qtype", QTYPES + ("F32", "F16", "BF16"))
def test_embedding_rows_in_c_are_the_dequantized_rows_on_every_level(qtype):
    """kvq_embed_rows (QuantEmbedding's lookup) gives the very floats of the Python dequantisation, any id shape,
    repeated ids, every level; an id outside the vocabulary is a ValueError naming the range."""
    n, k = 50, 96
    fdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if qtype in QTYPES:
        w = torch.from_numpy(make_raw(qtype, n, k))
        full = dequantize(w.numpy(), qtype, (n, k))
    else:
        w = torch.randn(n, k).to(fdt[qtype])
        full = w.float()
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    for lv in levels_here():
        got = kernels.library(lv).embed_rows(w, qtype, ids, k)
        assert got.shape == (2, 3, k)
        assert torch.equal(got.view(torch.int32), full[ids].view(torch.int32)), lv
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        kernels.embed_rows(w, qtype, torch.tensor([50]), k)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        kernels.embed_rows(w, qtype, torch.tensor([-1]), k)
    if qtype in QTYPES:  # the layer takes the kernel route and gives the same rows
        emb = QuantEmbedding(w, qtype, (n, k))
        assert torch.equal(emb(ids), full[ids])


AVX512 = kernels.best_level() == "avx512"


def kept_bytes(qtype: str, n: int, k: int) -> int:
    """The kept copy's size: per 16 output columns, the quants (Q8_0: 512 bytes a block, 4-bit: the 256 bytes of
    nibbles) and the blocks' fp16 d (and Q4_1's m), rounded up to 64 bytes."""
    per_block = (512 if qtype == "Q8_0" else 256) + 32 * (2 if qtype == "Q4_1" else 1)
    return (n + 15) // 16 * ((k // 32 * per_block + 63) // 64 * 64)


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_weights_kept_in_tile_layout_give_the_same_bits(qtype):
    # A weight kept in tile layout (unpacked once, passed beside the weight) is read by both quantised routes
    # of the avx512 level: the vector route (kept_rows: unsigned activation bytes x signed quants, vpdpbusd, no
    # per-block transpose) and, from amx_min_rows rows, the AMX tiles without unpacking. Every row count, with the
    # tiles on and off and on 1 or 2 threads, must still give the GGML-row route's and the portable level's bits,
    # and a call without the copy (or with a released one) reads the GGML rows.
    lib = kernels.library("avx512")
    generic = kernels.library("generic")
    for n, k in [(37, 64), (129, 576), (61, 1536), (100, 608), (16, 32), (3, 32), (1290, 4096)]:  # (the last: spans)
        w = torch.from_numpy(make_raw(qtype, n, k, seed=n + 1))
        b = torch.randn(n)
        lo = lib.amx_min_rows or 24
        xs = {m: torch.randn(m, k) * 10.0 ** (m % 7 - 3) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, lo - 1, lo, 33, 47)}
        xs[5][2] = 0.0  # an all-zero row: every block's scale 0
        before = {m: lib.matmul(x, w, qtype, bias=b) for m, x in xs.items()}
        kept = lib.keep_tiles(w, n, k, qtype)
        assert kept is not None and kept.nbytes == kept_bytes(qtype, n, k)
        raw = w.clone()
        w.zero_()  # the GGUF rows are no longer read: every route must take the kept copy

        def as_the_portable_level(m, x, y):
            assert torch.equal(y, generic.matmul(x, raw, qtype, bias=b)), (n, k, m)

        try:
            assert_kept_routes(lib, w, qtype, kept, xs, before, bias=b, also=as_the_portable_level, tag=(n, k))
        finally:
            w.copy_(raw)
        kept.release()
        assert all(torch.equal(lib.matmul(x, w, qtype, bias=b, kept=kept), before[m]) for m, x in xs.items())


def test_weights_are_kept_in_tile_layout_only_at_the_avx512_level():
    # 32-weight types: a tile copy at the avx512 level only (the avx2 level keeps K-quants alone: test_kquant_kernels)
    w = torch.from_numpy(make_raw("Q4_1", 64, 64, seed=3))
    for lv in [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]:
        lib = kernels.library(lv)
        kept = lib.keep_tiles(w, 64, 64, "Q4_1")
        assert (kept is not None) == (lv == "avx512"), lv
        assert lib.keeps_tiles == (lv != "generic"), lv
        if kept is not None:
            kept.release()
    assert kernels.library("generic").amx_min_rows == 0  # no tiles at this level
    lib = kernels.active()
    assert lib.keep_tiles(torch.randn(64, 64), 64, 64, "F32") is None  # float weights have no tiles


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 VNNI (the level that keeps weights in tile layout)")
def test_the_engine_keeps_quantised_weights_in_tile_layout_and_counts_them(monkeypatch):
    from kvinfer import LLM, SamplingParams
    from kvinfer.layers.quant_linear import QuantLinear

    if kernels.level() != "avx512":
        pytest.skip("KVINFER_ISA forces a level without tiles")
    llm = LLM(None, kv_cache_memory=8 << 20, max_model_len=256)
    model = llm.engine.loaded.model
    lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert lins and all(m._tiles is not None for m in lins)  # at start-up, before the KV budget
    tiles = sum(m._tiles.nbytes for m in lins)
    quant = sum(m.raw.numel() for m in lins if not m._tiles.dropped)  # rows whose pages were given back hold none
    assert model.weight_bytes() >= tiles + quant
    if kernels.drop_source_enabled():  # every Q4_1 row is held by its copy alone
        assert any(m._tiles.dropped for m in lins) and model.weight_bytes() < tiles + sum(m.raw.numel() for m in lins)
    assert "weights kept in tile layout" in kernels.describe()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = [list(range(1, 2 + kernels.active().amx_min_rows))]  # a prefill on the tiles
    lib = kernels.active()
    route = lib.prompt_route
    lib.set_prompt_route(False)  # (the prompt route reads only the kept copy: compare the int8 routes alone)
    try:
        kept = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        monkeypatch.setenv("KVINFER_AMX_KEEP", "0")
        options.reload()
        plain_llm = LLM(None, kv_cache_memory=8 << 20, max_model_len=256)
        assert not plain_llm.engine.runner.prompt_route
        assert all(m._tiles is None for m in plain_llm.engine.loaded.model.modules() if isinstance(m, QuantLinear))
        plain = plain_llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    finally:
        lib.set_prompt_route(route)
    assert (kept.token_ids, kept.logprobs) == (plain.token_ids, plain.logprobs)
