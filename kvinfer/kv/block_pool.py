"""BlockPool: KV blocks with reference counts, an LRU free queue and the prefix-cache hash map."""
from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None  # set once the block is full and registered in the prefix cache


def hash_block(parent: Optional[bytes], token_ids: Iterable[int], prompt_tokens: Optional[int] = None) -> bytes:
    """Chained hash: a block's identity is its tokens and everything before them. prompt_tokens (where prompt
    rows are computed by their own route): how many of the block's tokens are its request's prompt, so that a
    block is only found by a request whose tokens there have the same roles (the same arithmetic)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if prompt_tokens is not None:
        h.update(b"P" + int(prompt_tokens).to_bytes(4, "little"))
    return h.digest()


class BlockPool:
    """Owns every block. A block is referenced (ref_cnt > 0) or in the free queue, never both.

    Free blocks that still hold a cached prefix stay findable by hash until they are reused; the free
    queue hands out the least recently freed block first, so the oldest cached prefixes go first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evictions = 0
        self.num_hits = 0  # blocks served from the prefix cache
        self.num_queries = 0  # full prompt blocks looked up
        # Called with (block id, hash) as a cached block is evicted, while its K/V are still intact (a tier below
        # the pool copies them).
        self.on_evict: Optional[Callable[[int, bytes], None]] = None
        # Called with the block id of every free block about to be handed out, before anything reads or writes it
        # (the RAM tier waits there for a copy of it still in progress).
        self.on_reuse: Optional[Callable[[int], None]] = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, evicting any cached prefix they hold."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if self.on_reuse is not None:
                self.on_reuse(bid)
            if blk.block_hash is not None:
                if self.cached.get(blk.block_hash) == bid:
                    del self.cached[blk.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(bid, blk.block_hash)
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            out.append(bid)
        return out

    def next_evictions(self, n: int) -> list[tuple[int, bytes]]:
        """(block id, hash) of the cached blocks among the next n free blocks allocate() will hand out."""
        out = []
        for bid in itertools.islice(self.free_queue, n):
            h = self.blocks[bid].block_hash
            if h is not None and self.cached.get(h) == bid:
                out.append((bid, h))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference (a prefix-cache hit or a fork)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; callers pass tail blocks first so those are evicted first."""
        for bid in block_ids:
            blk = self.blocks[bid]
            assert blk.ref_cnt > 0, f"block {bid} freed twice"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self.free_queue[bid] = None

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record a full block under its hash so later requests with the same prefix can share it."""
        if not self.enable_caching:
            return
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            return
        blk.block_hash = block_hash
        self.cached.setdefault(block_hash, block_id)

    def reset_prefix_cache(self) -> None:
        for bid in self.free_queue:
            self.blocks[bid].block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_cnt > 0}

    def check_integrity(self) -> None:
        for blk in self.blocks:
            in_free = blk.block_id in self.free_queue
            assert blk.ref_cnt >= 0, f"block {blk.block_id} has ref_cnt {blk.ref_cnt}"
            assert in_free == (blk.ref_cnt == 0), f"block {blk.block_id}: ref_cnt {blk.ref_cnt}, in free queue {in_free}"
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h, f"cache map points at block {bid} that holds another hash"
        assert len(self.free_queue) + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
