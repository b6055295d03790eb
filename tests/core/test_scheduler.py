"""The scheduler over a real PagedKVManager and plain data (no model): exact steps, and a hypothesis state machine."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvinfer.errors import RequestTooLargeError, ValidationError
from kvinfer.kv.manager import PagedKVManager, cdiv
from kvinfer.core.request import Request, RequestStatus
from kvinfer.sampling_params import SamplingParams
from kvinfer.core.scheduler import Scheduler, SchedulerConfig

NEW_TOKEN = 7  # what the pretend sampler always emits


def req(rid: str, prompt, max_tokens: int = 8, arrival: float = 0.0) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def sched(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=128, chunked=True, caching=False):
    kv = PagedKVManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len, chunked), kv)


def plan(out) -> list[tuple[str, int, int]]:
    """(request id, start, tokens) of each scheduled sequence, in step order."""
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def step(s: Scheduler, accepted: dict[str, int] | None = None):
    """One engine step without a model: sequences that caught up get one token; verifications accept
    `accepted[id]` proposals (default all), emit one token of their own and roll the rest back."""
    out = s.schedule()
    s.update_after_step(out)
    for seq in out.scheduled:
        r = seq.request
        if seq.spec_token_ids:
            j = (accepted or {}).get(r.request_id, len(seq.spec_token_ids))
            r.output_token_ids += seq.spec_token_ids[:j] + [NEW_TOKEN]
            s.rollback(r, r.num_tokens - 1)
        elif seq.end == r.num_tokens:
            r.output_token_ids.append(NEW_TOKEN)
    return out


def add(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.add_request(r)


def started(s: Scheduler, *reqs: Request):
    """The requests added, then one step (their prompts computed when the budget holds them)."""
    add(s, *reqs)
    return step(s)


def joined(s: Scheduler, r: Request) -> None:
    """r running with its prompt computed and one token pending, placed by hand where admission would keep the
    blocks free for the running sequences to grow into (to set up a pool that is full)."""
    assert s.kv.allocate_slots(r, r.num_tokens)
    r.num_computed_tokens, r.output_token_ids = r.num_tokens, [NEW_TOKEN]
    s.add_running(r)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# ---- budget and chunking --------------------------------------------------------------------------------
def test_running_first_then_waiting_in_arrival_order_under_the_budget():
    s = sched(budget=10)
    a, b, c = req("a", 4), req("b", 4), req("c", 6)
    add(s, a, b, c)
    assert plan(step(s)) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 2)]  # c's prompt is cut to what is left
    assert plan(step(s)) == [("a", 4, 1), ("b", 4, 1), ("c", 2, 4)]  # decodes first, then c's last chunk
    assert plan(step(s)) == [("a", 5, 1), ("b", 5, 1), ("c", 6, 1)]
    s.check_integrity()


def test_long_prompt_is_chunked_around_decodes():
    s = sched(budget=8)
    d = req("d", 3)
    started(s, d)
    long = req("long", 20)
    s.add_request(long)
    assert [plan(step(s)) for _ in range(4)] == [
        [("d", 3, 1), ("long", 0, 7)],
        [("d", 4, 1), ("long", 7, 7)],
        [("d", 5, 1), ("long", 14, 6)],  # the last chunk; its first token is sampled in this step
        [("d", 6, 1), ("long", 20, 1)]]
    assert long.output_token_ids == [NEW_TOKEN, NEW_TOKEN]


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it_whole():
    s = sched(budget=8, chunked=False)
    a, b, c = req("a", 4), req("b", 6), req("c", 1)
    add(s, a, b, c)
    assert plan(step(s)) == [("a", 0, 4)]  # b does not fit in the 4 left, and c may not pass it
    assert plan(step(s)) == [("a", 4, 1), ("b", 0, 6), ("c", 0, 1)]


def test_without_chunking_a_prompt_longer_than_the_whole_budget_still_runs_in_pieces():
    # Waiting for a budget that holds it whole would wait forever, and block every request behind it.
    s = sched(budget=8, chunked=False)
    a, b = req("a", 12, max_tokens=2), req("b", 2)
    add(s, a, b)
    assert plan(step(s)) == [("a", 0, 8)]
    assert plan(step(s)) == [("a", 8, 4), ("b", 0, 2)]


def test_without_chunking_a_preempted_request_longer_than_the_budget_recomputes_in_pieces():
    # Prompt and outputs together outgrow the budget by the time the request is preempted.
    s = sched(num_blocks=5, block_size=4, budget=6, chunked=False)
    a, b = req("a", 4, max_tokens=12, arrival=0), req("b", 2, max_tokens=12, arrival=1)
    add(s, a, b)
    longest_victim = 0
    for _ in range(60):
        out = step(s)
        assert out.num_batched_tokens <= 6 and (out.scheduled or out.preempted)
        longest_victim = max([longest_victim] + [s.requests[x].num_tokens for x in out.preempted])
        for r in list(s.running):
            if r.num_output_tokens >= 12:
                s.finish(r, "length")
        if not s.num_unfinished:
            break
    assert longest_victim > 6 and b.num_preemptions > 0
    assert not s.num_unfinished and a.num_output_tokens == 12 and b.num_output_tokens >= 12


# ---- admission ---------------------------------------------------------------------------------------
def test_admission_checks_name_the_parameter():
    s = sched(num_blocks=4, block_size=4, max_len=32)
    cases = [(req("e", []), ValidationError, "prompt"),
             (req("p", 32), RequestTooLargeError, "prompt"),  # no room left to generate
             (req("m", 30, max_tokens=3), RequestTooLargeError, "max_tokens"),  # over max_model_len
             (req("k", 10, max_tokens=7), RequestTooLargeError, "max_tokens")]  # 17 tokens > 16 slots of KV
    for r, err, param in cases:
        with pytest.raises(err) as e:
            s.check_fits(r.num_prompt_tokens, r.params.max_tokens)
        assert e.value.param == param
    s.check_fits(10, 6)  # exactly the 16 slots
    s.add_request(req("ok", 10, max_tokens=6))
    assert ids(s.waiting) == ["ok"]


def test_admission_stops_at_max_num_seqs_and_at_the_first_request_that_does_not_fit():
    s = sched(max_seqs=2, budget=64)
    add(s, *(req(r, 3) for r in "abc"))
    assert plan(step(s)) == [("a", 0, 3), ("b", 0, 3)]
    assert ids(s.waiting) == ["c"]
    s.finish(s.requests["a"], "stop")
    assert plan(step(s)) == [("b", 3, 1), ("c", 0, 3)]

    s = sched(num_blocks=4, block_size=4, budget=64)
    big, small = req("big", 9, max_tokens=4), req("small", 1, max_tokens=4)
    s.add_request(req("a", 8, max_tokens=4))
    add(s, big, small)
    assert plan(step(s)) == [("a", 0, 8)]  # big needs 3 blocks, 2 are free; small may not pass it
    assert ids(s.waiting) == ["big", "small"] and s.kv.num_free_blocks == 2


def test_prefix_hit_starts_after_the_cached_blocks_and_leaves_a_token_to_compute():
    s = sched(caching=True)
    a = req("a", range(9))
    started(s, a)
    b, c = req("b", list(range(8)) + [55, 56]), req("c", range(8))
    add(s, b, c)
    assert plan(step(s)) == [("a", 9, 1), ("b", 8, 2), ("c", 4, 4)]  # c: its last full block is recomputed
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)
    assert s.kv.get_block_table(b)[:2] == s.kv.get_block_table(a)[:2]


# ---- preemption and resumption ---------------------------------------------------------------------
def _three_decoding(num_blocks=6):
    s = sched(num_blocks=num_blocks, block_size=4, budget=64)
    rs = [req(x, 4, max_tokens=8, arrival=i) for i, x in enumerate("abc")]
    started(s, *rs)  # three prompts of exactly one block: each holds 1 block and has one token pending
    return s, rs


def test_the_newest_running_request_is_preempted_and_resumes_first():
    s, (a, b, c) = _three_decoding(num_blocks=5)
    s.add_request(req("d", 2, arrival=3))
    out = step(s)  # each needs a second block: a and b get them, c is pushed out
    assert plan(out) == [("a", 4, 1), ("b", 4, 1)] and out.preempted == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert "c" not in s.kv.block_tables and ids(s.waiting) == ["c", "d"]  # ahead of the newer d
    assert ids(s.running) == ["a", "b"]
    s.finish(a, "stop")
    out = step(s)
    # c recomputes its prompt and its pending output (5 tokens, 2 blocks); d would fit in the last free block,
    # but b and c each cross a block boundary within 4 tokens: d waits rather than be pushed out after its prefill.
    assert plan(out) == [("b", 5, 1), ("c", 0, 5)] and ids(s.waiting) == ["d"]
    assert s.num_preemptions == 1 and c.num_cached_tokens == 0


def test_several_victims_in_one_step_wait_in_arrival_order():
    # b is a's fork sibling: preempting it frees no block (all shared), so a has to go too.
    s = sched(num_blocks=2, block_size=4, budget=64)
    c, a = req("c", 2, max_tokens=2, arrival=0), req("a", 4, max_tokens=4, arrival=1)
    started(s, c)
    joined(s, a)
    b = req("b", range(100, 104), max_tokens=4, arrival=1)
    b.output_token_ids, b.num_computed_tokens = [9], 4
    s.kv.fork(a, b)
    s.add_running(b)
    out = step(s)
    assert out.preempted == ["b", "a"] and plan(out) == [("c", 2, 1)]
    assert ids(s.waiting) == ["a", "b"] and s.kv.num_free_blocks == 1
    s.finish(c, "stop")
    assert plan(step(s)) == [("a", 0, 5)] and ids(s.waiting) == ["b"]  # a recomputes first, b waits for room


def test_a_request_that_cannot_grow_alone_preempts_itself_and_comes_back_whole():
    s = sched(num_blocks=2, block_size=4, budget=64)
    a, b = req("a", 4, max_tokens=4, arrival=0), req("b", 4, max_tokens=4, arrival=1)
    started(s, a)
    joined(s, b)
    out = step(s)
    assert out.preempted == ["b"] and plan(out) == [("a", 4, 1)]
    s.finish(a, "stop")
    assert plan(step(s)) == [("b", 0, 5)]


def test_admission_leaves_a_free_block_per_running_sequence_to_grow_into():
    s = sched(num_blocks=7, block_size=4, budget=64)
    a, b = req("a", 3, max_tokens=8, arrival=0), req("b", 3, max_tokens=8, arrival=1)
    started(s, a, b)  # one block each, 5 free
    c, d = req("c", 8, max_tokens=4, arrival=2), req("d", 4, max_tokens=4, arrival=3)
    add(s, c, d)
    out = step(s)
    # c takes 2 blocks and leaves one each for a and b; d (1 block) would leave 2 for a, b and c.
    assert plan(out) == [("a", 3, 1), ("b", 3, 1), ("c", 0, 8)] and ids(s.waiting) == ["d"]
    for _ in range(4):  # a, b and c all cross into a new block; nobody is pushed out
        assert not step(s).preempted
    assert s.num_preemptions == 0 and ids(s.waiting) == ["d"] and s.kv.num_free_blocks == 0
    # With nothing running a request is admitted whenever it fits at all: no reserve can keep it out forever.
    for r in (a, b, c):
        s.finish(r, "stop")
    big = req("big", 27, max_tokens=1, arrival=4)
    s.waiting.appendleft(big)
    s.requests["big"] = big
    assert plan(step(s)) == [("big", 0, 27)] and s.kv.num_free_blocks == 0 and ids(s.waiting) == ["d"]


def test_waiting_requests_are_not_admitted_in_a_step_that_preempted():
    s, (a, b, c) = _three_decoding(num_blocks=5)
    s.add_request(req("tiny", 1, max_tokens=1, arrival=3))
    out = step(s)
    assert out.preempted == ["c"] and "tiny" not in [x for x, _, _ in plan(out)]


# ---- verification tokens (speculation) --------------------------------------------------------------
def test_proposals_ride_on_a_decode_and_are_capped_by_the_budget():
    s = sched(budget=6)
    a, b = req("a", 3, max_tokens=20), req("b", 2, max_tokens=20)
    started(s, a, b)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5, 6, 7], [8, 9]
    out = s.schedule()
    assert plan(out) == [("a", 3, 6), ("b", 2, 0)][:1]  # a takes the whole budget: 1 pending + 5 proposals
    assert out.scheduled[0].spec_token_ids == [1, 2, 3, 4, 5] and a.spec_token_ids == []
    assert b.spec_token_ids == [8, 9]  # not reached this step: kept for the next
    s.update_after_step(out)
    a.output_token_ids += [1, 2, NEW_TOKEN]  # two accepted, then the target's own token
    s.rollback(a, a.num_tokens - 1)
    assert a.num_computed_tokens == 6 and len(s.kv.get_block_table(a)) == 2  # the 9-token tail trimmed
    s.check_integrity()


def test_proposals_are_ignored_while_a_prompt_is_still_being_computed():
    s = sched(budget=4)
    a = req("a", 10)
    started(s, a)
    a.spec_token_ids = [1, 2]
    out = step(s)
    assert plan(out) == [("a", 4, 4)] and out.scheduled[0].spec_token_ids == [] and a.spec_token_ids == []


def test_rejected_proposals_are_rolled_back_and_recomputed_nowhere():
    s = sched(block_size=4)
    a = req("a", 3, max_tokens=20)
    started(s, a)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = step(s, accepted={"a": 0})  # all rejected: one new token only
    assert plan(out) == [("a", 3, 7)]
    assert a.output_token_ids == [NEW_TOKEN, NEW_TOKEN] and a.num_computed_tokens == 4
    assert len(s.kv.get_block_table(a)) == 1
    assert plan(step(s)) == [("a", 4, 1)]


# ---- forks and finishing ------------------------------------------------------------------------------
def test_a_forked_sibling_runs_on_its_parents_blocks_and_finishing_frees_only_its_own():
    s = sched(num_blocks=8, block_size=4)
    p = req("p", 6)
    started(s, p)
    child = req("p-1", range(100, 106))
    child.output_token_ids = [9]
    child.num_computed_tokens = p.num_computed_tokens
    s.kv.fork(p, child)
    s.add_running(child)
    out = s.schedule()
    assert plan(out) == [("p", 6, 1), ("p-1", 6, 1)] and len(out.block_copies) == 1  # the shared partial block
    s.update_after_step(out)
    s.finish(p, "stop")
    assert ids(s.running) == ["p-1"] and s.kv.num_free_blocks == 6
    s.check_integrity()


def test_finishing_a_waiting_or_unknown_request_only_dequeues_it():
    s = sched()
    a, b = req("a", 3), req("b", 3)
    add(s, a, b)
    s.finish(a, "abort")
    assert ids(s.waiting) == ["b"] and a.status == RequestStatus.FINISHED and a.finish_reason == "abort"
    s.finish(a, "abort")  # twice: nothing changes
    assert ids(s.waiting) == ["b"] and s.num_unfinished == 1


# ---- the state machine -------------------------------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps (with proposals accepted in part), aborts; invariants checked after every rule."""

    @initialize(chunked=st.booleans(), budget=st.integers(4, 24), max_seqs=st.integers(1, 5),
                num_blocks=st.integers(6, 14))
    def setup(self, chunked, budget, max_seqs, num_blocks):
        self.bs = 4
        self.s = sched(num_blocks=num_blocks, block_size=self.bs, budget=budget, max_seqs=max_seqs,
                       max_len=40, chunked=chunked, caching=True)
        self.n = 0
        self.order: dict[str, int] = {}  # request id -> arrival number

    @rule(prefix=st.integers(0, 2), length=st.integers(0, 14), max_tokens=st.integers(1, 12))
    def add(self, prefix, length, max_tokens):
        # Prompts share up to 2 blocks of prefix so cache hits happen.
        self.n += 1
        tokens = [1000 + i for i in range(prefix * self.bs)] + [self.n * 100 + i for i in range(length)]
        r = req(f"r{self.n}", tokens, max_tokens, arrival=self.n)
        try:
            self.s.check_fits(r.num_prompt_tokens, r.params.max_tokens)
        except (RequestTooLargeError, ValidationError):
            return
        self.s.add_request(r)
        self.order[r.request_id] = self.n

    @precondition(lambda self: self.s.running)
    @rule(data=st.data())
    def propose(self, data):
        r = data.draw(st.sampled_from(self.s.running))
        room = r.max_total_tokens - r.num_tokens
        if r.num_tokens - r.num_computed_tokens == 1 and room > 0:
            r.spec_token_ids = data.draw(st.lists(st.integers(0, 50), max_size=min(room, 5)))

    @rule(data=st.data())
    def step(self, data):
        s = self.s
        before = {r.request_id: (r.num_computed_tokens, r.num_tokens, list(r.spec_token_ids)) for r in s.running}
        waiting_before = ids(s.waiting)
        out = s.schedule()
        assert out.num_batched_tokens <= s.cfg.max_num_batched_tokens
        seen = ids(s.request for s in out.scheduled)
        assert len(seen) == len(set(seen)) and not set(seen) & set(out.preempted)
        for seq in out.scheduled:
            r = seq.request
            assert seq.num_new_tokens >= 1 and seq.start == r.num_computed_tokens
            assert seq.end - len(seq.spec_token_ids) <= r.num_tokens
            if r.request_id in before:
                computed, num_tokens, proposed = before[r.request_id]
                assert seq.start == computed
                assert seq.spec_token_ids == proposed[:len(seq.spec_token_ids)]
                assert not seq.spec_token_ids or num_tokens - computed == 1
            else:
                assert r.request_id in waiting_before and not seq.spec_token_ids
            assert len(s.kv.get_block_table(r)) >= cdiv(seq.end, self.bs)
        if out.preempted:
            assert not set(seen) - set(before)  # nothing admitted in a step that preempted
            # victims newest first; the waiting queue starts with them, oldest first
            assert [self.order[x] for x in out.preempted] == sorted((self.order[x] for x in out.preempted),
                                                                    reverse=True)
            assert ids(s.waiting)[:len(out.preempted)] == out.preempted[::-1]
        s.update_after_step(out)
        for seq in out.scheduled:
            r = seq.request
            if seq.spec_token_ids:
                j = data.draw(st.integers(0, len(seq.spec_token_ids)))
                new = seq.spec_token_ids[:j] + [NEW_TOKEN]
            elif seq.end == r.num_tokens:
                new = [NEW_TOKEN]
            else:
                continue
            for t in new:  # as the engine does: tokens one by one, until the request is done
                r.output_token_ids.append(t)
                if r.num_output_tokens >= r.params.max_tokens:
                    s.finish(r, "length")
                    break
            else:
                s.rollback(r, r.num_tokens - 1)
        s.kv.take_copies()

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        r = self.s.requests[data.draw(st.sampled_from(sorted(self.s.requests)))]
        self.s.finish(r, "abort")
        assert r.status == RequestStatus.FINISHED and r.request_id not in self.s.kv.block_tables

    @invariant()
    def consistent(self):
        s = self.s
        s.check_integrity()
        running, waiting = ids(s.running), ids(s.waiting)
        assert not set(running) & set(waiting)
        assert set(s.requests) == set(running) | set(waiting)
        assert len(running) <= s.cfg.max_num_seqs
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)
        # FCFS: admission and resumption keep arrival order across running, then waiting
        arrivals = [self.order[x] for x in running + waiting]
        assert arrivals == sorted(arrivals)
        # blocks accounted: a running request holds exactly the blocks of its computed tokens, others none
        assert set(s.kv.block_tables) == set(running)
        for r in s.running:
            assert len(s.kv.get_block_table(r)) == cdiv(r.num_computed_tokens, self.bs)
            assert r.num_computed_tokens <= r.num_tokens
        for r in s.waiting:
            assert r.num_computed_tokens == 0
        used = {b for t in s.kv.block_tables.values() for b in t}
        assert s.kv.num_free_blocks == s.kv.num_total_blocks - len(used)

    def teardown(self):
        # Liveness: whatever state it is in, the scheduler finishes everything without new arrivals.
        s = self.s
        for _ in range(400):
            if not s.num_unfinished:
                return
            out = step(s)
            for r in list(s.running):
                if r.num_output_tokens >= r.params.max_tokens:
                    s.finish(r, "length")
            assert out.scheduled or out.preempted, "the scheduler made no progress"
        raise AssertionError(f"not finished: {len(s.running)} running, {len(s.waiting)} waiting")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
