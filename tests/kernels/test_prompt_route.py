"""The prompt rows' route: quantised matmuls of prompt tokens on AMX bfloat16 tiles (kernels.matmul_prompt), chosen
by a row's role and never by its batch, and the engine around it (role-aware prefix-cache hashes, no fused decode
of a prompt token)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvinfer import SamplingParams, kernels
from kvinfer.kv.block_pool import hash_block
from kvinfer.loaders.dequant import dequantize, nbytes_for

ROUTE = kernels.available() and kernels.active().prompt_route
needs_route = pytest.mark.skipif(not ROUTE, reason="the prompt route needs AMX-BF16 tiles the OS grants")
BLOCK = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18}


def _weight(qt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random GGML rows with small fp16 scales (and Q4_1 mins) of mixed sign."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, nbytes_for(qt, (k,))), dtype=torch.uint8, generator=g)
    blocks = raw.view(n, k // 32, BLOCK[qt])
    d = (torch.rand(n, k // 32, generator=g) * 0.02 - 0.01).numpy().astype(np.float16)
    blocks[:, :, 0:2] = torch.from_numpy(d.view(np.uint8).reshape(n, k // 32, 2))
    if qt == "Q4_1":
        m = (torch.rand(n, k // 32, generator=g) * 0.1 - 0.05).numpy().astype(np.float16)
        blocks[:, :, 2:4] = torch.from_numpy(m.view(np.uint8).reshape(n, k // 32, 2))
    return raw


@needs_route
@pytest.mark.parametrize("qt", ["Q8_0", "Q4_1", "Q4_0"])
@pytest.mark.parametrize("n,k", [(100, 576), (64, 96), (33, 32)])
def test_prompt_matmul_is_the_bf16_product_and_row_invariant(qt, n, k):
    lib = kernels.active()
    raw = _weight(qt, n, k)
    kept = lib.keep_tiles(raw, n, k, qt)
    assert kept is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(41, k, generator=g) * 3
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        y = lib.matmul_prompt(x, raw, qt, b, kept=kept)
        w = dequantize(raw, qt, (n, k))
        # the operands as the route rounds them, multiplied exactly; tdpbf16ps adds in float32
        terms = x.to(torch.bfloat16).double()[:, None, :] * w.to(torch.bfloat16).double()[None, :, :]
        ref = terms.sum(-1) + (0 if b is None else b.double())
        tol = terms.abs().sum(-1) * 2 ** -20 + 1e-6
        assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()
        # the int8 route's result is a different number: the route is not a no-op
        assert not torch.equal(y, lib.matmul(x, raw, qt, b))
        # a row's bits depend on its own values only: any slice, any place in a tile, any thread count
        for a, e in ((0, 1), (3, 20), (5, 41), (0, 17), (17, 18), (16, 32), (40, 41)):
            for t in (1, 2):
                assert torch.equal(lib.matmul_prompt(x[a:e], raw, qt, b, num_threads=t, kept=kept), y[a:e]), (a, e, t)


@needs_route
def test_prompt_matmul_needs_a_kept_copy():
    lib = kernels.active()
    raw = _weight("Q8_0", 32, 64)  # never kept
    assert lib.matmul_prompt(torch.randn(3, 64), raw, "Q8_0") is None
    assert "prompt rows' matmuls and attention on AMX bfloat16 tiles" in kernels.describe()


@needs_route
def test_quant_linear_computes_prompt_rows_by_their_route_and_the_rest_as_before():
    from kvinfer.layers.forward_context import ForwardContext, set_forward_context
    from kvinfer.layers.quant_linear import QuantLinear

    lin = QuantLinear(_weight("Q4_1", 96, 128), "Q4_1", (96, 128), bias=torch.randn(96))
    assert lin.prepare_kernel() and lin._tiles is not None
    x = torch.randn(30, 128)
    plain = lin(x)
    with set_forward_context(ForwardContext(prompt_spans=[(2, 9), (20, 30)])):
        mixed = lin(x)
    lib = kernels.active()
    prompt = lib.matmul_prompt(x, lin.raw, "Q4_1", lin.bias, kept=lin._tiles)
    for a, e in ((2, 9), (20, 30)):
        assert torch.equal(mixed[a:e], prompt[a:e])
    for a, e in ((0, 2), (9, 20)):
        assert torch.equal(mixed[a:e], plain[a:e])
    assert not torch.equal(mixed, plain)
    with pytest.raises(ValueError, match="not spans of a batch of 30 rows"):
        with set_forward_context(ForwardContext(prompt_spans=[(25, 31)])):
            lin(x)


def test_block_hashes_can_say_how_many_tokens_are_prompt():
    toks = [5, 6, 7, 8]
    assert hash_block(None, toks) == hash_block(None, toks)
    hashes = {hash_block(None, toks, c) for c in (0, 2, 4)}
    assert len(hashes) == 3 and hash_block(None, toks) not in hashes


@needs_route
def test_a_follow_up_prompt_gets_the_same_result_as_alone_although_its_prefix_was_generated(builtin_model_path):
    """A follow-up turn's prompt holds the first turn's generated tokens, whose cached KV came from the decode
    route: only blocks whose tokens were prompt tokens there too may be reused (role-aware hashes)."""
    from kvinfer.config import EngineConfig
    from kvinfer.engine.llm_engine import LLMEngine

    def engine():
        return LLMEngine(EngineConfig(model=builtin_model_path, dtype="float32", kv_cache_memory=64 << 20,
                                      max_model_len=512, block_size=16))

    def run(eng, rid, prompt, n):
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    c = out.outputs[0]
                    return list(c.token_ids), [lp.logprob for lp in c.logprobs]

    first = list(range(1000, 1040))
    eng = engine()
    assert eng.runner.prompt_route and eng.kv_manager.prompt_roles
    toks, _ = run(eng, "a", first, 40)
    follow = first + toks + [2000, 2001, 2002]
    hits = eng.kv_manager.pool.num_hits
    after = run(eng, "b", follow, 12)
    assert eng.kv_manager.pool.num_hits - hits == 2  # the first 32 prompt tokens only, not the generated ones
    alone = run(engine(), "b", follow, 12)
    assert after == alone


@needs_route
def test_a_prompt_token_computed_alone_takes_the_prompt_route(builtin_model_path):
    """After a full prefix hit the last prompt token is computed alone, a one-token step the fused decode step
    would take: it must still be a prompt row."""
    from kvinfer import LLM

    llm = LLM(builtin_model_path, dtype="float32", kv_cache_memory=64 << 20, max_model_len=256, block_size=16)
    prompt = list(range(3000, 3033))  # 33 tokens: two full blocks and one more
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    a, b = (llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0] for _ in range(2))
    assert llm.engine.kv_manager.pool.num_hits >= 2
    assert a.token_ids == b.token_ids and [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
    # the last prompt token left alone by a 32-token budget, its request running: no fused (multi-)step either
    chunked = LLM(builtin_model_path, dtype="float32", kv_cache_memory=64 << 20, max_model_len=256, block_size=16,
                  max_num_batched_tokens=32, enable_prefix_caching=False, num_scheduler_steps=8)
    c = chunked.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0]
    assert a.token_ids == c.token_ids and [x.logprob for x in a.logprobs] == [x.logprob for x in c.logprobs]


# ---- attention of prompt rows (kvq_attention_prompt) ----

def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _cache(L: int, kvh: int, d: int, bs: int, dtype, seed: int, seqs: int = 1):
    """A paged pool holding `seqs` sequences of L positions in shuffled blocks, and their block tables."""
    g = torch.Generator().manual_seed(seed)
    per = (L + bs - 1) // bs
    nb = per * seqs + 3
    k = (torch.randn(nb, bs, kvh, d, generator=g) * 2).to(dtype)
    v = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: per * seqs].view(seqs, per).contiguous()
    return k, v, tables


def _attn(lib, q, k, v, tables, tok_seq, tok_pos, kvh, **kw):
    nb, bs, _, d = k.shape
    kvd = "bfloat16" if k.dtype == torch.bfloat16 else "float32"
    return lib.attention(q, k, v, tables, tok_seq, tok_pos, num_kv_heads=kvh, block_size=bs, num_blocks=nb,
                         strides=(bs * kvh * d, kvh * d, d), scale=d ** -0.5, kv_dtype=kvd, **kw)


def _reference(q, k, v, tables, seq, pos, kvh, slopes=None):
    """float64 softmax attention of one query row with the operands rounded as the route rounds them (q, keys,
    values and the weights exp(s - m) to bfloat16; l the sum of the rounded weights)."""
    H, d = q.shape
    bs = k.shape[1]
    idx = torch.arange(pos + 1)
    blocks = tables[seq, idx // bs]
    ks, vs = _bf16(k[blocks, idx % bs]), _bf16(v[blocks, idx % bs])  # [p, kvh, d]
    out = []
    for h in range(H):
        g = h // (H // kvh)
        s = (ks[:, g] @ _bf16(q[h])).float().double() * d ** -0.5
        if slopes is not None:
            s = s + float(slopes[h]) * (idx - pos).double()
        p = _bf16(torch.exp(s - s.max()))
        out.append((p @ vs[:, g]) / p.sum())
    return torch.stack(out)


@needs_route
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,kvh,d,alibi", [(9, 3, 64, False), (4, 4, 128, False), (6, 2, 64, True)])
def test_prompt_attention_is_the_bf16_softmax_and_row_invariant(dtype, H, kvh, d, alibi):
    lib = kernels.active()
    L, bs = 600, 16
    k, v, tables = _cache(L, kvh, d, bs, dtype, seed=3)
    q = torch.randn(L, H, d, generator=torch.Generator().manual_seed(4))
    tok_seq, tok_pos = torch.zeros(L, dtype=torch.long), torch.arange(L)
    slopes = torch.linspace(-0.5, -0.01, H) if alibi else None
    kw = {"alibi_slopes": slopes}
    out = _attn(lib, q, k, v, tables, tok_seq, tok_pos, kvh, prompt_spans=[(0, L)], **kw)
    plain = _attn(lib, q, k, v, tables, tok_seq, tok_pos, kvh, **kw)
    errs = sorted((out[t].double() - _reference(q[t], k, v, tables, 0, t, kvh, slopes)).abs().max().item()
                  for t in (0, 1, 15, 16, 31, 32, 255, 256, 257, 511, 512, 599))
    # float32 sums' rounding only, except where a weight's rounding went the other way (exp differing in its
    # last bit at a bfloat16 tie): one weight off by 2^-9 of itself
    assert errs[len(errs) // 2] < 1e-5 and errs[-1] < 4e-3, errs
    # a different number from the float route, not a no-op
    assert not torch.equal(out, plain) and (out - plain).abs().max() < 0.05
    # a row's bits: whatever the chunking of its prompt, the rows beside it, the thread count
    for cuts in ([0, 5, 37, 100, 256, 300, L], [0, 1, 2, 17, 599, L]):
        parts = [_attn(lib, q[a:b], k, v, tables, tok_seq[a:b], tok_pos[a:b], kvh, prompt_spans=[(0, b - a)], **kw)
                 for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), out), cuts
    for nt in (1, 2):
        assert torch.equal(_attn(lib, q, k, v, tables, tok_seq, tok_pos, kvh, prompt_spans=[(0, L)],
                                 num_threads=nt, **kw), out)
    # prompt rows among others: each by its role
    mixed = _attn(lib, q, k, v, tables, tok_seq, tok_pos, kvh, prompt_spans=[(3, 50), (60, L)], **kw)
    for a, b, want in ((0, 3, plain), (3, 50, out), (50, 60, plain), (60, L, out)):
        assert torch.equal(mixed[a:b], want[a:b]), (a, b)


@needs_route
def test_prompt_attention_of_several_sequences_in_one_call():
    lib = kernels.active()
    L, kvh, d = 300, 3, 64
    k, v, tables = _cache(L, kvh, d, 16, torch.bfloat16, seed=5, seqs=3)
    q = torch.randn(3 * L, 9, d, generator=torch.Generator().manual_seed(6))
    alone = [_attn(lib, q[s * L:(s + 1) * L], k, v, tables, torch.full((L,), s), torch.arange(L), kvh,
                   prompt_spans=[(0, L)]) for s in range(3)]
    # interleaved: pieces of the three prompts in one step, in chunks of different lengths
    rows = [(s, a, b) for s, cuts in ((0, [0, 40, 300]), (1, [0, 7, 300]), (2, [0, 299, 300])) for a, b in
            zip(cuts, cuts[1:])]
    qs = torch.cat([q[s * L + a:s * L + b] for s, a, b in rows])
    seq = torch.cat([torch.full((b - a,), s) for s, a, b in rows])
    pos = torch.cat([torch.arange(a, b) for s, a, b in rows])
    out = _attn(lib, qs, k, v, tables, seq, pos, kvh, prompt_spans=[(0, len(pos))])
    at = 0
    for s, a, b in rows:
        assert torch.equal(out[at:at + b - a], alone[s][a:b]), (s, a, b)
        at += b - a


@needs_route
def test_prompt_attention_leaves_jobs_it_does_not_take_to_the_usual_kernel():
    lib = kernels.active()
    L, kvh, d = 100, 2, 64
    k, v, tables = _cache(L, kvh, d, 16, torch.bfloat16, seed=7)
    q = torch.randn(L, 4, d)
    seq, pos = torch.zeros(L, dtype=torch.long), torch.arange(L)
    spans = [(0, L)]
    # a sliding window, a head size that is not a multiple of 64: the usual kernel for every row
    assert torch.equal(_attn(lib, q, k, v, tables, seq, pos, kvh, prompt_spans=spans, sliding_window=20),
                       _attn(lib, q, k, v, tables, seq, pos, kvh, sliding_window=20))
    k32, v32, t32 = _cache(L, kvh, 32, 16, torch.bfloat16, seed=8)
    q32 = torch.randn(L, 4, 32)
    assert torch.equal(_attn(lib, q32, k32, v32, t32, seq, pos, kvh, prompt_spans=spans),
                       _attn(lib, q32, k32, v32, t32, seq, pos, kvh))
    for bad in ([(0, L + 1)], [(5, 5)], [(10, 20), (15, 30)], [(30, 40), (0, 10)], [(-1, 3)]):
        with pytest.raises(ValueError, match="not spans"):
            _attn(lib, q, k, v, tables, seq, pos, kvh, prompt_spans=bad)
    # the route switched off: every row as usual
    assert lib.set_prompt_route(False) is False
    try:
        assert torch.equal(_attn(lib, q, k, v, tables, seq, pos, kvh, prompt_spans=spans),
                           _attn(lib, q, k, v, tables, seq, pos, kvh))
    finally:
        assert lib.set_prompt_route(True)


@needs_route
def test_prompt_attention_over_a_long_context_lays_out_kv_heads_in_groups():
    """Past 32 MiB of laid-out keys and values a call takes its kv heads a group at a time (here one by one: 70,000
    positions of two kv heads): the same results as a row alone, and the reference's."""
    lib = kernels.active()
    L, kvh, d = 70_000, 2, 64
    k, v, tables = _cache(L, kvh, d, 16, torch.bfloat16, seed=9)
    pos = torch.tensor([5, L - 3, L - 2, L - 1])
    q = torch.randn(4, 4, d, generator=torch.Generator().manual_seed(10))
    seq = torch.zeros(4, dtype=torch.long)
    out = _attn(lib, q, k, v, tables, seq, pos, kvh, prompt_spans=[(0, 4)])
    for i in range(4):
        alone = _attn(lib, q[i:i + 1], k, v, tables, seq[i:i + 1], pos[i:i + 1], kvh, prompt_spans=[(0, 1)])
        assert torch.equal(alone[0], out[i])
        assert (out[i].double() - _reference(q[i], k, v, tables, 0, int(pos[i]), kvh)).abs().max() < 4e-3
