"""KV managers: which cache memory each request owns (paged blocks, contiguous slots, or none), as `KVManager`s."""
from __future__ import annotations

from typing import Optional, Sequence

from kvinfer.kv.block_pool import BlockPool, hash_block
from kvinfer.kv.interface import SeqSlice
from kvinfer.core.request import Request

# Block states in a paged snapshot, one small int per block so a map of thousands of blocks stays a few KB.
FREE, CACHED_FREE, OWNED, SHARED = 0, 1, 2, 3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVManager:
    """Block tables per request over a shared BlockPool, with prefix caching and copy-on-write forks."""

    kind = "paged"
    keeps_kv = True
    can_fork = True
    unit_name = "block"

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, prompt_roles: bool = False):
        self.block_size = self.unit_tokens = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[bytes]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do
        # Where the runner computes prompt rows by their own route (kernels' prompt route), a block's K/V depends
        # on which of its tokens were prompt tokens: its hash then also says how many were. Fixed at construction,
        # before any block is hashed.
        self.prompt_roles = prompt_roles
        self.tiers = None  # kv.tiers.KVTiers below the pool, set by the engine (attach_tiers)

    def attach_tiers(self, tiers) -> None:
        """Tiers below the pool: evicted blocks go there, prefix misses are looked up there."""
        self.tiers = tiers
        self.pool.on_evict = tiers.on_evict
        if tiers.watches_reuse:
            self.pool.on_reuse = tiers.on_reuse

    def after_step(self) -> None:
        """The blocks registered for the step just run now hold their K/V: the tiers may copy them."""
        blocks = self.pool.blocks
        self.tiers.after_step(lambda bid, h: blocks[bid].block_hash == h and blocks[bid].ref_cnt > 0)

    def copy_ahead(self) -> None:
        """After a step (its finished requests' blocks freed): the RAM tier's worker copies the cached blocks the
        next steps may evict, while they compute."""
        if self.tiers is not None and self.tiers.ahead:
            self.tiers.copy_ahead(self.pool.next_evictions(self.tiers.ahead))

    def _roles(self, req: Request, i: int) -> Optional[int]:
        if not self.prompt_roles:
            return None
        return min(max(req.num_prompt_tokens - i * self.block_size, 0), self.block_size)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    num_units = num_total_blocks
    num_free_units = num_free_blocks

    @property
    def token_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    max_request_tokens = token_capacity

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks; at least one token is always left to compute."""
        if not self.pool.enable_caching:
            return [], 0
        bs = self.block_size
        hits: list[int] = []
        parent = None
        max_blocks = (req.num_tokens - 1) // bs
        for i in range(max_blocks):
            h = hash_block(parent, req.token_slice(i * bs, (i + 1) * bs), self._roles(req, i))
            bid = self.pool.lookup(h)
            if bid is None:
                if self.tiers is not None:
                    hits += self._restore(req, hits, h, i, max_blocks)
                break
            hits.append(bid)
            parent = h
        self.pool.num_queries += max_blocks
        self.pool.num_hits += len(hits)
        return hits, len(hits) * bs

    def _restore(self, req: Request, hits: list[int], h: bytes, first: int, max_blocks: int) -> list[int]:
        """Blocks first.. of the prefix (h: block first's hash) from the tiers below the pool, as far as they hold
        them: each copied into a free pool block and registered, as if it had stayed cached. The hits found so far
        are held meanwhile, so that making room never evicts them."""
        bs, pool = self.block_size, self.pool
        keys = [h]
        for i in range(first + 1, max_blocks):
            keys.append(hash_block(keys[-1], req.token_slice(i * bs, (i + 1) * bs), self._roles(req, i)))
        pool.touch(hits)
        got: list[int] = []
        try:
            for key, payload in self.tiers.fetch(keys):
                bid = pool.lookup(key)
                if bid is not None:  # still in the pool after all (a later block outlived an earlier one)
                    pool.touch([bid])
                elif pool.num_free_blocks <= 1:  # leave the request a block to compute into
                    break
                else:
                    (bid,) = pool.allocate(1)
                    if not self.tiers.load(bid, payload):
                        pool.free([bid])
                        break
                    pool.register(bid, key)
                got.append(bid)
        finally:
            # Back to the free queue as cached blocks, the prefix's tail first (evicted first).
            pool.free(reversed(hits + got))
        return got

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       reserve: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens with `reserve` blocks still free afterwards; False (and no
        change) if the pool cannot."""
        bs = self.block_size
        table = self.block_tables.setdefault(req.request_id, [])
        start = req.num_computed_tokens + len(computed_blocks) * bs
        end = start + num_new_tokens
        need = cdiv(end, bs) - len(table) - len(computed_blocks)
        cow = bool(table) and start % bs != 0 and self.pool.blocks[table[-1]].ref_cnt > 1
        reviving = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(need, 0) + cow + reserve > self.pool.num_free_blocks - reviving:
            if not table:
                del self.block_tables[req.request_id]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self.block_hashes[req.request_id] = [self.pool.blocks[b].block_hash for b in computed_blocks]
        if cow:
            # The partial last block is shared with a fork sibling: copy it before writing into it.
            old = table[-1]
            (new,) = self.pool.allocate(1)
            self.pending_copies.append((old, new))
            table[-1] = new
            self.pool.free([old])
        if need > 0:
            table.extend(self.pool.allocate(need))
        # Only known tokens: proposed ones being verified (end > num_tokens) are not the request's yet.
        self._register_full_blocks(req, table, min(end, req.num_tokens))
        return True

    def _register_full_blocks(self, req: Request, table: list[int], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        hashes = self.block_hashes.setdefault(req.request_id, [])
        for i in range(len(hashes), num_tokens // bs):
            h = hash_block(hashes[-1] if hashes else None, req.token_slice(i * bs, (i + 1) * bs), self._roles(req, i))
            hashes.append(h)
            self.pool.register(table[i], h)
            if self.tiers is not None:
                self.tiers.computed(table[i], h)  # written through once the step has computed it

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep the blocks of the first num_tokens tokens (rejected proposals' slots go back, tail first)."""
        table = self.block_tables.get(req.request_id)
        if table is None:
            return
        keep = cdiv(num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        hashes = self.block_hashes.get(req.request_id)
        if hashes is not None and len(hashes) > num_tokens // self.block_size:
            del hashes[num_tokens // self.block_size:]

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, [])
        self.block_hashes.pop(req.request_id, None)
        self.pool.free(reversed(table))

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write when it writes a shared block)."""
        table = list(self.block_tables[parent.request_id])
        self.pool.touch(table)
        self.block_tables[child.request_id] = table
        self.block_hashes[child.request_id] = list(self.block_hashes.get(parent.request_id, []))

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def get_block_table(self, req: Request) -> list[int]:
        return self.block_tables[req.request_id]

    def seq_slice(self, req: Request, start: int, num_new: int) -> SeqSlice:
        return SeqSlice(start, num_new, block_table=self.block_tables[req.request_id])

    @property
    def prefix_caching(self) -> bool:
        return self.pool.enable_caching

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.pool.num_hits, self.pool.num_queries

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def snapshot(self, seqs: Sequence[Request]) -> tuple[dict, list[dict]]:
        """Per block: state, owner (index into seqs: the oldest holder of a shared block; -1 none), ref count and
        tokens held (a request's last block is partly empty: the only memory paging still wastes)."""
        pool, bs = self.pool, self.block_size
        n = pool.num_blocks
        owner, fill = [-1] * n, [0] * n
        for i, r in enumerate(seqs):  # running first, oldest first: a shared prefix block takes its first holder
            for j, b in enumerate(self.block_tables.get(r.request_id, ())):
                if owner[b] < 0:
                    owner[b] = i
                fill[b] = max(fill[b], min(max(r.num_computed_tokens - j * bs, 0), bs))
        state, refs = [FREE] * n, [0] * n
        for blk in pool.blocks:
            b, rc = blk.block_id, blk.ref_cnt
            refs[b] = rc
            if rc > 1:
                state[b] = SHARED
            elif rc == 1:
                state[b] = OWNED
            elif blk.block_hash is not None and pool.cached.get(blk.block_hash) == b:
                state[b] = CACHED_FREE  # free, yet a request with the same prefix would still find it
        fields = {"block_size": bs, "blocks": {"state": state, "owner": owner, "refs": refs, "fill": fill},
                  "blocks_shared": state.count(SHARED), "blocks_cached_free": state.count(CACHED_FREE),
                  "tokens_stored": sum(fill), "tokens_allocated": pool.num_used_blocks * bs}
        return fields, [{"block_table": list(self.block_tables.get(r.request_id, ()))} for r in seqs]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                refs[b] += 1
        for blk in self.pool.blocks:
            assert blk.ref_cnt == refs[blk.block_id], (
                f"block {blk.block_id}: ref_cnt {blk.ref_cnt} but {refs[blk.block_id]} block-table references")


class SlotManager:
    """The textbook cache: each request reserves one max-length slot for its whole life."""

    kind = "contiguous"
    keeps_kv = True
    prefix_caching = can_fork = False
    unit_name = "slot"

    def __init__(self, num_slots: int, max_len: int):
        self.num_slots = self.num_units = num_slots
        self.max_len = self.unit_tokens = self.max_request_tokens = max_len
        self.free_slots = list(range(num_slots))
        self.slot_of: dict[str, int] = {}

    @property
    def num_free_units(self) -> int:
        return len(self.free_slots)

    @property
    def token_capacity(self) -> int:
        return self.num_slots * self.max_len

    def get_computed_blocks(self, req):
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks=(), reserve: int = 0) -> bool:
        if req.request_id not in self.slot_of:
            if not self.free_slots:
                return False
            self.slot_of[req.request_id] = self.free_slots.pop(0)
        return req.num_computed_tokens + num_new_tokens <= self.max_len

    def trim(self, req: Request, num_tokens: int) -> None:
        pass  # positions past num_tokens are simply overwritten later

    def free(self, req: Request) -> None:
        slot = self.slot_of.pop(req.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort()

    def fork(self, parent: Request, child: Request) -> None:
        raise NotImplementedError("a contiguous slot cannot be shared")

    def take_copies(self):
        return []

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_len and self.num_slots > 0

    def seq_slice(self, req: Request, start: int, num_new: int) -> SeqSlice:
        return SeqSlice(start, num_new, slot=self.slot_of[req.request_id])

    def prefix_cache_stats(self) -> tuple[int, int]:
        return 0, 0

    def reset_prefix_cache(self) -> None:
        pass

    def snapshot(self, seqs: Sequence[Request]) -> tuple[dict, list[dict]]:
        """Per slot: its owner (index into seqs, -1 none), tokens used, tokens reserved (always max_len)."""
        index = {r.request_id: i for i, r in enumerate(seqs)}
        by_slot = {s: rid for rid, s in self.slot_of.items()}
        slots = []
        for s in range(self.num_slots):
            i = index.get(by_slot.get(s), -1)
            slots.append({"slot": s, "owner": i, "used_tokens": seqs[i].num_computed_tokens if i >= 0 else 0,
                          "reserved_tokens": self.max_len})
        fields = {"slots": slots, "tokens_allocated": (self.num_slots - len(self.free_slots)) * self.max_len}
        return fields, [{"slot": self.slot_of.get(r.request_id)} for r in seqs]

    def check_integrity(self) -> None:
        used = list(self.slot_of.values())
        assert len(set(used)) == len(used), "two requests share a slot"
        assert sorted(used + self.free_slots) == list(range(self.num_slots)), "slots lost or duplicated"


class NullManager:
    """No cache: nothing to allocate, every step recomputes every sequence."""

    kind = "none"
    keeps_kv = prefix_caching = can_fork = False
    unit_name = "slot"
    unit_tokens = num_units = num_free_units = token_capacity = 0
    max_request_tokens = 1 << 62  # only the context window limits a request

    def get_computed_blocks(self, req):
        return [], 0

    def allocate_slots(self, req, num_new_tokens, computed_blocks=(), reserve: int = 0) -> bool:
        return True

    def free(self, req) -> None:
        pass

    def trim(self, req, num_tokens: int) -> None:
        pass

    def fork(self, parent, child) -> None:
        raise NotImplementedError("the none backend has no cache to share")

    def take_copies(self):
        return []

    def can_ever_fit(self, num_tokens: int) -> bool:
        return True

    def seq_slice(self, req, start: int, num_new: int) -> SeqSlice:
        return SeqSlice(0, start + num_new)  # recompute from the first token

    def prefix_cache_stats(self) -> tuple[int, int]:
        return 0, 0

    def reset_prefix_cache(self) -> None:
        pass

    def snapshot(self, seqs) -> tuple[dict, list[dict]]:
        return {"tokens_allocated": 0}, [{} for _ in seqs]

    def check_integrity(self) -> None:
        pass
