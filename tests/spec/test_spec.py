"""Speculative decoding: n-gram and draft proposals verified in the engine give the non-speculative output."""
from __future__ import annotations

import random

import pytest
import torch

from kvinfer import LLM, SamplingParams, kernels
from kvinfer.errors import ValidationError
from kvinfer.kv.manager import PagedKVManager
from kvinfer.core.request import Request
from kvinfer.core.sampler import Sampler, SampleRow
from kvinfer.core.scheduler import Scheduler, SchedulerConfig
from kvinfer.spec.ngram import NgramIndex
from kvinfer.spec.rejection import verify
from tests.conftest import assert_engine_clean, generate_checked, save_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def extractive_prompts(n, seed=0, vocab=256):
    """Prompts that repeat a random span, so the greedy continuation often copies and n-grams find it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(rng.randint(6, 14))]
        out.append([rng.randrange(3, vocab)] + span + span[:rng.randint(2, 5)])
    return out


def generate(model_dir, ps, params=GREEDY, **kw):
    return generate_checked(model_dir, ps, params, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    ps = extractive_prompts(8) + [[5, 9, 200, 17]]  # the last one has nothing to look up at first
    outs, _ = generate(tiny_llama_dir, ps)
    return ps, outs


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_same(outs, ref):
    """Same tokens, finish reasons and logprobs (bit for bit: each row's arithmetic is the same in any step)."""
    assert tokens(outs) == tokens(ref)
    for o, r in zip(outs, ref):
        for c, rc in zip(o.outputs, r.outputs):
            assert c.finish_reason == rc.finish_reason
            if rc.logprobs is not None:  # each token's logprobs come from its own verification row
                assert [lp.token_id for lp in c.logprobs] == [lp.token_id for lp in rc.logprobs]
                assert [(a.logprob, a.top) for a in c.logprobs] == [(b.logprob, b.top) for b in rc.logprobs]


# ---- proposers and bookkeeping ---------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # Suffix (1, 2, 3) occurred at the start only; (2, 3) also later, but the longest n-gram wins.
    assert idx.propose(toks, 3) == [4, 5, 9]
    toks += [7]  # suffix (2, 3, 7) occurred once, followed by 8, 1
    assert idx.propose(toks, 2) == [8, 1]
    assert NgramIndex(2, 2).propose([5, 6, 7, 8], 4) == []  # no earlier occurrence of (7, 8)
    assert NgramIndex(1, 1).propose([4, 4], 3) == [4]  # the continuation stops at the end of the tokens


def test_trim_returns_rejected_blocks_and_hashes_only_known_tokens():
    m = PagedKVManager(8, 4)
    r = Request("a", list(range(10, 16)), SamplingParams(max_tokens=8))  # 6 known tokens
    assert m.allocate_slots(r, 6)
    r.num_computed_tokens = 5  # one pending token, then 5 proposed: positions 5..10 in this step
    assert m.allocate_slots(r, 6) and len(m.get_block_table(r)) == 3
    assert len(m.block_hashes["a"]) == 1  # the full block of proposed tokens is not in the prefix cache
    m.trim(r, 7)  # two proposals accepted: 7 tokens have valid KV
    assert len(m.get_block_table(r)) == 2 and m.num_free_blocks == 6
    m.check_integrity()


def test_scheduler_drops_proposals_before_preempting():
    m = PagedKVManager(4, 4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_model_len=64), m)
    a, b = (Request(x, [1, 2, 3], SamplingParams(max_tokens=8)) for x in "ab")
    for r in (a, b):
        sched.add_request(r)
    sched.update_after_step(sched.schedule())
    for r in (a, b):
        r.output_token_ids.append(7)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # would need 3 more blocks; only 2 are free
    out = sched.schedule()
    assert not out.preempted and [s.num_new_tokens for s in out.scheduled] == [1, 1]
    assert out.scheduled[0].spec_token_ids == [] and a.spec_token_ids == []


def test_proposals_that_stop_paying_off_are_skipped_with_growing_back_off():
    from kvinfer.spec.speculator import Speculator, StepRates

    spec = Speculator("ngram", 4, rates=StepRates(probe_every=0))
    r = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=50))
    r.output_token_ids, r.num_computed_tokens = [3], 5  # in decode: the last token is pending
    spec.propose([r], 1024)
    assert r.spec_token_ids == [1, 2, 3]  # what followed the earlier (1, 2, 3)
    skipped = []
    for _ in range(6):  # every proposal rejected
        spec.record(r, len(r.spec_token_ids), 0, num_running=1)
        n = 0
        while True:
            spec.propose([r], 1024)
            if r.spec_token_ids:
                break
            n += 1
        skipped.append(n)
        assert r.spec_token_ids == [1]  # after a full rejection it proposes one token
    waits = [n for n in skipped if n]
    assert skipped[0] == 0 and len(waits) >= 3 and waits == sorted(set(waits))  # tolerated, then 2, 4, 8, ...
    spec.record(r, 1, 1, num_running=1)  # accepted: it proposes at once again, and more
    spec.propose([r], 1024)
    assert len(r.spec_token_ids) == 2
    assert spec.metrics() == dict(spec_drafts=7, spec_draft_tokens=9, spec_accepted_tokens=1)


def test_a_sequence_sitting_out_still_proposes_a_full_length_match():
    from kvinfer.spec.ngram import NgramIndex
    from kvinfer.spec.speculator import Speculator, StepRates

    idx = NgramIndex(1, 4)
    assert idx.propose_match([7, 1, 2, 3, 4, 9, 1, 2, 3, 4], 2) == ([9, 1], 4)
    assert idx.propose_match([7, 1, 2, 3, 4, 9, 1, 2, 3, 4, 5], 2) == ([], 0)
    spec = Speculator("ngram", 4, rates=StepRates(probe_every=0))
    r = Request("a", [5, 6, 7, 8, 1, 2, 3], SamplingParams(max_tokens=50))
    r.output_token_ids, r.num_computed_tokens = [4], 7  # all tokens: 5 6 7 8 1 2 3 4
    spec.propose([r], 1024)
    assert r.spec_token_ids == []  # nothing to match yet
    spec.states["a"].skip = 8  # sitting out after misses
    r.output_token_ids += [5, 6]  # 5 6 7 8 1 2 3 4 5 6: a 2-gram (5, 6) match only
    r.num_computed_tokens = 9
    spec.propose([r], 1024)
    assert r.spec_token_ids == [] and spec.states["a"].skip == 7  # a weak match: still sitting out
    r.output_token_ids += [7, 8]  # ... 5 6 7 8: a 4-gram match, copying again
    r.num_computed_tokens = 11
    spec.propose([r], 1024)
    assert r.spec_token_ids == [1, 2, 3, 4] and spec.states["a"].skip == 6


def test_a_pause_still_lets_full_length_matches_propose_but_not_probe_steps():
    from kvinfer.spec.speculator import Speculator, StepRates

    spec = Speculator("ngram", 4, rates=StepRates(probe_every=4, pause_steps=6))
    r = Request("a", [5, 6, 7, 8, 1, 2, 3], SamplingParams(max_tokens=50))
    r.output_token_ids, r.num_computed_tokens = [4, 5, 6], 9  # 5 6 7 8 1 2 3 4 5 6: a 2-gram match only
    spec.rates._of(1).paused = 6  # verification steps were behind the plain ones: 6 steps without proposals
    spec.propose([r], 1024)  # step 1
    assert r.spec_token_ids == []  # a weak match waits out the pause
    r.output_token_ids += [7, 8]  # ... 5 6 7 8: a 4-gram match, copying again
    r.num_computed_tokens = 11
    spec.propose([r], 1024)  # step 2
    assert r.spec_token_ids == [1, 2, 3, 4]
    r.output_token_ids += [1, 2]  # ... 7 8 1 2: a 4-gram match again
    r.num_computed_tokens = 13
    proposed = []
    for _ in range(8):  # steps 3-6 in the pause, then 7-10 with step 8 a probe of the plain rate
        spec.propose([r], 1024)
        proposed.append(r.spec_token_ids)
    assert spec.rates.paused(1) == 0
    assert proposed == [[3, 4, 5, 6]] * 5 + [[]] + [[3, 4, 5, 6]] * 2


def test_clearly_paying_speculation_probes_the_plain_rate_less_often():
    from kvinfer.spec.speculator import MIN_SAMPLES, PROBE_SPREAD, StepRates

    rates = StepRates(probe_every=4, pause_steps=10)
    rates.observe(0.010, 1, speculated=False)  # plain: 100 tokens/s
    for _ in range(MIN_SAMPLES):
        rates.observe(0.010, 1.1, speculated=True)  # 110 tokens/s: pays, but not clearly
    assert [rates.allow() for _ in range(8)] == [True, True, True, False] * 2
    for _ in range(MIN_SAMPLES):
        rates.observe(0.020, 4, speculated=True)  # 200 tokens/s: clearly
    allowed = [rates.allow() for _ in range(8 * PROBE_SPREAD)]
    assert allowed.count(False) == 2 and not allowed[4 * PROBE_SPREAD - 1 - 8]


def test_speculation_pauses_while_verification_steps_emit_fewer_tokens_per_second():
    from kvinfer.spec.speculator import MIN_SAMPLES, StepRates

    rates = StepRates(probe_every=4, pause_steps=10)
    allowed = [rates.allow() for _ in range(8)]
    assert allowed == [True, True, True, False] * 2  # every 4th step measures the plain rate
    rates.observe(0.010, 1, speculated=False)  # plain: 100 tokens/s
    for _ in range(MIN_SAMPLES):
        rates.observe(0.020, 3, speculated=True)  # 150 tokens/s: speculation pays
    rates.observe(0.030, 1, speculated=True)  # one poor step: 33 tokens/s, but the recent total still pays
    assert rates.paused() == 0 and rates.rate(True) > rates.rate(False)
    for _ in range(2):
        rates.observe(0.040, 2, speculated=True)  # 50 tokens/s: it no longer does (judged anew after a pause)
    assert rates.paused() == 10 and rates.num_pauses == 1 and rates.classes[0].samples[True] < MIN_SAMPLES
    assert not any(rates.allow() for _ in range(10)) and rates.allow()  # then it measures again


def test_speculation_is_judged_per_batch_size_class():
    from kvinfer.spec.speculator import MIN_SAMPLES, StepRates, batch_class

    assert [batch_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    rates = StepRates(probe_every=4, pause_steps=10)
    # 16 sequences: a plain step emits 16 tokens in 40 ms; verification steps 40 tokens in 200 ms -> slower.
    rates.observe(0.040, 16, speculated=False, num_seqs=16)
    for _ in range(MIN_SAMPLES):
        rates.observe(0.200, 40, speculated=True, num_seqs=18)
    assert rates.paused(16) == 0  # behind once: not yet (one slow step must not pause proposals)
    rates.observe(0.200, 40, speculated=True, num_seqs=18)
    # 1 sequence: 1 token in 10 ms plain, 3 in 20 ms verified -> pays. A slow big step must not pause it, and the
    # big steps' higher tokens/s must not make these look poor.
    rates.observe(0.010, 1, speculated=False, num_seqs=1)
    for _ in range(MIN_SAMPLES):
        rates.observe(0.020, 3, speculated=True, num_seqs=1)
    assert rates.paused(16) == 10 and rates.paused(20) == 10 and rates.paused(1) == 0
    assert not rates.allow(17) and rates.allow(1)


def test_generate_summary_reports_acceptance():
    from kvinfer.cli import spec_summary

    assert spec_summary(dict(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)).endswith("no proposals")
    line = spec_summary(dict(spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=30))
    assert "30/40 accepted (75%)" in line and "mean accepted length 4.00" in line


# ---- greedy: identical output --------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["paged", "contiguous", "none"])
def test_ngram_greedy_output_is_unchanged(tiny_llama_dir, baseline, kv):
    ps, ref = baseline
    outs, llm = generate(tiny_llama_dir, ps, kv_cache=kv, speculative="ngram", num_speculative_tokens=3)
    assert_same(outs, ref)
    st = llm.engine.stats
    assert st["spec_drafts"] > 0 and 0 < st["spec_accepted_tokens"] <= st["spec_draft_tokens"]


def test_ngram_with_chunked_prefill_preemption_and_prefix_caching(tiny_llama_dir, baseline):
    ps, ref = baseline
    # 16 blocks of 4 tokens for 9 requests: preemptions; 7-token budget: prompts prefill in chunks while others
    # verify proposals in the same step.
    outs, llm = generate(tiny_llama_dir, ps, speculative="ngram", kv_cache_memory=512 * 4 * 16,
                         max_num_batched_tokens=7)
    assert_same(outs, ref)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats["spec_accepted_tokens"] > 0
    again = llm.generate(ps[:2], GREEDY)  # served from the prefix cache, which only ever saw accepted tokens
    assert_same(again, ref[:2]) and again[0].num_cached_tokens > 0
    assert_engine_clean(llm.engine)


def test_ngram_n_samples_stop_tokens_and_min_tokens(tiny_llama_dir, baseline):
    ps, ref = baseline
    first = ref[0].outputs[0].token_ids[5]
    cases = [SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, min_tokens=20, stop_token_ids=[first], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True)]
    for sp in cases:
        plain, _ = generate(tiny_llama_dir, ps[:3], sp)
        spec, _ = generate(tiny_llama_dir, ps[:3], sp, speculative="ngram")
        assert_same(spec, plain)


def test_draft_equal_to_target_accepts_everything(tiny_llama_dir, baseline):
    ps, ref = baseline
    outs, llm = generate(tiny_llama_dir, ps, speculative_model=tiny_llama_dir, speculative="draft",
                         num_speculative_tokens=4)
    assert_same(outs, ref)
    st = llm.engine.stats
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] == st["spec_draft_tokens"]
    assert llm.engine.speculator.draft.manager.num_free_blocks == llm.engine.speculator.draft.manager.num_total_blocks


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_llama(path, seed=3, num_hidden_layers=1)
    return str(path)


def test_a_different_draft_keeps_the_greedy_output(tiny_llama_dir, baseline, other_draft_dir):
    ps, ref = baseline
    outs, llm = generate(tiny_llama_dir, ps, speculative_model=other_draft_dir, speculative="draft",
                         kv_cache_memory=512 * 4 * 24)
    assert_same(outs, ref)
    st = llm.engine.stats
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] < st["spec_draft_tokens"]


def test_proposal_length_defaults_per_method_and_machine(monkeypatch):
    from kvinfer import kernels
    from kvinfer.spec.speculator import default_tokens

    assert default_tokens("draft", torch.device("cpu")) == 4  # every proposed token costs a draft step
    assert default_tokens("ngram", torch.device("cuda")) == 8
    monkeypatch.setattr(kernels, "level", lambda: "avx512")  # a verified row costs ~1/5 of a step there
    assert default_tokens("ngram", torch.device("cpu")) == 8
    for lower in ("avx2", "generic", None):
        monkeypatch.setattr(kernels, "level", lambda: lower)
        assert default_tokens("ngram", torch.device("cpu")) == 4


def test_bad_speculative_settings_are_named(tiny_llama_dir, tmp_path):
    with pytest.raises(ValidationError, match="speculative_model"):
        LLM(tiny_llama_dir, speculative="draft")
    with pytest.raises(ValidationError, match="ngram_max"):
        LLM(tiny_llama_dir, speculative="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        LLM(tiny_llama_dir, speculative="ngram", num_speculative_tokens=0)
    big = tmp_path / "big_vocab"
    save_tiny_llama(big, vocab_size=300)
    with pytest.raises(ValidationError, match="vocabulary"):
        LLM(tiny_llama_dir, speculative_model=str(big), speculative="draft")


# ---- sampling: the distribution is unchanged -------------------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """Emitted first tokens are distributed as the target's p, whatever the draft's q (and its guesses)."""
    vocab, k, trials = 6, 2, 2500
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    p0 = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)  # the draft's own distribution
    params = SamplingParams(temperature=1.0, max_tokens=8)
    rows = [SampleRow(params, [1], [], g) for _ in range(k + 1)]
    counts = {"draft": torch.zeros(vocab), "ngram": torch.zeros(vocab)}
    sampler = Sampler()
    for _ in range(trials):
        d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
        counts["draft"][verify(sampler, logits, rows, d, q).token_ids[0]] += 1
        counts["ngram"][verify(sampler, logits, rows, [3, 1]).token_ids[0]] += 1  # a fixed guess: point mass
    for name, c in counts.items():
        freq = c / trials
        sigma = (p0 * (1 - p0) / trials).sqrt()
        assert ((freq - p0).abs() <= 4.5 * sigma + 1e-3).all(), (name, freq, p0)


@pytest.fixture(scope="module")
def peaked_pair(tmp_path_factory):
    """A target and a different draft whose next-token distributions are peaked enough to count samples of."""
    from tests.reference_helpers import TINY_LLAMA_LIKE, save_tiny

    dirs = [tmp_path_factory.mktemp(name) for name in ("peaked_target", "peaked_draft")]
    target = save_tiny("LlamaConfig", "LlamaForCausalLM", dirs[0], seed=0, **TINY_LLAMA_LIKE)
    save_tiny("LlamaConfig", "LlamaForCausalLM", dirs[1], seed=3, **TINY_LLAMA_LIKE)
    return target, str(dirs[0]), str(dirs[1])


def test_sampling_with_a_draft_matches_the_target_on_a_tiny_model(peaked_pair):
    """The second token (the first one verified) after the commonest first token follows the target's p."""
    from tests.reference_helpers import hf_logits

    hf, target_dir, draft_dir = peaked_pair
    prompt, temp, n = [7, 40, 99, 3], 0.7, 1500
    sp = [SamplingParams(temperature=temp, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]
    llm = LLM(target_dir, dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_num_seqs=256,
              speculative_model=draft_dir, speculative="draft", num_speculative_tokens=2)
    outs = llm.generate([prompt] * n, sp, use_tqdm=False)
    st = llm.engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]  # both paths of rejection sampling ran
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    t1 = max(set(firsts), key=firsts.count)
    seconds = torch.tensor([o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == t1])
    p = torch.softmax(hf_logits(hf, prompt + [t1])[-1] / temp, -1)
    freq = torch.bincount(seconds, minlength=p.numel()).float() / len(seconds)
    top = p.topk(5).indices
    sigma = (p[top] * (1 - p[top]) / len(seconds)).sqrt()
    assert len(seconds) > 200
    assert ((freq[top] - p[top]).abs() <= 4.5 * sigma + 1e-3).all(), (freq[top], p[top])


# ---- front ends ------------------------------------------------------------------------------------------------
def test_cli_speculative_errors_are_one_line(tiny_llama_dir, capsys):
    from kvinfer.cli import main

    for args, needle in ((["--speculative-model", "/no/such/draft"], "/no/such/draft"),
                         (["--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "ngram_max"),
                         (["--num-speculative-tokens", "0"], "--num-speculative-tokens")):
        try:
            code = main(["generate", "hi", "--model", tiny_llama_dir] + args)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err.strip()
        assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1 and needle in err, err


def test_server_metrics_report_acceptance(tiny_llama_dir):
    import httpx

    from server_helpers import engine_config, metric, start_server

    srv = start_server(engine_config(model=tiny_llama_dir, speculative="ngram", dtype="float32",
                                     kv_cache_memory=4 << 20, max_model_len=256))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            body = dict(model=srv.model_name, prompt=extractive_prompts(1)[0], max_tokens=24, temperature=0,
                        ignore_eos=True)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = c.get("/metrics").text
    finally:
        srv.stop()
    proposed = metric(text, "kvinfer_spec_decode_num_draft_tokens_total")
    accepted = metric(text, "kvinfer_spec_decode_num_accepted_tokens_total")
    drafts = metric(text, "kvinfer_spec_decode_num_drafts_total")
    assert 0 < accepted <= proposed and drafts > 0
    assert metric(text, "kvinfer_spec_decode_acceptance_rate") == pytest.approx(accepted / proposed)
    assert metric(text, "kvinfer_spec_decode_mean_accepted_length") == pytest.approx(1 + accepted / drafts)


def test_builtin_model_extractive_prompts_identical_and_mostly_accepted(builtin_llm):
    """The built-in GGUF model through the fused decode step: verification rows give the plain decode's tokens."""
    from kvinfer.bench.spec_workload import EXTRACTIVE_PROMPTS
    tok = builtin_llm.tokenizer
    ps = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                     add_special_tokens=False) for p in EXTRACTIVE_PROMPTS[5:8:2]]
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=0)
    ref = [builtin_llm.generate([p], sp)[0] for p in ps] + builtin_llm.generate(ps, sp)  # alone, then batched
    eng = builtin_llm.engine
    llm = LLM(config=eng.config.replace(speculative="ngram"), loaded=eng.loaded)
    plain_steps = []  # steps in which no request proposed go through the fused one-call greedy path
    schedule = llm.engine.scheduler.schedule

    def planned(*a):
        out = schedule(*a)
        if out.decode_steps:
            plain_steps.append(out.decode_steps)
        return out

    llm.engine.scheduler.schedule = planned
    outs = [llm.generate([p], sp)[0] for p in ps] + llm.generate(ps, sp)
    assert_same(outs, ref)  # tokens and logprobs, bit for bit
    assert plain_steps and set(plain_steps) == {1}
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["harbour"])  # a stop string inside the copy
    a, b = builtin_llm.generate([ps[1]], stop)[0].outputs[0], llm.generate([ps[1]], stop)[0].outputs[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, "stop", "harbour")
    st = llm.engine.stats
    assert st["spec_accepted_tokens"] > 0.5 * st["spec_draft_tokens"]
    assert_engine_clean(llm.engine)


def test_lookup_share_counts_the_tokens_the_ngram_lookup_would_have_proposed():
    from kvinfer.bench.spec import lookup_share

    # A token counts when the engine's n-gram lookup (1..4), given everything before it, proposes it first.
    assert lookup_share([1, 2, 3, 4], [2, 3, 4]) == pytest.approx(2 / 3)  # 4 was never seen: 2 is a miss
    assert lookup_share([5, 6, 7], [5, 6, 7, 5, 6, 7]) == pytest.approx(5 / 6)  # the output's own n-grams too
    assert lookup_share([1], [1, 1, 1]) == pytest.approx(2 / 3)  # no context to look up for the first token
    # the latest occurrence of the longest matching suffix: (1, 2) was last followed by 4, not 3
    assert lookup_share([1, 2, 3, 9, 1, 2, 4], [1, 2, 4]) == pytest.approx(2 / 3)
    assert lookup_share([1, 2, 3, 9, 1, 2, 4], [1, 2, 3]) == pytest.approx(1 / 3)
    assert lookup_share([1, 2, 3], []) == 0.0 and lookup_share([1, 2, 3], [9, 8, 7]) == 0.0
    assert lookup_share([1, 2, 3, 1], [2, 3], ngram_min=3) == 0.0  # (3 ..: no 3-gram of the suffix recurs)


def test_step_costs_fit_verification_steps_and_plain_decoding():
    from kvinfer.bench.spec import step_costs

    # (seconds, proposed, generated, prompt tokens): verifications of r proposals at 4 + 1 * r ms, a prefill step
    # (ignored), plain decoding 3.2 ms a token over fused calls of several tokens
    on = [((4 + r) / 1e3, r, r + 1 if r % 2 else 1, 0) for r in (1, 2, 3, 4, 8)] + [(0.05, 0, 1, 90)]
    off = [(0.0128, 0, 4, 0), (0.0064, 0, 2, 0), (0.04, 0, 1, 90)]
    c = step_costs(on, off)
    assert c["verify_ms"] == pytest.approx(4.0) and c["row_ms"] == pytest.approx(1.0)
    assert c["plain_ms"] == pytest.approx(3.2)
    assert step_costs([(0.005, 1, 2, 0), (0.005, 1, 1, 0)], off) is None  # one length: no line to fit
    assert step_costs(on, [(0.04, 0, 1, 90)]) is None


def test_decode_bound_proposes_what_would_be_accepted():
    from kvinfer.bench.spec import decode_bound_ms

    costs = dict(verify_ms=4.0, row_ms=1.0, plain_ms=3.0)
    prompt, out = [5, 6, 7, 8], [5, 6, 7, 8, 9, 1]
    # after 5: the lookup proposes 6 7 8 5 and 6 7 8 would be accepted (4 + 3 ms); then the last token plainly
    assert decode_bound_ms(prompt, out, 8, costs) == pytest.approx(7 + 3)
    assert decode_bound_ms(prompt, out, 8, costs, all_accepted=True) == pytest.approx(4 + 4)
    # k = 2: 6 7 accepted (6 ms); 5 6 7 -> 8 proposed where 9 comes: plain (3 ms), then 1 plain (3 ms)
    assert decode_bound_ms(prompt, out, 2, costs) == pytest.approx(6 + 3 + 3)
    assert decode_bound_ms(prompt, [9], 8, costs) == 0.0  # the first token is the prefill's


def test_bench_spec_reports_both_modes(builtin_model_path, capsys):
    import json

    from kvinfer.cli import main

    # (--throughput-requests N adds a third row through the same batched path; its requests are long.)
    assert main(["bench", "spec", "--prompts", "2", "--max-tokens", "12", "--throughput-requests", "0",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["workload"] for r in res["rows"]] == ["extractive, single stream", "extractive, batched (2)"]
    for r in res["rows"]:
        assert r["identical"] == r["requests"] and r["generated_off"] == r["generated_on"] > 0
        assert r["speedup"] == pytest.approx(r["tps_on"] / r["tps_off"])
        assert 0 <= r["accepted"] <= r["proposed"]
    assert res["rows"][0]["accepted"] > 0 and res["speculative"] == "n-gram 1..4"
    per = res["rows"][0]["prompts"]  # single stream, prompt by prompt
    assert len(per) == 2 and sum(p["generated"] for p in per) == res["rows"][0]["generated_on"]
    for p in per:
        assert 0.0 <= p["lookup"] <= 1.0 and p["prompt_tokens"] > 0
        assert p["speedup"] == pytest.approx(p["ms_off"] / p["ms_on"])
    assert res["num_speculative_tokens"] == (8 if kernels.level() == "avx512" else 4)
    # Rounds: off and on back to back in each, the speed-up the median of the rounds' own ratios
    assert main(["bench", "spec", "--prompts", "1", "--max-tokens", "8", "--throughput-requests", "0", "--rounds", "3",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rounds"] == 3
    for r in res["rows"]:
        assert len(r["round_speedups"]) == 3 and r["speedup"] == sorted(r["round_speedups"])[1]
        assert r["identical"] == r["requests"] == 1
