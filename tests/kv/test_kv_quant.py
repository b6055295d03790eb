"""The 8-bit and bfloat16 KV caches (--kv-cache-dtype int8|fp8|bfloat16): quantisation against float64, the
attention kernel over such pools, the budget, exactness, and fidelity on the built-in model."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.config import EngineConfig
from kvinfer.errors import ValidationError
from kvinfer.kv.cache import PagedCache, SeqSlice
from tests.builtin_helpers import PROMPTS

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the 8-bit KV cache needs the CPU kernels")


def _hadamard(n: int) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard matrix in Sylvester order (H H = n I), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[..., D] through H per group of 32 (D a multiple of 32; / 32 to go back), in float64."""
    y = x.double().reshape(*x.shape[:-1], -1, 32) @ _hadamard(32)
    return (y / 32 if inverse else y).reshape(x.shape)


def _quantise(x: torch.Tensor, kv_dtype: str, lib=None):
    """x [T, KVH, D] through kv_store into a [T, KVH, D] 8-bit pool. Returns (codes, scales, stored, values):
    stored = codes x scales, the space the cache holds (rotated when D is a multiple of 32), and values = the
    same brought back to x's space, in float64."""
    lib = lib or kernels.active()
    T, KVH, D = x.shape
    if kv_dtype == "bfloat16":  # no scales, no rotation: the values themselves, rounded
        codes = torch.zeros(T, KVH, D, dtype=torch.bfloat16)
        lib.kv_store(x, codes, None, torch.arange(T) * KVH * D, D, kv_dtype)
        return codes, None, codes.double(), codes.double()
    gs = 32 if D % 32 == 0 else D
    codes = torch.zeros(T, KVH, D, dtype=kernels.KV_STORAGE[kv_dtype])
    scales = torch.zeros(T, KVH, D // gs)
    lib.kv_store(x, codes, scales, torch.arange(T) * KVH * D, D, kv_dtype)
    values = codes.double() if kv_dtype == "int8" else lib.fp8_values()[codes.long()].double()
    stored = values * scales.double().repeat_interleave(gs, -1)
    return codes, scales, stored, (_rotate(stored, inverse=True) if D % 32 == 0 else stored)


@pytest.mark.parametrize("D", [64, 40])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_round_trip_error_is_bounded_against_float64(kv_dtype, D):
    x = torch.randn(50, 3, D, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 50)[:, None, None]
    x[:, 2, 5] *= 30  # an outlier channel in head 2
    x[7, 1] = 0.0  # an all-zero row: scale 0, exact
    _, scales, stored, back = _quantise(x, kv_dtype)
    gs = 32 if D % 32 == 0 else D
    ref = _rotate(x) if D % 32 == 0 else x.double()  # what the cache quantises, in float64
    err = (stored - ref).abs()
    amax = ref.abs().view(50, 3, D // gs, gs).amax(-1, keepdim=True).expand(50, 3, D // gs, gs).reshape(50, 3, D)
    slack = amax * 1e-5  # the kernel rotates in float32
    if kv_dtype == "int8":  # a step of amax / 127, rounded to nearest: at most half a step
        assert (err <= amax / 127 * 0.5 + slack).all()
    else:  # 3 mantissa bits: relative error <= 2^-4 for normals, an absolute 2^-10 x scale below 2^-6
        assert (err <= torch.maximum(ref.abs() / 16, (amax / 448) * 2.0 ** -10) + slack).all()
    assert torch.equal(back[7, 1], torch.zeros(D, dtype=torch.float64)) and (scales[7, 1] == 0).all()
    assert err.max() > 0  # it does quantise
    if D % 32 == 0 and kv_dtype == "int8":
        # The rotation spreads head 2's outlier over its group: the error is far below one step of the
        # unrotated group's amax / 127 (a rounding error spread evenly over a step: step / sqrt(12) rms).
        plain = x.double().abs().view(50, 3, D // 32, 32).amax(-1).repeat_interleave(32, -1) / 127 / 12 ** 0.5
        rms = lambda t: t.pow(2).mean().sqrt()
        assert rms(back[:, 2] - x[:, 2].double()) < 0.5 * rms(plain[:, 2])


def test_bfloat16_store_is_torch_rounding_bit_for_bit_on_every_level():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-40, 38, 64)[:, None, None]
    x[0, 0, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 1e-45])
    x[1, 0, :4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 2 ** -130])  # ties, subnormal
    want = x.to(torch.bfloat16)
    for lv in [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]:
        codes, _, _, _ = _quantise(x, "bfloat16", kernels.library(lv))
        assert torch.equal(codes.view(torch.int16), want.view(torch.int16)), lv
    x[2, 1, 7] = float("nan")
    codes, _, _, _ = _quantise(x, "bfloat16")
    assert torch.isnan(codes[2, 1, 7].float())
    with pytest.raises(ValueError, match="no scales"):
        kernels.active().kv_store(x, codes, torch.zeros(64, 3, 2), torch.arange(64) * 192, 64, "bfloat16")


def test_fp8_is_e4m3fn_bit_for_bit():
    lib = kernels.active()
    table = lib.fp8_values()
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(table), torch.isnan(want))
    assert torch.equal(table[~torch.isnan(want)], want[~torch.isnan(want)])
    # Rows whose largest |value| is 448 are encoded with scale 1: the codes must be torch's own rounding (a head
    # size that is not a multiple of 32 is one unrotated group).
    x = torch.randn(40, 1, 40) * 60
    x[:, 0, 0] = 448.0
    codes, scales, _, _ = _quantise(x, "fp8")
    assert (scales == 1.0).all()
    assert torch.equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8))


def _pools_case(kv_dtype, H, KVH, D, lib=None, seed=3, NB=40, per_seq=18, pos=(3, 140, 0, 7, 139, 141)):
    g = torch.Generator().manual_seed(seed)
    BS = 8
    k, v = torch.randn(NB * BS, KVH, D, generator=g), torch.randn(NB * BS, KVH, D, generator=g)
    k[:, :, 3] *= 8  # outlier channels, as real keys have
    kc, ks, _, kd = _quantise(k, kv_dtype, lib)
    vc, vs, _, vd = _quantise(v, kv_dtype, lib)
    shape = (NB, BS, KVH, D)
    tables = torch.randperm(NB, generator=g)[:2 * per_seq].view(2, per_seq).contiguous()
    q = torch.randn(len(pos), H, D, generator=g)
    tok_seq, tok_pos = torch.tensor([0, 0, 1, 1, 1, 0][:len(pos)]), torch.tensor(pos)
    kw = dict(num_kv_heads=KVH, block_size=BS, num_blocks=NB, strides=(BS * KVH * D, KVH * D, D), scale=D ** -0.5)
    pools = dict(k=kc.view(shape), v=vc.view(shape))
    if ks is not None:
        pools.update(k_scale=ks.view(*shape[:-1], -1), v_scale=vs.view(*shape[:-1], -1))
    return q, pools, (kd.float().view(shape), vd.float().view(shape)), tables, tok_seq, tok_pos, kw


def _attend(lib, q, pools, tables, tok_seq, tok_pos, kw, kv_dtype, **extra):
    return lib.attention(q, pools["k"], pools["v"], tables, tok_seq, tok_pos, kv_dtype=kv_dtype,
                         k_scale=pools.get("k_scale"), v_scale=pools.get("v_scale"), **kw, **extra)


@pytest.mark.parametrize("H,KVH,D", [(6, 2, 64), (9, 1, 64), (4, 2, 40)])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_attention_over_8bit_pools_matches_float_attention_on_the_same_values(kv_dtype, H, KVH, D):
    q, pools, (kd, vd), tables, tok_seq, tok_pos, kw = _pools_case(kv_dtype, H, KVH, D)
    lib = kernels.active()
    got = _attend(lib, q, pools, tables, tok_seq, tok_pos, kw, kv_dtype)
    want = lib.attention(q, kd, vd, tables, tok_seq, tok_pos, **kw)
    # fp8 values are multiplied in float; int8 keys meet q rounded to int16 per 32 values and int8 values are
    # summed with int16-rounded weights (relative steps of 1.5e-5), so int8 is close, not float-exact.
    tol = 2e-3 if kv_dtype == "int8" and D % 32 == 0 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if kv_dtype == "bfloat16":  # widened exactly: the float path's own arithmetic, bit for bit
        assert torch.equal(got, want)
        return
    with pytest.raises(ValueError, match="needs float32 k_scale"):
        lib.attention(q, pools["k"], pools["v"], tables, tok_seq, tok_pos, kv_dtype=kv_dtype, **kw)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_8bit_attention_with_alibi_and_a_sliding_window(kv_dtype):
    from kvinfer.layers.alibi import alibi_slopes

    q, pools, (kd, vd), tables, tok_seq, tok_pos, kw = _pools_case(kv_dtype, 6, 2, 64)
    extra = dict(alibi_slopes=alibi_slopes(6), sliding_window=50)  # windows start inside a 256-position piece
    lib = kernels.active()
    got = _attend(lib, q, pools, tables, tok_seq, tok_pos, kw, kv_dtype, **extra)
    want = lib.attention(q, kd, vd, tables, tok_seq, tok_pos, **kw, **extra)
    tol = 2e-3 if kv_dtype == "int8" else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_8bit_attention_is_the_same_bits_on_every_level_alone_or_batched(kv_dtype):
    levels = [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]
    assert len(levels) >= 2
    outs = []
    for lv in levels:
        lib = kernels.library(lv)
        q, pools, _, tables, tok_seq, tok_pos, kw = _pools_case(kv_dtype, 9, 3, 64, lib=lib)
        batched = _attend(lib, q, pools, tables, tok_seq, tok_pos, kw, kv_dtype, num_threads=3)
        for t in range(len(tok_seq)):  # alone, one thread or two: other pieces-as-work-items splits
            for nt in (1, 2):
                alone = _attend(lib, q[t:t + 1], pools, tables, tok_seq[t:t + 1], tok_pos[t:t + 1], kw, kv_dtype,
                                num_threads=nt)
                assert torch.equal(alone[0], batched[t]), (lv, t, nt)
        outs.append((pools, batched))
    for pools, out in outs[1:]:
        assert all(torch.equal(pools[n], outs[0][0][n]) for n in pools)  # the stores agree too
        assert torch.equal(out, outs[0][1])


@pytest.mark.parametrize("H,KVH,D", [(8, 1, 128), (4, 4, 32), (20, 2, 64)])
def test_int8_attention_is_the_same_bits_on_every_level_over_several_pieces(H, KVH, D):
    # Head sizes of 1, 2 and 4 groups, 8 and 10 query heads per kv head, and contexts of one to three 256-position
    # pieces: the AVX-512 level's 16-position scores and 32-dimension values must give the portable level's bits.
    levels = [lv for lv in kernels.LEVELS if kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.best_level())]
    outs = []
    for lv in levels:
        lib = kernels.library(lv)
        q, pools, _, tables, tok_seq, tok_pos, kw = _pools_case("int8", H, KVH, D, lib=lib, NB=150, per_seq=75,
                                                                pos=(599, 255, 0, 256, 513, 17))
        outs.append(_attend(lib, q, pools, tables, tok_seq, tok_pos, kw, "int8", num_threads=2))
        assert torch.isfinite(outs[-1]).all()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_invalid_kv_dtype_names_the_choices(capsys):
    with pytest.raises(ValidationError, match="kv_cache_dtype.*auto, float32, int8, fp8, bfloat16"):
        EngineConfig(kv_cache_dtype="int4")
    from kvinfer.cli import build_parser, main
    from kvinfer.config import KV_CACHE_DTYPES

    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    assert next(a for a in gen._actions if a.dest == "kv_cache_dtype").choices == list(KV_CACHE_DTYPES)

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "invalid choice: 'int4'" in err[-1] and "int8" in err[-1]
    # A cache the kernels read needs float32 activations: one line that says so, not a traceback.
    assert main(["generate", "hi", "--dtype", "bfloat16", "--kv-cache-dtype", "int8", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_cache_dtype='int8'" in err[0] and "--dtype float32" in err[0]


@pytest.fixture(scope="module")
def engines():
    out = {}
    for dt in ("float32", "int8", "fp8", "bfloat16"):
        out[dt] = LLM(None, dtype="float32", kv_cache_memory=64 << 20, kv_cache_dtype=dt, max_model_len=1024)
    return out


def test_budget_holds_about_four_times_the_tokens_of_float32(engines):
    f32, i8 = engines["float32"].engine, engines["int8"].engine
    mc = f32.model_config
    assert i8.kv_bytes_per_token == 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 4 * mc.head_dim // 32)
    ratio = i8.kv_manager.num_total_blocks / f32.kv_manager.num_total_blocks
    assert 3.5 < ratio < 3.6  # 4 bytes -> 1 byte per value, plus 4 bytes of scale per 32 values
    assert i8.kv_cache.k[0].dtype == torch.int8 and engines["fp8"].engine.kv_cache.k[0].dtype == torch.uint8
    assert i8.kv_dtype == "int8" and f32.kv_dtype == "float32"
    bf = engines["bfloat16"].engine  # half of float32's bytes, no scales
    assert bf.kv_bytes_per_token * 2 == f32.kv_bytes_per_token and bf.kv_cache.k[0].dtype == torch.bfloat16
    assert bf.kv_manager.num_total_blocks == 2 * f32.kv_manager.num_total_blocks and not bf.kv_cache.k_scale
    assert bf.kv_dtype == "bfloat16"


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_8bit_cache_keeps_exactness_and_the_fused_step(engines, kv_dtype):
    from kvinfer.engine.model_runner import ModelRunner

    llm = engines[kv_dtype]
    ids = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):", "Once upon a time")]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    together = llm.generate(ids, sp, use_tqdm=False)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in ids]
    old = ModelRunner.use_fused_decode
    ModelRunner.use_fused_decode = False
    try:
        eager = llm.generate(ids, sp, use_tqdm=False)
    finally:
        ModelRunner.use_fused_decode = old
    contiguous = LLM(None, dtype="float32", kv_cache="contiguous", kv_cache_dtype=kv_dtype, max_model_len=1024,
                     max_num_seqs=3, kv_cache_memory=72 << 20)
    cont = contiguous.generate(ids, sp, use_tqdm=False)
    for t, a, e, c in zip(together, alone, eager, cont):
        for other in (a, e, c):
            assert t.outputs[0].token_ids == other.outputs[0].token_ids
            assert [x.logprob for x in t.outputs[0].logprobs] == [x.logprob for x in other.outputs[0].logprobs]




def _teacher_forced(llm, seqs: list[list[int]], prompt_lens=None) -> list[torch.Tensor]:
    """Log-probabilities [len(ids), vocab] of every position of each sequence, all run as one prefill step through
    a paged cache of the engine's KV dtype (an 8-bit cache: prefill attention reads the quantised keys and values,
    as decode does). prompt_lens: how many of each sequence's tokens were its prompt when generated (default: all),
    rows computed by the prompt route where the engine has one, as the engine computed them."""
    from kvinfer.layers.forward_context import ForwardContext, set_forward_context

    eng = llm.engine
    spans, at = [], 0
    for i, ids in enumerate(seqs):
        if eng.runner.prompt_route:
            spans.append((at, at + (len(ids) if prompt_lens is None else prompt_lens[i])))
        at += len(ids)
    model, mc = eng.loaded.model, eng.model_config
    slices, first = [], 0
    for ids in seqs:
        nblk = -(-len(ids) // 16)
        slices.append(SeqSlice(0, len(ids), block_table=list(range(first, first + nblk))))
        first += nblk
    kv = PagedCache(mc.num_layers, first, 16, mc.num_kv_heads, mc.head_dim, torch.float32, "cpu",
                    eng.kv_cache.kv_dtype)
    with torch.inference_mode(), set_forward_context(ForwardContext(prompt_spans=spans)):
        md = kv.prepare(slices)
        hidden = model(torch.tensor([t for ids in seqs for t in ids]),
                       torch.cat([torch.arange(len(ids)) for ids in seqs]), md, kv)
        return list(torch.log_softmax(model.compute_logits(hidden), -1).split([len(ids) for ids in seqs]))


def _perplexity(llm, ids) -> float:
    logp = _teacher_forced(llm, [ids])[0][:-1]
    return math.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def test_fidelity_against_the_float32_cache(engines):
    base = engines["float32"]
    ids = [base.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0)
    ref = base.generate(ids, sp, use_tqdm=False)
    text = (Path(__file__).resolve().parents[1] / "data" / "fidelity.txt").read_text()
    tids = base.tokenizer.encode(text)
    p_ref = _perplexity(base, tids)
    # The reference continuations fed back (teacher forcing): at each of the 20 x 64 positions, does the 8-bit
    # cache pick the float32 cache's greedy token given the same history? Free-running text cannot tell a
    # quantiser's error from a near-tie that, once flipped, changes everything after it.
    forced = [p + list(r.outputs[0].token_ids) for p, r in zip(ids, ref)]
    ref_lp = _teacher_forced(base, forced, [len(p) for p in ids])
    for dt in ("int8", "fp8", "bfloat16"):
        outs = engines[dt].generate(ids, sp, use_tqdm=False)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, ref))
        # |logprob difference| of the reference's own tokens where the two runs still agree
        diffs, agreed = [], 0
        for a, b in zip(outs, ref):
            for x, y, ta, tb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids,
                                    b.outputs[0].token_ids):
                if ta != tb:
                    break
                agreed += 1
                diffs.append(abs(x.logprob - y.logprob))
        tf_agree, tf_total, gaps = 0, 0, []
        for p, f, lp0, lp in zip(ids, forced, ref_lp, _teacher_forced(engines[dt], forced, [len(p) for p in ids])):
            for t in range(len(p) - 1, len(f) - 1):
                assert lp0[t].argmax().item() == f[t + 1]  # the prefill reproduces the greedy run (exactness)
                tf_total += 1
                if lp[t].argmax().item() == f[t + 1]:
                    tf_agree += 1
                else:  # how close the float32 cache's own top two were there
                    top2 = lp0[t].topk(2).values
                    gaps.append((top2[0] - top2[1]).item())
        p = _perplexity(engines[dt], tids)
        total = 64 * len(PROMPTS)
        print(f"{dt}: greedy agreement, teacher-forced {tf_agree}/{tf_total} ({tf_agree / tf_total * 100:.1f}%; "
              f"largest top-2 gap of the float32 cache where they differ {max(gaps, default=0.0):.3f} nats); "
              f"free-running: identical 64-token continuations {same}/{len(PROMPTS)}, tokens before the first "
              f"divergence {agreed}/{total} ({agreed / total * 100:.1f}%), mean |logprob diff| "
              f"{sum(diffs) / len(diffs):.4f}, perplexity {p:.4f} vs {p_ref:.4f} ({(p / p_ref - 1) * 100:+.2f}%)")
        # The contract: perplexity within 1%, and the greedy choice kept at >= 90% of the 1,280 positions given
        # the same history (int8 and bfloat16 keep it at all but near-ties). Free-running greedy text of a 135M
        # model drifts at near-ties (the bfloat16 cache, which only rounds the values, also changes 5 of the 20
        # continuations when measured), so those figures are guarded against collapse only (Intel Xeon, fp8: 728
        # tokens before the first divergence with the int16 route's prompt rows, 547 with the prompt route's bfloat16
        # ones, whose teacher-forced figures hardly move: 1256 -> 1248 of 1280). The mean |logprob
        # difference| guards int8's rotation (int8 measured 0.0111 without it).
        assert abs(p - p_ref) / p_ref < 0.01
        assert tf_agree >= 0.9 * tf_total
        if dt != "fp8":
            assert tf_agree >= 0.99 * tf_total and max(gaps, default=0.0) < 0.1
        assert agreed >= 0.4 * total and same >= 0.15 * len(PROMPTS)
        assert sum(diffs) / len(diffs) < (0.05 if dt == "fp8" else 0.009)


def test_bench_kv_attention_times_every_dtype_on_the_same_values(capsys):
    from kvinfer.cli import main

    assert main(["bench", "kv-attention", "--context", "300", "--calls", "1", "--rounds", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["kv_dtype"]: r for r in res["rows"]}
    assert list(rows) == ["float32", "int8", "fp8", "bfloat16"] and res["context"] == 300 and res["rounds"] == 2
    assert rows["float32"]["speed_vs_float32"] == 1.0 and rows["float32"]["max_abs_diff_vs_float32"] == 0
    assert 0 < rows["int8"]["max_abs_diff_vs_float32"] < rows["fp8"]["max_abs_diff_vs_float32"] < 0.1
    assert 0 < rows["bfloat16"]["max_abs_diff_vs_float32"] < rows["fp8"]["max_abs_diff_vs_float32"]
    assert [r["kv_bytes_per_position"] for r in rows.values()] == [1536, 432, 432, 768]
    assert all(r["us_per_call"] > 0 and r["median_round_ratio"] > 0 for r in rows.values())
    assert main(["bench", "kv-attention", "--context", "64", "--calls", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "over 64 positions" in out[0] and out[1].startswith("machine: ")
    assert [line.split()[0] for line in out[3:]] == ["float32", "int8", "fp8", "bfloat16"]


def test_bench_throughput_compares_an_8bit_cache_at_the_same_budget(tiny_llama_dir, capsys):
    from kvinfer.cli import main

    argv = ["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "4", "--kv-cache-memory", "384KiB",
            "--compare", "kv-int8"]
    assert main(argv[:-1] + ["kv-int8,kv-float32", "--json"]) == 0
    ours, q8, f32 = json.loads(capsys.readouterr().out)["rows"]
    assert f32["kv_dtype"] == "float32" and f32["total_blocks"] == ours["total_blocks"]  # (float32 weights: auto)
    assert (ours["kv_dtype"], q8["kv_dtype"], q8["name"]) == ("float32", "int8", "kvinfer, --kv-cache-dtype int8")
    assert q8["total_blocks"] > 3 * ours["total_blocks"] and q8["generated"] == ours["generated"]
    assert ours["preemptions"] > 0 and q8["preemptions"] < ours["preemptions"]  # the float32 run is KV-bound
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("int8 KV vs float32 KV at ") and "x the generated tokens/s" in last


def test_auto_is_bfloat16_for_quantised_weights_on_the_kernels_and_the_model_dtype_otherwise(tiny_llama_dir):
    # The built-in model's GGUF blocks run on the CPU kernels: half the KV bytes per token by default.
    q = LLM(None, kv_cache_memory=8 << 20, max_model_len=256).engine
    assert q.kv_dtype == "bfloat16" and q.kv_cache.k[0].dtype == torch.bfloat16
    # A float32 safetensors model keeps float32 K/V (so its logits stay comparable with transformers').
    f = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 20).engine
    assert f.kv_dtype == "float32" and f.kv_cache.k[0].dtype == torch.float32
    assert q.kv_bytes_per_token * 2 == LLM(None, kv_cache_memory=8 << 20, max_model_len=256,
                                           kv_cache_dtype="float32").engine.kv_bytes_per_token


def test_float32_cache_needs_float32_activations(tiny_llama_dir):
    from kvinfer.errors import ValidationError

    with pytest.raises(ValidationError, match="kv_cache_dtype.*float32 activations"):
        LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=1 << 20, kv_cache_dtype="float32")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_none_backend_rounds_like_the_cache_dtype(kv_dtype):
    # The none backend keeps no cache, but rounds (bfloat16, the default here) or quantises (int8, fp8) its K/V as
    # a cache of that dtype stores them: the same bits as the paged and contiguous backends.
    ids = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 9, 200, 7]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for kind in ("paged", "contiguous", "none"):
        llm = LLM(None, kv_cache=kind, kv_cache_memory=32 << 20, max_model_len=256, kv_cache_dtype=kv_dtype)
        assert llm.engine.kv_cache.kv_dtype == ("bfloat16" if kv_dtype == "auto" else kv_dtype)
        outs[kind] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(ids, sp, use_tqdm=False)]
    assert outs["paged"] == outs["contiguous"] == outs["none"]
    if kv_dtype != "auto":
        return
    f32 = LLM(None, kv_cache="none", kv_cache_memory=8 << 20, max_model_len=256, kv_cache_dtype="float32")
    plain = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in f32.generate(ids, sp, use_tqdm=False)]
    assert plain != outs["none"]  # the rounding is really applied (logprobs move)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16"])
def test_a_reserved_cache_is_not_resident_until_written(kv_dtype):
    # The budget is reserved at start-up, but pages count only once blocks are written (bfloat16 included).
    before = _rss()
    cache = PagedCache(4, 8192, 16, 4, 64, torch.float32, "cpu", kv_dtype)  # 512 MiB of float32, less packed
    assert cache.nbytes >= 128 << 20
    assert _rss() - before < cache.nbytes // 8  # (other threads of the test process may allocate meanwhile)
    cache.k[0][5].fill_(1)  # writing a block makes its pages resident, and only those
    assert _rss() - before < cache.nbytes // 8
