"""Multi-step decode (EngineConfig.num_scheduler_steps): several fused decode steps per C call while every running
request decodes greedily or samples with nothing but temperature and top-k/top-p/min-p, and none waits, with the
same tokens, logprobs, texts and finishes as one step per call."""
from __future__ import annotations

import pytest
import torch

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.config import EngineConfig
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.errors import ValidationError
from kvinfer.core.sampler import argmax_rows


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs or []], c.text, c.finish_reason, c.stop_reason)
             for c in o.outputs] for o in outs]


def _calls(llm):
    """Counts the engine's multi-step calls (the scheduler's plans of fused decode steps)."""
    sched = llm.engine.scheduler
    orig, n = sched.schedule, [0]

    def counted(*a):
        out = orig(*a)
        n[0] += out.decode_steps > 1
        return out

    sched.schedule = counted
    return n


CASES = [
    SamplingParams(temperature=0, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0, max_tokens=23, stop=["\n\n", " the"]),  # stop strings: later tokens dropped
    SamplingParams(temperature=0, max_tokens=30, n=3, logprobs=0),  # forks share the prompt's last block
    SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[13]),
    # Sampled: the fused call draws with the sampler's kernel and the same uniform numbers of each generator.
    SamplingParams(temperature=0.8, max_tokens=40, seed=7, logprobs=2),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, max_tokens=30, n=3),
    # "," or "." ends a request inside a call: the others' generators must be left as if only the steps done drew.
    SamplingParams(temperature=1.1, max_tokens=48, stop_token_ids=[28, 30], seed=11),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_multistep_matches_one_step_per_call(builtin_llm, i):
    one = LLM(None, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, num_scheduler_steps=1)
    eight = LLM(None, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, num_scheduler_steps=8)
    calls = _calls(eight)
    prompts = ["Write a long story about a lighthouse keeper.", "The capital of France is", "def fib(n):",
               "List three colours:"]
    assert _run(eight, prompts, CASES[i]) == _run(one, prompts, CASES[i])
    assert calls[0] > 0  # the multi-step path did run
    eight.engine.check_integrity()
    assert eight.engine.kv_manager.num_free_units == eight.engine.kv_manager.num_units  # every block back


def test_multistep_at_the_context_window_and_a_small_kv_pool(builtin_llm):
    # The window ends generation inside a call; a pool too small for 8 more tokens each falls back to single steps
    # (and preempts). (The fused step, hence multi-step, needs quantised weights: the built-in model.)
    kw = dict(dtype="float32", block_size=4, max_model_len=40)
    prompts = [[1005, 2009, 313, 2, 977, 31, 8], [100, 101, 102], [700] * 11]
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=1)
    per_block = builtin_llm.engine.kv_bytes_per_token * 4
    for blocks in (1000, 22):  # 22 blocks of 4 cannot hold 3 x 40 tokens
        one = LLM(None, kv_cache_memory=blocks * per_block, num_scheduler_steps=1, **kw)
        eight = LLM(None, kv_cache_memory=blocks * per_block, num_scheduler_steps=8, **kw)
        assert eight.engine.kv_manager.num_units == blocks
        calls = _calls(eight)
        got = _run(eight, prompts, sp)
        assert got == _run(one, prompts, sp)
        assert [len(o[0][0]) for o in got] == [40 - len(p) for p in prompts]
        assert calls[0] > 0 and (blocks > 100 or eight.engine.scheduler.num_preemptions > 0)


def test_bad_num_scheduler_steps_is_named():
    for bad in (0, 65):
        with pytest.raises(ValidationError, match="num_scheduler_steps"):
            LLMEngine(EngineConfig(num_scheduler_steps=bad))


@pytest.mark.skipif(not kernels.available(), reason="the C argmax is part of the kernels")
def test_the_c_argmax_is_the_samplers():
    # Multi-step decode picks tokens in C; they must be the sampler's numpy argmax, ties and NaNs included.
    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 10] = x[1, 500] = 99.0  # a tie: the first
    x[2, 900] = x[2, 7] = float("nan")  # NaN counts as the largest: the first NaN
    x[3] = float("-inf")  # nothing larger than the first
    x[4, 0] = float("nan")
    x[5, 999] = x[5, 3] = float("inf")
    x[6, 2] = -0.0
    x[6, 1] = 0.0
    x[6, 3:] = -1.0
    x[6, 0] = -2.0
    got = kernels.active().argmax_rows(x.contiguous())
    assert got == argmax_rows(x) == [got[0], 10, 7, 0, 0, 3, 1]


def test_greedy_and_sampled_requests_share_fused_calls(builtin_llm):
    # One batch: greedy rows take the argmax, sampled rows draw, in the same C calls; a request with a penalty
    # (which the fused call cannot apply) sends the steps it shares the general way, with the same tokens.
    one = LLM(None, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, num_scheduler_steps=1)
    eight = LLM(None, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, num_scheduler_steps=8)
    calls = _calls(eight)
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "List three colours:"]
    params = [SamplingParams(temperature=0, max_tokens=33, logprobs=1),
              SamplingParams(temperature=0.7, max_tokens=41, seed=1, logprobs=1),
              SamplingParams(temperature=1.3, top_p=0.8, max_tokens=29, seed=2),
              SamplingParams(temperature=0.9, max_tokens=12, seed=3, repetition_penalty=1.2)]
    assert _run(eight, prompts, params) == _run(one, prompts, params)
    assert calls[0] > 0
    eight.engine.check_integrity()
