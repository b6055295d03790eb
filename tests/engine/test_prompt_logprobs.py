"""Prompt logprobs (SamplingParams.prompt_logprobs, the completions API's echo + logprobs): each prompt token's
log-probability given the tokens before it, as a generated token's would be computed."""
from __future__ import annotations

import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.errors import ValidationError
from tests.reference_helpers import hf_logits


def _values(pl):
    return [None if x is None else (x.token_id, x.logprob, x.top) for x in pl]


def test_prompt_logprobs_match_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    want = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # row i: the distribution of token i + 1
    for i in range(1, len(prompt)):
        assert pl[i].token_id == prompt[i]
        assert pl[i].logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4)
        v = want[i - 1, prompt[i]]  # rank: 1 + the tokens more likely (within the tolerance)
        assert int((want[i - 1] > v + 1e-4).sum()) + 1 <= pl[i].rank <= int((want[i - 1] > v - 1e-4).sum()) + 1
        top_v, top_i = want[i - 1].topk(3)
        assert [t for t, _ in pl[i].top] == top_i.tolist()
        assert [v for _, v in pl[i].top] == pytest.approx(top_v.tolist(), abs=1e-4)


def test_prompt_logprobs_are_bitwise_the_generated_tokens_logprobs(builtin_llm):
    # Scoring a generated text gives each of its tokens the logprob it was generated with, bit for bit: the
    # same row arithmetic (exactness) and the same log-softmax.
    out = builtin_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, logprobs=2),
                               use_tqdm=False)[0]
    gen, p = out.outputs[0], len(out.prompt_token_ids)
    scored = builtin_llm.generate([out.prompt_token_ids + gen.token_ids],
                                  SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    pl = scored.prompt_logprobs
    assert len(pl) == p + len(gen.token_ids)
    assert scored.num_cached_tokens == 0  # the prompt's blocks were cached, yet every position was computed
    if builtin_llm.engine.runner.prompt_route:
        # Where prompt rows have their own route (AMX-BF16), a scored token's row is a prompt row, computed in
        # bfloat16: the same tokens, logprobs within a few hundredths (KVINFER_PROMPT_BF16=0 gives the bits back).
        assert [x.token_id for x in pl[p:]] == [x.token_id for x in gen.logprobs]
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(pl[p:], gen.logprobs)]
        assert 0 < max(diffs) < 0.1, diffs
        return
    assert [(x.token_id, x.logprob, x.top) for x in pl[p:]] == [(x.token_id, x.logprob, x.top) for x in gen.logprobs]


def test_prompt_logprobs_in_long_chunked_prompts_and_with_the_prefix_cache():
    # Longer than one head call (64 rows) and than the step budget (chunked prefill), the same values every way.
    base = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024)
    prompt = torch.randint(1000, 40000, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    whole = LLM(None, **base).generate([prompt], sp, use_tqdm=False)[0]
    chunked_llm = LLM(None, max_num_batched_tokens=48, enable_chunked_prefill=True, **base)
    chunked = chunked_llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(whole.prompt_logprobs) == 150 and _values(chunked.prompt_logprobs) == _values(whole.prompt_logprobs)
    # A request without prompt logprobs still finds the blocks the first one cached; one with them again
    # computes every position and gets the same values; a batch of both changes nothing either.
    again = chunked_llm.generate([prompt, prompt + [5]], [sp, SamplingParams(temperature=0, max_tokens=2)],
                                 use_tqdm=False)
    assert _values(again[0].prompt_logprobs) == _values(whole.prompt_logprobs) and again[0].num_cached_tokens == 0
    assert again[1].prompt_logprobs is None and again[1].num_cached_tokens >= 144
    assert again[0].outputs[0].token_ids == whole.outputs[0].token_ids


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous", "none"])
def test_prompt_logprobs_with_n_samples_and_every_backend(tiny_llama_dir, kv_cache):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20, block_size=4, kv_cache=kv_cache,
              max_model_len=128)
    prompt = [5, 9, 13, 2, 77, 31, 8, 40, 41]
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)[0]
    three = llm.generate([prompt], SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=3, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert len(three.outputs) == 3 and _values(three.prompt_logprobs) == _values(one.prompt_logprobs)
    single = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert single.prompt_logprobs == [None]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_prompt_logprobs_under_speculative_decoding(tiny_llama_dir, spec):
    kw = dict(speculative=spec, num_speculative_tokens=3)
    if spec == "draft":
        kw["speculative_model"] = tiny_llama_dir  # the target as its own draft: accepts everything
    prompt = [5, 9, 13, 2, 77, 31, 8, 5, 9, 13, 2, 77]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=2)
    ref = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20).generate([prompt], sp, use_tqdm=False)[0]
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20, **kw)
    got = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert _values(got.prompt_logprobs) == _values(ref.prompt_logprobs)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_named(bad):
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
