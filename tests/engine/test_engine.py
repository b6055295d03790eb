"""The paged engine: exact greedy outputs across backends, batching, preemption, prefix caching, chunking."""
from __future__ import annotations

import random

import pytest

from kvinfer import LLM, SamplingParams
from kvinfer.errors import RequestTooLargeError, ValidationError
from tests.conftest import assert_engine_clean, generate_checked

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n, seed=0, lo=3, hi=40, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(model_dir, ps, params=GREEDY, **kw):
    outs, llm = generate_checked(model_dir, ps, params, **kw)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens for each prompt generated alone with the recompute backend."""
    ps = prompts(64, seed=1)
    ref = []
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache="none")
    for p in ps:
        ref.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
    return ps, ref


def test_backends_agree_and_batching_is_exact(tiny_llama_dir, reference):
    ps, ref = reference
    for kv in ("paged", "contiguous", "none"):
        got, _ = run(tiny_llama_dir, ps[:8], kv_cache=kv, kv_cache_memory=64 << 20)
        assert got == ref[:8], kv
    got, _ = run(tiny_llama_dir, ps)  # 64 mixed-length prompts in one batch
    assert got == ref


def test_preemption_keeps_outputs_exact(tiny_llama_dir, reference):
    ps, ref = reference
    # 2 layers * 2 kv heads * 16 dim * 2 (K,V) * 4 bytes = 512 B/token; 16 blocks of 4 tokens.
    got, llm = run(tiny_llama_dir, ps[:16], kv_cache_memory=512 * 4 * 16)
    assert got == ref[:16]
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_shared_system_prompt(tiny_llama_dir, caching):
    rng = random.Random(5)
    system = [rng.randrange(3, 256) for _ in range(300)]
    ps = [system + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    ref, _ = run(tiny_llama_dir, ps, kv_cache="none")
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4,
              enable_prefix_caching=caching)
    outs = llm.generate(ps[:1], GREEDY) + llm.generate(ps[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    cached = [o.num_cached_tokens for o in outs]
    if caching:
        assert cached[0] == 0 and all(c >= 300 - 4 for c in cached[1:]), cached
        assert llm.engine.kv_manager.pool.num_hits > 0
    else:
        assert cached == [0] * 6
    assert_engine_clean(llm.engine)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(tiny_llama_dir, reference, chunk):
    ps, ref = reference
    got, _ = run(tiny_llama_dir, ps[:6], max_num_batched_tokens=chunk, kv_cache_memory=64 << 20)
    assert got == ref[:6]


def test_chunked_prefill_long_prompt_with_decodes(tiny_llama_dir):
    ps = prompts(4, seed=9, lo=100, hi=200)
    ref, _ = run(tiny_llama_dir, ps, kv_cache="none")
    got, _ = run(tiny_llama_dir, ps, max_num_batched_tokens=33)
    assert got == ref


def test_abort_frees_blocks_by_next_step(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    eng = llm.engine
    eng.add_request("a", prompts(1, seed=3, lo=30, hi=30)[0], SamplingParams(temperature=0, max_tokens=100))
    eng.add_request("b", prompts(1, seed=4, lo=10, hi=10)[0], SamplingParams(temperature=0, max_tokens=5))
    for _ in range(4):
        eng.step()
    used_before = eng.kv_manager.num_total_blocks - eng.kv_manager.num_free_blocks
    assert used_before > 0
    assert eng.abort("a")
    eng.step()
    assert eng.kv_manager.block_tables.get("a") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert_engine_clean(eng)


def test_request_too_large_is_rejected_and_others_finish(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=512 * 4 * 8, block_size=4, max_model_len=64)
    eng = llm.engine
    eng.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(RequestTooLargeError, match="context window"):
        eng.add_request("long", list(range(3, 70)), SamplingParams(max_tokens=5))
    with pytest.raises(RequestTooLargeError, match="KV cache"):
        eng.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=20))  # 57 tokens > 32 capacity
    vocab = eng.model_config.vocab_size
    with pytest.raises(ValidationError, match="stop_token_ids"):
        eng.add_request("badstop", [5, 6], SamplingParams(max_tokens=5, stop_token_ids=[vocab]))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == 5
    assert_engine_clean(eng)


def test_n_samples_share_prompt_blocks(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    eng = llm.engine
    prompt = prompts(1, seed=11, lo=18, hi=18)[0]  # 4 full blocks + a partial one
    eng.add_request("r", prompt, SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True))
    eng.step()  # prefill, then the two siblings fork from the first sample
    tables = [eng.kv_manager.block_tables[f"r#{i}"] for i in range(3)]
    assert tables[0] == tables[1] == tables[2]
    pool = eng.kv_manager.pool
    assert all(pool.blocks[b].ref_cnt == 3 for b in tables[0])
    eng.check_integrity()
    eng.step()  # each sample writes into the shared partial block: copy-on-write
    tables = [eng.kv_manager.block_tables[f"r#{i}"] for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert len({t[4] for t in tables}) == 3
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) == 3
    assert_engine_clean(eng)
    # The same seed gives the same three samples.
    out2 = llm.generate([prompt], SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in out2.outputs] == texts


def test_seeded_sampling_independent_of_batch(tiny_llama_dir):
    ps = prompts(6, seed=2)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=16, ignore_eos=True)
    alone, _ = run(tiny_llama_dir, ps[:1], sp)
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    outs = llm.generate(ps, [sp] + others)
    assert outs[0].outputs[0].token_ids == alone[0]


def test_outputs_carry_metrics_and_logprobs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    assert len(c.logprobs) == 6
    for lp, tok in zip(c.logprobs, c.token_ids):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob <= 0
    assert out.ttft is not None and out.ttft >= 0 and out.tpot is not None and out.tpot >= 0


def test_min_tokens_and_stop_token_ids(tiny_llama_dir, reference):
    ps, ref = reference
    first = ref[0][3]
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first],
                                               ignore_eos=True))[0].outputs[0]
    stop_at = ref[0].index(first)
    assert out.token_ids == ref[0][:stop_at + 1] and out.finish_reason == "stop" and out.stop_reason == first
    out = llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=24, min_tokens=24,
                                               stop_token_ids=[first], ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 24 and first not in out.token_ids
