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
        y = lib.matmul_prompt(x, raw, qt, b)
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
                assert torch.equal(lib.matmul_prompt(x[a:e], raw, qt, b, num_threads=t), y[a:e]), (a, e, t)


@needs_route
def test_prompt_matmul_needs_a_kept_copy():
    lib = kernels.active()
    raw = _weight("Q8_0", 32, 64)  # never kept
    assert lib.matmul_prompt(torch.randn(3, 64), raw, "Q8_0") is None
    assert "prompt rows on AMX bfloat16 tiles" in kernels.describe()


@needs_route
def test_quant_linear_computes_prompt_rows_by_their_route_and_the_rest_as_before():
    from kvinfer.layers.quant_linear import QuantLinear, prompt_rows

    lin = QuantLinear(_weight("Q4_1", 96, 128), "Q4_1", (96, 128), bias=torch.randn(96))
    assert lin.uses_kernel() and lin._tiles is not None
    x = torch.randn(30, 128)
    plain = lin(x)
    with prompt_rows([(2, 9), (20, 30)]):
        mixed = lin(x)
    lib = kernels.active()
    prompt = lib.matmul_prompt(x, lin.raw, "Q4_1", lin.bias)
    for a, e in ((2, 9), (20, 30)):
        assert torch.equal(mixed[a:e], prompt[a:e])
    for a, e in ((0, 2), (9, 20)):
        assert torch.equal(mixed[a:e], plain[a:e])
    assert not torch.equal(mixed, plain)
    with pytest.raises(RuntimeError, match="outside a batch"):
        with prompt_rows([(25, 31)]):
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
