"""Sampling: seeds, top-k=1 equals greedy, top-p and min-p stay inside their allowed sets, validation."""
from __future__ import annotations

import pytest
import torch

from kvinfer import LLM, SamplingParams
from kvinfer.errors import ValidationError
from kvinfer.core.sampler import Sampler, SampleRow, draw, filter_probs


def rows(n, **kw):
    p = SamplingParams(**kw)
    return [SampleRow(p, [], [], torch.Generator().manual_seed(i)) for i in range(n)]


def test_top_p_and_min_p_never_sample_outside_allowed_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g) * 3
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    k = int((cum < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    allowed_top_p = set(order[:k].tolist())
    allowed_min_p = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    s = Sampler()
    seen_p, seen_m = set(), set()
    r_p = SampleRow(SamplingParams(temperature=1.0, top_p=0.6), [], [], torch.Generator().manual_seed(1))
    r_m = SampleRow(SamplingParams(temperature=1.0, min_p=0.2), [], [], torch.Generator().manual_seed(2))
    for _ in range(2000):
        seen_p.add(s.sample(logits, [r_p]).token_ids[0])
        seen_m.add(s.sample(logits, [r_m]).token_ids[0])
    assert seen_p <= allowed_top_p and len(seen_p) == len(allowed_top_p)
    assert seen_m <= allowed_min_p and len(seen_m) == len(allowed_min_p)


def test_filter_probs_top_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = filter_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 3]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_sampling_frequencies_follow_probabilities():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    r = SampleRow(SamplingParams(temperature=1.0), [], [], torch.Generator().manual_seed(0))
    counts = torch.zeros(3)
    s = Sampler()
    for _ in range(3000):
        counts[s.sample(logits, [r]).token_ids[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    s = Sampler()
    r = SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [], None)
    assert s.sample(logits, [r]).token_ids == [1]  # token 0 was seen: 2.0 -> 1.0
    r = SampleRow(SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=1.0), [], [1, 1], None)
    assert s.sample(logits, [r]).token_ids == [0]


def test_same_seed_same_tokens_and_top_k_1_is_greedy(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    p = [[5, 9, 13, 17, 21]]
    sp = SamplingParams(temperature=1.2, seed=42, max_tokens=20, ignore_eos=True)
    a = llm.generate(p, sp)[0].outputs[0].token_ids
    b = llm.generate(p, sp)[0].outputs[0].token_ids
    c = llm.generate(p, SamplingParams(temperature=1.2, seed=43, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    assert a == b and a != c
    greedy = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    topk1 = llm.generate(p, SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=20,
                                           ignore_eos=True))[0].outputs[0].token_ids
    assert topk1 == greedy


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=1.5), "top_p"), (dict(top_p=0), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=1.2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(n=1000), "n"), (dict(logprobs=100), "logprobs"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(stop=[""]), "stop"), (dict(temperature=float("nan")), "temperature"),
    (dict(max_tokens="5"), "max_tokens"),
])
def test_invalid_values_name_the_parameter(kw, param):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)


def test_draw_follows_probabilities_never_draws_zeros_and_repeats_with_its_generator():
    probs = torch.zeros(1000)
    probs[[3, 500, 998]] = torch.tensor([0.5, 0.3, 0.2])  # zeros before, between and after the mass
    g = torch.Generator().manual_seed(1)
    draws = [draw(probs, g) for _ in range(6000)]
    assert set(draws) <= {3, 500, 998}
    for tok, p in [(3, 0.5), (500, 0.3), (998, 0.2)]:
        assert abs(draws.count(tok) / len(draws) - p) < 0.03
    assert draw(probs, torch.Generator().manual_seed(7)) == draw(probs, torch.Generator().manual_seed(7))
    point = torch.zeros(50)
    point[49] = 1e-30  # unnormalised, all mass on the last entry
    assert all(draw(point, g) == 49 for _ in range(20))


def test_argmax_rows_is_torch_argmax_ties_and_nan_included():
    from kvinfer.core.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1000, generator=g)
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first
    x[2, 7] = float("nan")  # NaN counts as the largest, as in torch
    x[3] = 0.0
    x[3, 5] = -0.0
    want = x.argmax(dim=-1).tolist()
    assert argmax_rows(x) == want and want[1] == 10 and want[2] == 7
    assert argmax_rows(x[4]) == [int(x[4].argmax())]
    assert argmax_rows(x[:, ::3]) == x[:, ::3].argmax(dim=-1).tolist()  # strided rows
    assert argmax_rows(x.double()) == want  # other dtypes take torch's route


def test_allowed_token_ids_in_the_sampler():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0]])
    s = Sampler()
    greedy = SampleRow(SamplingParams(temperature=0, allowed_token_ids=[2, 4]), [], [], None)
    assert s.sample(logits, [greedy]).token_ids == [2]  # the best of the allowed, not of all
    r = SampleRow(SamplingParams(temperature=1.0, allowed_token_ids=[1, 3]), [], [], torch.Generator().manual_seed(0))
    assert {s.sample(logits, [r]).token_ids[0] for _ in range(300)} == {1, 3}
    # When bans leave nothing allowed (here every allowed id is banned), the ban yields instead of a draw from
    # nothing: greedy and sampled rows still get an allowed token
    for t in (0, 1.0):
        both = SampleRow(SamplingParams(temperature=t, allowed_token_ids=[1, 2]), [], [],
                         torch.Generator().manual_seed(0), banned_ids=(1, 2))
        assert s.sample(logits, [both]).token_ids[0] in (1, 2)
    # logprobs stay the model's own (before any mask), as for logit_bias and grammars
    lp = SampleRow(SamplingParams(temperature=0, allowed_token_ids=[4], logprobs=1), [], [], None)
    assert s.sample(logits, [lp]).logprobs[0][1][0][0] == 0
    for bad in ([], [-1], ["3"], "12", [True], 5, {1: 2}):
        with pytest.raises(ValidationError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    for kw in (dict(bad_words=[""]), dict(bad_words=[" "]), dict(bad_words=[3]), dict(bad_words=["w"] * 65), dict(bad_words=5),
               dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2), dict(truncate_prompt_tokens=1.5)):
        with pytest.raises(ValidationError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert not SamplingParams(temperature=0, bad_words="x").plain_greedy  # so no multi-step call skips the masks
    assert not SamplingParams(temperature=0, allowed_token_ids=[1]).plain_greedy


def test_bad_words_allowed_ids_and_prompt_truncation(builtin_llm):
    llm, tok = builtin_llm, builtin_llm.tokenizer
    q = [{"role": "user", "content": "What is the capital of France?"}]
    sp = dict(temperature=0, max_tokens=16)
    base = llm.chat(q, SamplingParams(**sp))[0].outputs[0]
    assert "Paris" in base.text
    banned = llm.chat(q, SamplingParams(**sp, bad_words=["Paris", "paris"]))[0].outputs[0]
    spelled = [tok.encode(w, add_special_tokens=False) for w in ("Paris", " Paris", "paris", " paris")]
    ids = banned.token_ids
    assert "Paris" not in banned.text and banned.token_ids[:3] == base.token_ids[:3]
    assert not any(ids[i:i + len(w)] == w for w in spelled for i in range(len(ids)))
    # A word of several tokens: only its last token is masked, and only where the output ends with the rest
    two = tok.encode(" capital of", add_special_tokens=False)
    assert len(two) == 2
    out = llm.chat(q, SamplingParams(**sp, bad_words=["capital of"]))[0].outputs[0]
    assert two[0] in out.token_ids and " capital of" not in out.text

    allowed = sorted({t for w in (" yes", " no", "Yes", "No") for t in tok.encode(w, add_special_tokens=False)})
    yn = llm.chat([{"role": "user", "content": "Is Paris in France?"}],
                  SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=allowed))[0].outputs[0]
    assert yn.token_ids and set(yn.token_ids) <= set(allowed)

    text = "one two three four five six seven eight nine ten"
    kept = llm.generate(text, SamplingParams(**sp, truncate_prompt_tokens=4))[0]
    direct = llm.generate([tok.encode(text)[-4:]], SamplingParams(**sp))[0]
    assert kept.prompt_token_ids == direct.prompt_token_ids and len(kept.prompt_token_ids) == 4
    assert kept.outputs[0].token_ids == direct.outputs[0].token_ids and kept.prompt is None
    whole = llm.generate(text, SamplingParams(**sp, truncate_prompt_tokens=-1))[0]
    assert whole.prompt == text and whole.prompt_token_ids == tok.encode(text)


def test_masks_give_the_same_tokens_with_speculation_and_batching(builtin_llm):
    """bad_words and allowed_token_ids act on every verified row as on a sampled one: greedy output is the same
    with n-gram speculation, alone or batched."""
    tok = builtin_llm.tokenizer
    passage = "The lighthouse stood on a rocky point at the edge of the harbour, and the keeper lit the lamp."
    prompt = tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: " + passage}])
    letters = sorted({t for w in passage.split() for t in tok.encode(" " + w, add_special_tokens=False)})
    params = [SamplingParams(temperature=0, max_tokens=24, bad_words=["lamp", "harbour"]),
              SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=letters),
              SamplingParams(temperature=0, max_tokens=24)]
    want = [builtin_llm.generate(prompt, p)[0].outputs[0].token_ids for p in params]
    assert want[0] != want[2] and want[1] != want[2]  # both masks change what greedy decoding picks here
    spec = LLM(None, dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048, speculative="ngram")
    try:
        assert [o.outputs[0].token_ids for o in spec.generate([prompt] * 3, params)] == want
        assert [spec.generate(prompt, p)[0].outputs[0].token_ids for p in params] == want
        assert spec.engine.stats["spec_accepted_tokens"] > 0
    finally:
        spec.close()


def test_allowed_token_ids_that_a_grammar_forbids_yield_to_it(builtin_llm):
    # Every allowed id is outside the grammar: the grammar wins (no draw from an empty set, no crash of the step)
    tok = builtin_llm.tokenizer
    allowed = [tok.encode(" yes", add_special_tokens=False)[0]]
    for t in (0, 0.8):
        out = builtin_llm.generate("Pick a colour:", SamplingParams(
            temperature=t, seed=1, max_tokens=8, allowed_token_ids=allowed,
            structured_output={"choice": ["red", "blue"]}))[0].outputs[0]
        assert out.text in ("red", "blue") and out.finish_reason == "stop"


def test_a_top_k_past_any_vocabulary_keeps_every_token(tiny_llama_dir):
    """A top_k too large for int64 (the server's fuzzing sent 5e22) disables top-k like 0, instead of failing the
    request inside the sampler; a top_k larger than the vocabulary already kept every token."""
    assert SamplingParams(top_k=5 * 10 ** 22).top_k == 0 and SamplingParams(top_k=-1).top_k == 0
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    p = [[5, 9, 13, 17, 21]]
    outs = [llm.generate(p, SamplingParams(temperature=1.2, seed=7, top_k=k, max_tokens=12, ignore_eos=True))[0]
            .outputs[0].token_ids for k in (0, 10 ** 9, 5 * 10 ** 22)]
    assert outs[0] == outs[1] == outs[2]
