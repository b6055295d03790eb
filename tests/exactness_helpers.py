"""The exactness property's machinery: a mix of requests, serving them one way or another through one engine, and
the check that every way gives each request's tokens and logprobs bit for bit as served alone."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck
from hypothesis import strategies as st

from kvinfer import SamplingParams
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.engine.startup import resolve_kv_cache_dtype

MAX_LEN = 96


def sample_requests(vocab: int, lo: int) -> list[tuple[list[int], SamplingParams]]:
    """Six requests: shared prefixes (prefix-cache hits), lengths 3-41, greedy and seeded sampling, logprobs,
    prompt logprobs for two of them (one of which shares its prefix with others) and allowed_token_ids for two."""
    g = torch.Generator().manual_seed(5)
    stem = torch.randint(lo, vocab, (24,), generator=g).tolist()
    prompts = [stem[:20] + [lo + 1, lo + 2], stem[:20] + [lo + 3], stem + stem[:17],
               torch.randint(lo, vocab, (3,), generator=g).tolist(), stem[:9],
               torch.randint(lo, vocab, (30,), generator=g).tolist()]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 2:
            p = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=2)
        else:
            p = SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True, logprobs=2)
        if i in (0, 2):
            p = SamplingParams(**{**p.__dict__, "prompt_logprobs": 2 - i})
        if i in (1, 5):  # a mask on the logits (greedy and sampled): the same tokens however served
            p = SamplingParams(**{**p.__dict__, "allowed_token_ids": list(range(lo, vocab, 2 + i % 3))})
        params.append(p)
    return list(zip(prompts, params))


def serve(loaded, path, reqs, *, kv_cache="paged", block_size=16, kv_tokens=None, budget=2048, prefix=True,
           arrivals=None, order=None, activation_bits=16):
    """Run the requests through one engine; arrivals[i] is the step before which request i joins. Returns
    ({index: (token ids, logprobs)}, preemptions)."""
    kv_dtype = resolve_kv_cache_dtype(EngineConfig(model=path, dtype="float32", device="cpu"), loaded).kv_cache_dtype
    kv_per_token = loaded.config.kv_bytes_per_token(2 if kv_dtype == "bfloat16" else 4)
    if kv_tokens is None:
        mem = kv_per_token * MAX_LEN * 8
    elif kv_cache == "contiguous":
        mem = kv_per_token * MAX_LEN * max(1, kv_tokens // MAX_LEN)
    else:
        mem = kv_per_token * kv_tokens
    cfg = EngineConfig(model=path, dtype="float32", device="cpu", kv_cache=kv_cache, block_size=block_size,
                       kv_cache_memory=mem, max_model_len=MAX_LEN, max_num_batched_tokens=budget,
                       enable_prefix_caching=prefix, activation_bits=activation_bits)
    eng = LLMEngine(cfg, loaded)
    order = list(range(len(reqs))) if order is None else order
    arrivals = arrivals or [0] * len(reqs)
    pending = sorted(order, key=lambda i: arrivals[i])  # stable: ties keep the given order
    done, step = {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            eng.add_request(str(i), reqs[i][0], reqs[i][1])
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                pl = out.prompt_logprobs
                done[int(out.request_id)] = (list(c.token_ids), [lp.logprob for lp in c.logprobs],
                                             [lp.top for lp in c.logprobs],
                                             None if pl is None else [lp and (lp.token_id, lp.logprob, lp.top)
                                                                      for lp in pl])
        step += 1
    return done, eng.scheduler.num_preemptions


ways = st.fixed_dictionaries({
    "kv_cache": st.sampled_from(["paged", "paged", "contiguous", "none"]),
    "block_size": st.sampled_from([1, 4, 16, 32]),
    "kv_tokens": st.sampled_from([None, 72, 160]),  # small budgets preempt
    "budget": st.sampled_from([2048, 64, 16, 7]),  # chunked prefill
    "prefix": st.booleans(),
    "arrivals": st.lists(st.integers(0, 12), min_size=6, max_size=6),
    "order": st.permutations(range(6)),
})


def check_served(loaded, path, reqs, alone, way):
    got, _ = serve(loaded, path, reqs, **way)
    for i, want in alone.items():
        assert got[i][0] == want[0], (i, way)  # tokens
        assert got[i][1] == want[1], (i, way)  # logprobs, bitwise
        assert got[i][2] == want[2], (i, way)  # top alternatives and their logprobs
        assert got[i][3] == want[3], (i, way)  # prompt logprobs


def serve_alone(loaded, path, reqs, **kw):
    return {i: serve(loaded, path, [r], **kw)[0][0] for i, r in enumerate(reqs)}


HYPOTHESIS_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
