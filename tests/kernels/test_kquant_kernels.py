"""The K-quant kernels (kquants.c: Q4_K, Q5_K, Q6_K super-blocks read as stored): against the gguf package's
dequantization, bit for bit across levels, threads and batch rows, and the embedding gather."""
from __future__ import annotations

import gguf  # a hard dependency: if missing, these tests must fail, not skip
import numpy as np
import pytest
import torch

import kvinfer.kernels as kernels
import kvinfer.kernels.ops as ops_module
from kvinfer.layers.quant_linear import QuantLinear
from tests.kernel_helpers import KQ_BLOCK_BYTES as BLOCK_BYTES
from tests.kernel_helpers import KTYPES, SBTYPES
from tests.kernel_helpers import kquant_deq as deq
from tests.kernel_helpers import kquant_raw as make_raw

# the types with a kept copy, per level
KEPT_AT = {"avx2": KTYPES + ("Q3_K", "Q2_K"), "avx512": KTYPES + ("Q3_K", "IQ4_XS", "Q2_K")}
# Against float64 of x rounded to int16 per 32-block exactly as the kernel rounds it: only float rounding left.
TOL = 2e-5
# Against float64 of x itself: the int16 rounding of x, as for the 32-weight types (tests/kernels/test_matmul_kernel.py).
TOL_I16 = 2e-4


def _f16(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def reference_i16(x: torch.Tensor, raw: np.ndarray, qtype: str, n: int, k: int) -> torch.Tensor:
    """x . w in float64 with x rounded per 32-block as the kernel rounds it; Q4_K / Q5_K's minimum meets the exact x
    (a block's sum): -dmin * m_j is what the gguf package dequantizes from a block whose quants are all zero."""
    xb = x.double().reshape(x.shape[0], k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    xr = (torch.round((xb.float() * inv).double()) * (amax / 32767.0).double()).reshape(x.shape)
    y = xr @ deq(raw, qtype, n, k).double().T
    if qtype not in ("Q6_K", "IQ4_XS", "Q3_K"):
        zero = raw.reshape(n, k // 256, BLOCK_BYTES[qtype]).copy()
        zero[:, :, 16:80 if qtype == "Q2_K" else None] = 0  # qh (Q5_K) and qs
        y += (x.double() - xr) @ deq(np.ascontiguousarray(zero.reshape(n, -1)), qtype, n, k).double().T
    return y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _levels_here():
    return [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]


@pytest.mark.parametrize("qtype", SBTYPES)
@pytest.mark.parametrize("n, k, m", [(1, 256, 1), (37, 512, 5), (64, 1024, 3)])
def test_matches_the_gguf_dequantization(qtype, n, k, m):
    raw = make_raw(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = kernels.matmul(x, torch.from_numpy(raw), qtype)
    assert rel_err(y, reference_i16(x, raw, qtype, n, k)) < TOL
    assert rel_err(y, x.double() @ deq(raw, qtype, n, k).double().T) < TOL_I16
    bias = torch.randn(n)
    assert torch.equal(kernels.matmul(x, torch.from_numpy(raw), qtype, bias=bias), y + bias)


@pytest.mark.parametrize("qtype", SBTYPES)
def test_every_level_batch_and_thread_count_gives_a_row_the_same_bits(qtype):
    n, k = 45, 768  # a tail group of 5 columns; 3 super-blocks
    raw = torch.from_numpy(make_raw(qtype, n, k, seed=3))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    x[7] = 0.0  # an all-zero row (dx = 0)
    libs = [kernels.library(lv) for lv in _levels_here()]
    assert len(libs) >= 2  # generic and avx2 at least
    alone = torch.cat([libs[0].matmul(x[i:i + 1].clone(), raw, qtype) for i in range(19)])
    for lib in libs:
        for m in (1, 2, 4, 6, 8, 9, 19):  # the pair route (from 3 rows): 4 rows at a time, then 1-3
            for nt in (1, 2, 3):
                assert torch.equal(lib.matmul(x[:m], raw, qtype, num_threads=nt), alone[:m]), (lib.level, m, nt)


@pytest.mark.parametrize("qtype", SBTYPES)
def test_embedding_rows_are_the_gguf_floats(qtype):
    n, k = 11, 512
    raw = make_raw(qtype, n, k, seed=5)
    ids = torch.tensor([[3, 0], [10, 3]])
    want = deq(raw, qtype, n, k)[ids]
    for lv in _levels_here():
        assert torch.equal(kernels.library(lv).embed_rows(torch.from_numpy(raw), qtype, ids, k), want), lv
    with pytest.raises(ValueError):
        kernels.embed_rows(torch.from_numpy(raw), qtype, torch.tensor([11]), k)


def test_bad_shapes_are_refused():
    raw = torch.from_numpy(make_raw("Q4_K", 4, 512))
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(1, 480), raw[:, :144 * 2], "Q4_K")  # K not a whole number of super-blocks
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(1, 512), raw[:, :144], "Q4_K")  # rows too short for K


def test_quant_linear_keeps_k_quants_quantized():
    n, k = 24, 512
    raw = make_raw("Q6_K", n, k, seed=9)
    lin = QuantLinear(torch.from_numpy(raw), "Q6_K", (n, k))
    x = torch.randn(3, k)
    assert lin.raw.dtype == torch.uint8
    assert torch.equal(lin(x), kernels.matmul(x, torch.from_numpy(raw), "Q6_K"))


def test_a_mixed_type_projection_keeps_each_part_quantized():
    # Q4_K_M: q/k in Q4_K, v in Q6_K (the loader's quantize_from_gguf builds QuantParts for such a layer)
    from kvinfer.layers.quant_linear import QuantParts
    k = 512
    specs = [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)]
    raws = [make_raw(qt, n, k, seed=20 + i) for i, (qt, n) in enumerate(specs)]
    layer = QuantParts([QuantLinear(torch.from_numpy(r), qt, (n, k)) for r, (qt, n) in zip(raws, specs)])
    assert layer.out_features == 64 and all(p.raw.dtype == torch.uint8 for p in layer.parts)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(21))
    y = layer(x)
    want = torch.cat([kernels.matmul(x, torch.from_numpy(r), qt) for r, (qt, n) in zip(raws, specs)], dim=1)
    assert torch.equal(y, want)
    ref = x.double() @ torch.cat([deq(r, qt, n, k) for r, (qt, n) in zip(raws, specs)]).double().T
    assert rel_err(y, ref) < TOL_I16
    assert torch.equal(layer(x[2:3].clone()), y[2:3])  # a row alone: the same bits


def test_quantize_from_gguf_keeps_a_mixed_layer_in_parts():
    # One Llama layer as a Q4_K_M file types it: q/k Q4_K with v Q6_K, gate Q4_K with up Q6_K, o and down Q4_K.
    from kvinfer.config import ModelConfig
    from kvinfer.layers.quant_linear import QuantParts
    from kvinfer.loaders.model_loader import build_model
    from kvinfer.models.quantize import quantize_from_gguf

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=32)
    model = build_model(cfg, 32, torch.float32, torch.device("cpu")).eval()
    p = "model.layers.0."
    specs = {"self_attn.q_proj": ("Q4_K", 256, 256), "self_attn.k_proj": ("Q4_K", 128, 256),
             "self_attn.v_proj": ("Q6_K", 128, 256), "self_attn.o_proj": ("Q4_K", 256, 256),
             "mlp.gate_proj": ("Q4_K", 512, 256), "mlp.up_proj": ("Q6_K", 512, 256),
             "mlp.down_proj": ("Q4_K", 256, 512)}
    raw = {f"{p}{name}.weight": (torch.from_numpy(make_raw(qt, n, k, seed=i)), qt, (n, k))
           for i, (name, (qt, n, k)) in enumerate(specs.items())}
    assert quantize_from_gguf(model, raw) == 4
    layer = model.layers[0]
    assert isinstance(layer.attn.qkv, QuantParts) and isinstance(layer.mlp.gate_up, QuantParts)
    assert [q.qtype for q in layer.attn.qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(layer.attn.o, QuantLinear) and layer.attn.o.qtype == "Q4_K"
    x = torch.randn(3, 256)
    want = torch.cat([kernels.matmul(x, raw[f"{p}mlp.{n}.weight"][0], q) for n, q in (("gate_proj", "Q4_K"),
                                                                                     ("up_proj", "Q6_K"))], 1)
    assert torch.equal(layer.mlp.gate_up(x), want)


KEPT_LEVELS = [lv for lv in ("avx2", "avx512") if lv in _levels_here()]


@pytest.mark.skipif(not KEPT_LEVELS, reason="kept copies are an avx2/avx512 layout; this CPU has neither")
@pytest.mark.parametrize("level", ["avx2", "avx512"])
@pytest.mark.parametrize("qtype", SBTYPES)
def test_the_kept_copy_gives_the_same_bits_as_the_gguf_rows(qtype, level):
    # kquants.c's kept routes (byte dot products over the copy laid out at load; at avx2 from 3 rows the int16
    # route reading the copy straight into its pairs) against kq_cols over the GGUF rows: every row
    # count (tiles and their tails, the pair route's 4 rows and 1-3 more), thread count, a tail group of 13
    # columns, a bias, an all-zero row
    if level not in KEPT_LEVELS:
        pytest.skip(f"this CPU cannot run the {level} level")
    if qtype not in KEPT_AT[level]:  # IQ4_XS at avx2: T's values would saturate vpmaddubsw
        assert kernels.library(level).keep_tiles(torch.from_numpy(make_raw(qtype, 16, 256)), 16, 256, qtype) is None
        return
    lib = kernels.library(level)
    n, k = 45, 768
    raw = torch.from_numpy(make_raw(qtype, n, k, seed=30))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(31))
    x[7] = 0.0
    bias = torch.randn(n)
    want = {m: lib.matmul(x[:m], raw, qtype, bias=bias, num_threads=1) for m in (1, 2, 3, 6, 8, 9, 19)}
    kept = lib.keep_tiles(raw, n, k, qtype)
    assert kept is not None and kept.nbytes >= raw.numel()
    try:
        for m, y in want.items():
            for nt in (1, 2, 3):
                assert torch.equal(lib.matmul(x[:m], raw, qtype, bias=bias, num_threads=nt, kept=kept), y), (m, nt)
        assert rel_err(want[19], reference_i16(x, raw.numpy(), qtype, n, k) + bias.double()) < TOL
        kept.tiles[:64] ^= 1  # the copy passed is what the kernel reads, on every route
        assert not torch.equal(lib.matmul(x[:1], raw, qtype, bias=bias, kept=kept), want[1])
        assert not torch.equal(lib.matmul(x[:9], raw, qtype, bias=bias, kept=kept), want[9])
        assert torch.equal(lib.matmul(x[:9], raw, qtype, bias=bias), want[9])  # a call without it reads the rows
        kept.tiles[:64] ^= 1
    finally:
        kept.release()


@pytest.mark.skipif(not KEPT_LEVELS, reason="kept copies are an avx2/avx512 layout; this CPU has neither")
@pytest.mark.parametrize("level", ["avx2", "avx512"])
@pytest.mark.parametrize("qtype", SBTYPES + ("Q4_0", "Q4_1", "Q8_0"))
def test_a_dropped_source_is_served_from_the_copy_and_restored_byte_for_byte(qtype, level):
    if level not in KEPT_LEVELS:
        pytest.skip(f"this CPU cannot run the {level} level")
    kept_here = qtype in KEPT_AT[level] or level == "avx512" and qtype not in SBTYPES
    lib = kernels.library(level)
    n, k = 200, 1024
    if qtype in SBTYPES:
        raw_np = make_raw(qtype, n, k, seed=40)
    else:  # random quants, sane fp16 d (and m)
        bb = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
        rng = np.random.default_rng(41)
        blocks = rng.integers(0, 256, (n, k // 32, bb), dtype=np.uint8)
        blocks[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qtype == "Q4_1":
            blocks[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
        raw_np = blocks.reshape(n, -1)
    # page-aligned private memory, as a large read buffer is: the drop really gives pages back
    import mmap
    buf = mmap.mmap(-1, raw_np.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8).view(n, -1)
    raw.copy_(torch.from_numpy(np.ascontiguousarray(raw_np)))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(42))
    ids = torch.tensor([0, 199, 17, 17, 64])
    y, rows = lib.matmul(x, raw, qtype), lib.embed_rows(raw, qtype, ids, k)
    if not kept_here:  # no copy at this level (IQ4_XS and the 32-weight types at avx2): nothing dropped
        assert lib.keep_tiles(raw, n, k, qtype, drop_source=True) is None
        assert torch.equal(raw, torch.from_numpy(np.ascontiguousarray(raw_np)))
        assert torch.equal(lib.matmul(x, raw, qtype), y)
        del raw
        buf.close()
        return
    kept = lib.keep_tiles(raw, n, k, qtype, drop_source=True)
    assert kept is not None and kept.dropped
    assert int(raw.count_nonzero()) < raw.numel() // 2  # the pages read back as zeros: they were given back
    assert torch.equal(lib.matmul(x, raw, qtype, kept=kept), y)  # the kernels read the copy (every route)
    assert torch.equal(lib.matmul(x[:1].clone(), raw, qtype, kept=kept), y[:1])
    assert torch.equal(lib.embed_rows(raw, qtype, ids, k, kept=kept), rows)
    with pytest.raises(ValueError):
        lib.embed_rows(raw, qtype, torch.tensor([200]), k, kept=kept)
    kept.restore_source()
    assert torch.equal(raw, torch.from_numpy(np.ascontiguousarray(raw_np)))  # the file's bytes again
    kept.release()
    del raw
    buf.close()


@pytest.mark.skipif(kernels.level() not in ("avx2", "avx512"), reason="the active kernels keep no copies")
def test_quant_linear_source_restores_a_dropped_weight():
    n, k = 64, 512
    raw = make_raw("Q4_K", n, k, seed=50)
    lin = QuantLinear(torch.from_numpy(raw.copy()), "Q4_K", (n, k))
    x = torch.randn(2, k)
    y = lin(x)
    if lin._tiles is None:
        pytest.skip("the active kernels keep no copies (KVINFER_AMX_KEEP=0)")
    assert lin._tiles.drop_source()
    assert torch.equal(lin(x), y)
    assert torch.equal(lin.source(), torch.from_numpy(raw)) and not lin._tiles.dropped
    assert torch.equal(lin.dequantized_weight(), deq(raw, "Q4_K", n, k))


@pytest.mark.skipif(not KEPT_LEVELS, reason="kept copies are an avx2/avx512 layout; this CPU has neither")
@pytest.mark.parametrize("qtype", KTYPES + ("Q4_0",))
def test_a_kept_copy_is_taken_only_with_its_own_weight_and_level(qtype):
    # C trusts the copy it is passed (no table checks it against the weight any more): the wrappers refuse a copy
    # of another weight, shape or type, or one laid out by another level's library, and a released copy is not
    # passed at all.
    level = KEPT_LEVELS[-1]
    if level == "avx2" and qtype not in KTYPES:
        pytest.skip("at the avx2 level only K-quants have a kept copy")
    lib = kernels.library(level)
    n, k = 32, 512

    def weight(seed):
        raw = torch.from_numpy(make_raw(qtype, n, k, seed=seed) if qtype in KTYPES
                               else np.random.default_rng(seed).integers(0, 256, (n, k // 32 * 18), dtype=np.uint8))
        if qtype == "Q4_0":
            raw.view(n, k // 32, 18)[:, :, 0:2] = torch.tensor(_f16(0.01))
        return raw

    raw, other = weight(60), weight(61)
    x = torch.randn(3, k)
    y = lib.matmul(x, raw, qtype)
    kept = lib.keep_tiles(raw, n, k, qtype)
    assert kept is not None and torch.equal(lib.matmul(x, raw, qtype, kept=kept), y)
    with pytest.raises(ValueError, match="is not the copy"):
        lib.matmul(x, other, qtype, kept=kept)
    with pytest.raises(ValueError, match="is not the copy"):
        lib.matmul(x[:, :256], raw, qtype, kept=kept)  # the same bytes read as shorter rows
    with pytest.raises(ValueError, match="is not the copy"):
        lib.embed_rows(other, qtype, torch.tensor([1]), k, kept=kept)
    lower = [lv for lv in KEPT_LEVELS if lv != level]
    for lv in lower:
        with pytest.raises(ValueError, match="is not the copy"):
            kernels.library(lv).matmul(x, raw, qtype, kept=kept)
    kept.release()
    assert kept.ptr is None and torch.equal(lib.matmul(x, raw, qtype, kept=kept), y)


def test_iq4_xs_is_kept_quantized_and_reads_its_scales_and_table():
    # one super-block whose sub-block j has ls_j = 32 + j + 1 and every index = j: w = d (j + 1) T[j]
    blk = np.zeros(136, dtype=np.uint8)
    blk[0:2] = _f16(0.5)
    ls = [33 + j for j in range(8)]
    h = sum(((v >> 4) & 3) << (2 * j) for j, v in enumerate(ls))
    blk[2:4] = np.frombuffer(np.uint16(h).tobytes(), np.uint8)
    for j in range(4):
        blk[4 + j] = (ls[2 * j] & 15) | ((ls[2 * j + 1] & 15) << 4)
    for j in range(8):
        blk[8 + 16 * j:24 + 16 * j] = j | (j << 4)
    table = [-127, -104, -83, -65, -49, -35, -22, -10]
    want = torch.tensor([0.5 * (j + 1) * table[j] for j in range(8) for _ in range(32)])
    raw = torch.from_numpy(blk.reshape(1, 136))
    assert torch.equal(deq(blk.reshape(1, 136), "IQ4_XS", 1, 256)[0], want)
    for lv in _levels_here():
        lib = kernels.library(lv)
        assert torch.equal(lib.embed_rows(raw, "IQ4_XS", torch.tensor([0]), 256)[0], want), lv
        x = torch.zeros(1, 256)
        x[0, 40] = 1.0  # sub-block 1: 2 * 0.5 * T[1]
        assert lib.matmul(x, raw, "IQ4_XS").item() == pytest.approx(-104.0, rel=1e-6), lv
    lin = QuantLinear(raw.clone(), "IQ4_XS", (1, 256))
    assert lin.raw.dtype == torch.uint8 and lin.prepare_kernel()


@pytest.mark.skipif(kernels.level() not in ("avx2", "avx512"), reason="the active kernels keep no copies")
def test_a_dropped_weight_is_copied_and_saved_as_its_gguf_bytes_and_not_restored_at_teardown():
    import copy
    import gc
    import mmap
    n, k = 64, 4096
    raw_np = make_raw("Q4_K", n, k, seed=70)
    buf = mmap.mmap(-1, raw_np.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8).view(n, -1)
    raw.copy_(torch.from_numpy(raw_np))
    lin = QuantLinear(raw, "Q4_K", (n, k))
    if not lin.prepare_kernel(drop_source=True) or lin._tiles is None:
        pytest.skip("the active kernels keep no copies (KVINFER_AMX_KEEP=0)")
    assert lin._tiles.dropped and int(raw.count_nonzero()) < raw.numel() // 2
    x = torch.randn(2, k)
    y = lin(x)
    twin = copy.deepcopy(lin)  # the copy holds the file's bytes; the original keeps computing the same
    assert torch.equal(twin.raw, torch.from_numpy(raw_np)) and torch.equal(twin(x), y) and torch.equal(lin(x), y)
    assert torch.equal(lin.state_dict()["raw"], torch.from_numpy(raw_np))
    assert lin._tiles.drop_source()  # pages given back again
    del lin, twin
    gc.collect()
    # the layer is gone with its copy: its pages were not written back just to be freed
    assert int(raw.count_nonzero()) < raw.numel() // 2
    del raw
    buf.close()


@pytest.mark.skipif(not KEPT_LEVELS, reason="kept copies are an avx2/avx512 layout; this CPU has neither")
@pytest.mark.parametrize("level", ["avx2", "avx512"])
@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q4_0", "Q8_0"))
def test_a_copy_packed_from_parts_is_the_copy_of_the_stacked_rows(qtype, level):
    # keep_tiles_from (a fused projection kept at load without stacking its parts first) against keep_tiles over
    # the stacked rows: the same bytes; the weight is never written (dropped) and restore_source gives the rows.
    if level not in KEPT_LEVELS:
        pytest.skip(f"this CPU cannot run the {level} level")
    lib = kernels.library(level)
    k, sizes = 512, (64, 32, 45)  # the last part may end anywhere
    if qtype in SBTYPES:
        rows = [make_raw(qtype, r, k, seed=60 + i) for i, r in enumerate(sizes)]
    else:
        bb = {"Q4_0": 18, "Q8_0": 34}[qtype]
        rng = np.random.default_rng(61)
        rows = []
        for r in sizes:
            blocks = rng.integers(0, 256, (r, k // 32, bb), dtype=np.uint8)
            blocks[:, :, 0:2] = _f16(0.01)
            rows.append(blocks.reshape(r, -1))
    stacked = torch.from_numpy(np.concatenate(rows))
    n = stacked.shape[0]
    w = torch.empty_like(stacked)
    parts = [torch.from_numpy(r.copy()) for r in rows]
    kept = lib.keep_tiles_from(w, parts, k, qtype)
    if not lib.drops_kept_source(qtype):  # no copy of this type at this level: nothing packed, nothing dropped
        assert kept is None and lib.keep_tiles(stacked, n, k, qtype, drop_source=True) is None
        return
    want = lib.keep_tiles(stacked, n, k, qtype)
    assert kept is not None and kept.dropped and torch.equal(kept.tiles, want.tiles)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(62))
    assert torch.equal(lib.matmul(x, w, qtype, kept=kept), lib.matmul(x, stacked, qtype))
    kept.restore_source()
    assert torch.equal(w, stacked) and not kept.dropped
    # A part that does not start at a whole group of 32 columns: refused, nothing packed.
    assert lib.keep_tiles_from(w, [stacked[:40], stacked[40:]], k, qtype) is None


@pytest.mark.skipif(not KEPT_LEVELS, reason="kept copies are an avx2/avx512 layout; this CPU has neither")
@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K", "Q8_0"))
def test_a_copy_packed_in_runs_of_rows_is_the_copy_packed_at_once(qtype, monkeypatch):
    # A dropped source is packed in runs of rows (each run's pages given back before the next is read, so only one
    # run sits beside the copy); runs of 32 rows here, so 200 rows take 7 and the parts below cross run ends.
    level = KEPT_LEVELS[-1]
    lib = kernels.library(level)
    if not lib.drops_kept_source(qtype):
        pytest.skip(f"{qtype} keeps no copy at the {level} level")
    n, k = 200, 512
    if qtype in SBTYPES:
        raw_np = make_raw(qtype, n, k, seed=70)
    else:
        blocks = np.random.default_rng(71).integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
        blocks[:, :, 0:2] = _f16(0.01)
        raw_np = blocks.reshape(n, -1)
    whole = torch.from_numpy(np.ascontiguousarray(raw_np))
    want = lib.keep_tiles(whole, n, k, qtype)
    monkeypatch.setattr(ops_module, "_DROP_CHUNK_BYTES", 1)
    raw = whole.clone()
    kept = lib.keep_tiles(raw, n, k, qtype, drop_source=True)
    assert kept is not None and kept.dropped and torch.equal(kept.tiles, want.tiles)
    parts = [whole[:64].clone(), whole[64:160].clone(), whole[160:].clone()]
    from_parts = lib.keep_tiles_from(torch.empty_like(whole), parts, k, qtype)
    assert from_parts is not None and torch.equal(from_parts.tiles, want.tiles)
    kept.restore_source()
    assert torch.equal(raw, whole)
