"""One step path: the scheduler plans fused decode steps (their KV slots included, and given back), the runner
executes the plan, and the engine appends the tokens; a plan of n steps gives the bits of n single steps."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvinfer import LLM, SamplingParams
from kvinfer.engine.llm_engine import LLMEngine
from kvinfer.kv.manager import PagedKVManager
from kvinfer.core.request import Request
from kvinfer.core.scheduler import MultiStep, Scheduler, SchedulerConfig


def _decoding(sched: Scheduler, n: int, **params) -> list[Request]:
    """n requests of 5 prompt tokens, prefilled and holding their first output token."""
    reqs = []
    for i in range(n):
        r = Request(str(i), [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0, **params))
        sched.add_request(r)
        reqs.append(r)
    out = sched.schedule()
    sched.update_after_step(out)
    for r in reqs:
        r.output_token_ids.append(7)
    return reqs


def _scheduler(blocks: int = 32) -> tuple[Scheduler, PagedKVManager]:
    kv = PagedKVManager(blocks, 4, enable_caching=False)
    return Scheduler(SchedulerConfig(8, 64, 64), kv), kv


def test_the_scheduler_plans_decode_steps_and_gives_back_the_slots_not_reached():
    sched, kv = _scheduler()
    a, b = _decoding(sched, 2)
    out = sched.schedule(MultiStep(8))
    assert out.decode_steps == 8 and [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == \
        [(a, 5, 1), (b, 5, 1)]
    assert [len(kv.get_block_table(r)) for r in (a, b)] == [4, 4]  # positions 5..12
    # The call made 3 steps; a's last token stopped it.
    a.output_token_ids += [8, 9, 10]
    b.output_token_ids += [8, 9, 11]
    sched.finish(a, "stop")
    sched.update_after_step(out)
    assert a.request_id not in kv.block_tables and a.num_computed_tokens == a.num_tokens - 1
    assert b.num_computed_tokens == 8 and len(kv.get_block_table(b)) == 2
    assert kv.num_free_units == 32 - 2
    sched.check_integrity()


def test_no_plan_of_decode_steps_where_a_request_cannot_take_one():
    sched, _ = _scheduler()
    _decoding(sched, 1, repetition_penalty=1.2)  # the fused call cannot apply a penalty
    assert sched.schedule(MultiStep(8)).decode_steps == 0

    sched, _ = _scheduler()
    (r,) = _decoding(sched, 1)
    sched.add_request(Request("new", [1, 2, 3], SamplingParams(max_tokens=4)))  # it would wait a whole call
    assert sched.schedule(MultiStep(8)).decode_steps == 0

    sched, _ = _scheduler()
    (r,) = _decoding(sched, 1)
    r.output_token_ids += [7] * 18  # one token left before max_tokens
    r.num_computed_tokens = r.num_tokens - 1
    assert sched.schedule(MultiStep(8)).decode_steps == 0  # a call of one step is planned instead
    sched, _ = _scheduler()
    (r,) = _decoding(sched, 1)
    r.output_token_ids += [7] * 18
    r.num_computed_tokens = r.num_tokens - 1
    assert sched.schedule(MultiStep(8, least=1)).decode_steps == 1


def test_a_pool_too_small_for_the_steps_plans_one_step_and_keeps_nothing_extra():
    sched, kv = _scheduler(blocks=5)  # two requests of 6 tokens hold 2 blocks each: no room for 8 more
    a, b = _decoding(sched, 2)
    out = sched.schedule(MultiStep(8))
    assert out.decode_steps == 0 and [s.num_new_tokens for s in out.scheduled] == [1, 1]
    assert [len(kv.get_block_table(r)) for r in (a, b)] == [2, 2] and kv.num_free_units == 1


def _engine(builtin_llm, steps: int, **kw) -> LLMEngine:
    return LLMEngine(builtin_llm.engine.config.replace(num_scheduler_steps=steps, kv_cache_memory=64 << 20, **kw),
                     loaded=builtin_llm.engine.loaded)


def _plans(engine) -> list:
    sched, plans = engine.scheduler, []
    orig = sched.schedule

    def schedule(*a):
        plans.append(orig(*a))
        return plans[-1]

    sched.schedule = schedule
    return plans


PARAMS = [SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=30, seed=5, logprobs=1, ignore_eos=True),
          SamplingParams(temperature=1.1, top_p=0.9, top_k=40, max_tokens=30, seed=9, ignore_eos=True)]
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):"]


def test_a_fused_plan_of_n_steps_equals_n_single_steps(builtin_llm):
    one, eight = _engine(builtin_llm, 1), _engine(builtin_llm, 8)
    for eng in (one, eight):
        for p, sp in zip(PROMPTS, PARAMS):
            eng.add_request(None, p, sp)
        eng.step_core()  # the prefill: a planned step
    plans = _plans(eight)
    steps0 = eight.stats["steps"]
    eight.step_core()
    steps = eight.stats["steps"] - steps0
    assert plans[0].decode_steps == 8 and 2 <= steps <= 8
    for _ in range(steps):
        one.step_core()
    for g1, g8 in zip(one.groups.values(), eight.groups.values()):
        r1, r8 = g1.reqs[0], g8.reqs[0]
        assert r8.output_token_ids == r1.output_token_ids and len(r8.output_token_ids) == 1 + steps
        assert r8.logprobs == r1.logprobs  # bit for bit
        assert r8.num_computed_tokens == r1.num_computed_tokens == r8.num_tokens - 1
        assert torch.equal(r8.generator.get_state(), r1.generator.get_state())  # drew exactly as often
        assert eight.kv_manager.get_block_table(r8) == one.kv_manager.get_block_table(r1)
    assert eight.kv_manager.num_free_units == one.kv_manager.num_free_units


def test_kv_goes_back_when_a_request_stops_mid_plan(builtin_llm):
    ref = _engine(builtin_llm, 1)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [ref.add_request(None, p, greedy) for p in PROMPTS[:2]]
    outs = {}
    while ref.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in ref.step() if o.finished})
    a_ref, b_ref = outs[ids[0]], outs[ids[1]]
    # a stop token for a: its output at index i, made by the call's i-th step, seen nowhere earlier in the call
    i = next(i for i in range(2, 8) if a_ref[i] not in a_ref[:i] and a_ref[i] not in b_ref[1:i + 1])
    eight = _engine(builtin_llm, 8)
    a_id = eight.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20,
                                                              stop_token_ids=[a_ref[i]]))
    b_id = eight.add_request(None, PROMPTS[1], greedy)
    eight.step_core()
    plans = _plans(eight)
    eight.step_core()
    a, b = eight.groups[a_id].reqs[0], eight.groups[b_id].reqs[0]
    assert plans[0].decode_steps == 8
    assert a.is_finished and a.finish_reason == "stop" and a.output_token_ids == a_ref[:i + 1]
    assert b.output_token_ids == b_ref[:i + 1] and not b.is_finished
    m = eight.kv_manager
    assert a.request_id not in m.block_tables  # freed when it stopped
    table = m.get_block_table(b)  # the slots of the steps not reached went back
    assert b.num_computed_tokens == b.num_tokens - 1 and len(table) == -(-b.num_computed_tokens // m.block_size)
    assert m.num_free_units == m.num_units - len(table)
    eight.check_integrity()


def test_no_kv_is_allocated_or_given_back_outside_the_scheduler(builtin_llm):
    """The engine's step never allocates, trims or frees KV itself: fused plans, their fallback when the pool is
    short, preemption, verification of proposals and finishing all go through the scheduler."""
    callers = set()
    cfg = builtin_llm.engine.config.replace(num_scheduler_steps=8, kv_cache_memory=64 << 20)
    per_block = builtin_llm.engine.kv_bytes_per_token * cfg.block_size
    loaded = builtin_llm.engine.loaded
    for c in (cfg, cfg.replace(kv_cache_memory=6 * per_block, max_model_len=6 * cfg.block_size),
              cfg.replace(speculative="ngram")):
        llm = LLM(config=c, loaded=loaded)
        m = llm.engine.kv_manager
        for name in ("allocate_slots", "trim", "free"):
            real = getattr(m, name)

            def recorded(*a, _real=real, **kw):
                callers.add(Path(sys._getframe(1).f_code.co_filename).name)
                return _real(*a, **kw)

            setattr(m, name, recorded)
        plans = _plans(llm.engine)
        llm.generate(PROMPTS + ["Repeat: one two three one two three one two"],
                     [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[13]),
                      SamplingParams(temperature=0.7, max_tokens=40, seed=1, n=2),
                      SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                      SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)], use_tqdm=False)
        assert any(p.decode_steps for p in plans)
        llm.engine.check_integrity()
        assert m.num_free_units == m.num_units
    assert callers == {"scheduler.py"}
