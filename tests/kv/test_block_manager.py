"""Block pool and paged KV manager: exact block ids, ref counts, LRU eviction, a hypothesis state machine."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvinfer.kv.block_pool import BlockPool
from kvinfer.kv.manager import PagedKVManager
from kvinfer.core.request import Request
from kvinfer.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def test_allocation_order_and_lru_eviction():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    pool.register(0, b"h0")
    pool.register(1, b"h1")
    pool.free(reversed(a))  # tail first: block 1 becomes the first to evict among a's
    assert list(pool.free_queue) == [4, 5, 1, 0]
    assert pool.allocate(3) == [4, 5, 1]
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == 0
    pool.touch([0])  # a cache hit revives a free block
    assert 0 not in pool.free_queue and pool.blocks[0].ref_cnt == 1
    pool.check_integrity()


def test_prefix_hits_and_copy_on_write():
    m = PagedKVManager(num_blocks=10, block_size=4)
    r1 = req("a", range(10))  # 2 full blocks + 2 tokens
    assert m.allocate_slots(r1, 10)
    assert m.block_tables["a"] == [0, 1, 2]
    r2 = req("b", list(range(8)) + [99, 98, 97])
    hits, n = m.get_computed_blocks(r2)
    assert hits == [0, 1] and n == 8
    assert m.allocate_slots(r2, 3, hits)
    assert m.block_tables["b"] == [0, 1, 3]
    assert m.pool.blocks[0].ref_cnt == 2
    # Fork a, then append to the child: the partial block 2 is copied before the write.
    r1.num_computed_tokens = 10
    child = req("c", range(10))
    child.num_computed_tokens = 10
    m.fork(r1, child)
    assert m.pool.blocks[2].ref_cnt == 2
    child.output_token_ids.append(7)
    assert m.allocate_slots(child, 1)
    assert m.block_tables["c"] == [0, 1, 4] and m.take_copies() == [(2, 4)]
    m.check_integrity()
    for r in (r1, r2, child):
        m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == 10


def test_allocation_failure_changes_nothing():
    m = PagedKVManager(num_blocks=3, block_size=4)
    r = req("a", range(20))
    assert not m.allocate_slots(r, 20)
    assert m.num_free_blocks == 3 and "a" not in m.block_tables
    m.check_integrity()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / cache hits; invariants checked after every rule."""

    def __init__(self):
        super().__init__()
        self.bs = 4
        self.m = PagedKVManager(num_blocks=12, block_size=self.bs)
        self.live: dict[str, Request] = {}
        self.n = 0

    def _new_id(self):
        self.n += 1
        return f"r{self.n}"

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 14))
    def allocate(self, prefix, length):
        # Prompts share up to 2 blocks of prefix so cache hits happen.
        tokens = [1000 + i for i in range(prefix * self.bs)] + [self.n * 100 + i for i in range(length)]
        r = req(self._new_id(), tokens)
        hits, cached = self.m.get_computed_blocks(r)
        free_before = self.m.num_free_blocks
        ok = self.m.allocate_slots(r, r.num_tokens - cached, hits)
        if ok:
            r.num_computed_tokens = r.num_tokens
            self.live[r.request_id] = r
            assert len(self.m.block_tables[r.request_id]) == -(-r.num_tokens // self.bs)
            assert self.m.block_tables[r.request_id][:len(hits)] == hits
        else:
            assert self.m.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        r.output_token_ids.append(7)
        if self.m.allocate_slots(r, 1):
            r.num_computed_tokens += 1
            assert len(self.m.block_tables[rid]) == -(-r.num_tokens // self.bs)
        else:
            r.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        parent = self.live[rid]
        child = Request(self._new_id(), list(parent.prompt_token_ids), parent.params)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.m.fork(parent, child)
        assert self.m.block_tables[child.request_id] == self.m.block_tables[rid]
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(self.live.pop(rid))

    @rule()
    def evict_all_cached(self):
        self.m.pool.reset_prefix_cache()

    @invariant()
    def integrity(self):
        self.m.check_integrity()
        self.m.take_copies()
        used = {b for t in self.m.block_tables.values() for b in t}
        assert self.m.num_free_blocks == 12 - len(used)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
