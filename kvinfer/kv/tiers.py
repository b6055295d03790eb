"""KV tiers below the paged pool: a RAM tier, and the chain (pool -> RAM -> disk -> Redis) the manager walks.

A tier stores a full block's K/V bytes (every layer's keys, values and scales) under its prefix-cache hash, in a
namespace named by a fingerprint of everything that changes those bytes (model file, dtypes, shapes, kernel
routes), so a block is only ever restored into the same model and layout. A tier can only save work: whatever it
cannot give back intact (missing, corrupt, foreign, unreachable) is a miss, and the block is recomputed.
No torch here: the engine hands in two functions that copy a pool block's bytes out and back in."""
from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from kvinfer.options import options

log = logging.getLogger("kvinfer")

FORMAT_VERSION = 1
# A stored record: magic, fingerprint (16 bytes), block hash (16), payload length, CRC-32 of the payload.
_HEADER = struct.Struct("<4s16s16sQI")
MAGIC = b"KVT1"
HEADER_BYTES = _HEADER.size


@dataclass
class TierStats:
    """Counters of one tier, as /metrics shows them."""

    hits: int = 0  # blocks restored from this tier into the pool
    misses: int = 0  # blocks looked up here and not found (or not usable)
    bytes_in: int = 0  # bytes restored from this tier
    bytes_out: int = 0  # bytes written to this tier
    evictions: int = 0  # blocks this tier dropped to stay within its budget
    errors: int = 0  # corrupt, truncated or foreign records, failed writes, unreachable server
    slow_skips: int = 0  # lookups that passed this tier by because fetching had measured slower than recomputing

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class OnceLog:
    """Logs each kind of trouble once per tier (a full disk or a dead server would otherwise log every block)."""

    def __init__(self, name: str):
        self.name = name
        self._seen: set[str] = set()

    def __call__(self, kind: str, msg: str, *args) -> None:
        if kind not in self._seen:
            self._seen.add(kind)
            log.warning("KV %s tier: " + msg + " (the block is recomputed; logged once)", self.name, *args)


def encode_record(fingerprint: bytes, key: bytes, payload) -> bytes:
    """Header + payload: what the disk and Redis tiers store."""
    mv = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, fingerprint, key, mv.nbytes, zlib.crc32(mv)) + bytes(mv)


def decode_record(data, fingerprint: bytes, key: bytes, payload_bytes: int) -> tuple[Optional[memoryview], str]:
    """(payload, "") if `data` is an intact record of this block under this fingerprint, else (None, why)."""
    mv = memoryview(data).cast("B")
    if mv.nbytes < HEADER_BYTES:
        return None, "truncated"
    magic, fp, k, n, crc = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        return None, "not a kvinfer block"
    if fp != fingerprint:
        return None, "foreign (another model or KV layout)"
    if k != key:
        return None, "holds another block"
    if n != payload_bytes or mv.nbytes != HEADER_BYTES + n:
        return None, "truncated" if mv.nbytes < HEADER_BYTES + n else "wrong length"
    payload = mv[HEADER_BYTES:]
    if zlib.crc32(payload) != crc:
        return None, "checksum mismatch"
    return payload, ""


class Tier:
    """A store of block payloads by key. get() returns a verified payload or None; put() never raises."""

    name = "?"
    persistent = False  # outlives the process (written through as blocks are computed, not only on eviction)
    batch = 1  # keys fetched per call (a networked tier: one round trip for several blocks of a prefix)

    def __init__(self):
        self.stats = TierStats()
        self.s_per_block: Optional[float] = None  # measured seconds to fetch a block (moving average), or None
        self.fetches = 0  # calls measured (KVTiers.fetch)

    def get(self, key: bytes):
        raise NotImplementedError

    def get_many(self, keys: Sequence[bytes]) -> list:
        """Payloads (or None) of several keys; a networked tier fetches them in one round trip."""
        return [self.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        raise NotImplementedError

    def put(self, key: bytes, payload) -> None:
        raise NotImplementedError

    def held(self) -> Optional[tuple[int, int]]:
        """(blocks, bytes) this tier holds now, or None where it cannot tell cheaply (a shared server)."""
        return None

    def close(self) -> None:
        pass


class RamTier(Tier):
    """Blocks evicted from the pool, in process memory up to a byte budget, least recently used dropped first.
    Filled by the copy-ahead thread and read by the engine's thread: each call holds a lock."""

    name = "ram"

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget
        self.used = 0
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes):
        with self._lock:
            payload = self.blocks.get(key)
            if payload is not None:
                self.blocks.move_to_end(key)
            return payload

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def touch(self, key: bytes) -> bool:
        """Mark a held block as the most recently used one; False if the tier does not hold it."""
        with self._lock:
            if key not in self.blocks:
                return False
            self.blocks.move_to_end(key)
            return True

    def held(self) -> Optional[tuple[int, int]]:
        with self._lock:
            return len(self.blocks), self.used

    def put(self, key: bytes, payload) -> None:
        n = len(payload)
        if n > self.budget:
            return
        with self._lock:
            old = self.blocks.pop(key, None)
            if old is not None:
                self.used -= len(old)
            while self.used + n > self.budget:
                _, dropped = self.blocks.popitem(last=False)
                self.used -= len(dropped)
                self.stats.evictions += 1
            self.blocks[key] = payload
            self.used += n
            self.stats.bytes_out += n


def file_identity(path: Optional[Path]) -> bytes:
    """A model's identity without reading all of it: per file (a GGUF, or a directory's config, tokenizer and
    weights), its name, size and the hash of its first MiB (a GGUF's header and metadata, a safetensors header)."""
    h = hashlib.blake2b(digest_size=16)
    if path is None:
        return h.digest()
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".gguf",
                                                                              ".bin", ".model")) \
        if path.is_dir() else [path]
    for f in files:
        st = f.stat()
        h.update(f.name.encode() + b"\0" + st.st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.digest()


def fingerprint(parts: dict) -> bytes:
    """16 bytes naming a KV layout: the format version and every field given (model identity, dtypes, shapes...)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"kvinfer-kv-tier-v{FORMAT_VERSION}".encode())
    for k in sorted(parts):
        h.update(f"\0{k}={parts[k]!r}".encode())
    return h.digest()


class KVTiers:
    """The tiers below one pool, in lookup order, and the traffic between them and the pool.

    - copy_ahead / on_reuse / on_evict: the cached blocks the pool will hand out next (the head of its free queue)
      are copied to the RAM tier (if any) by a worker thread, while the engine computes; a block still being
      copied is only handed out once its copy has finished (on_reuse waits), and a cached block evicted without a
      copy made ahead (the worker's queue was full) is copied on the spot (on_evict) before it is overwritten.
    - computed / after_step: a newly computed full block is written through to the persistent tiers (disk,
      Redis) by a background thread, which also takes the block's copy; like a RAM copy in progress, a block
      whose copy has not been taken yet is only handed out again once it has (on_reuse waits).
    - restore: a prefix the pool misses is fetched from the first tier holding each block, as far as the
      prefix goes, and copied into free pool blocks before the step that reads them.
    """

    def __init__(self, fp: bytes, block_bytes: int, read_block: Callable[[int], bytes],
                 write_block: Callable[[int, object], None], tiers: Sequence[Tier],
                 max_pending_bytes: int = 256 << 20, ahead: int = 0, block_tokens: int = 16):
        self.fingerprint = fp
        self.block_tokens = block_tokens
        # Recomputing against fetching: the engine's measured seconds per prompt token (note_compute) against each
        # tier's measured seconds per block; a tier slower than recomputing is passed by, but probed again every
        # PROBE_EVERY lookups so that a tier that recovered is used again.
        self.recompute_s_per_token: Optional[float] = None
        self._passed: dict[int, int] = {}  # tier index -> lookups passed by since its last probe
        self.block_bytes = block_bytes
        self.read_block = read_block
        self.write_block = write_block
        self.tiers = list(tiers)
        self.ram = next((t for t in self.tiers if isinstance(t, RamTier)), None)
        self.persistent = [t for t in self.tiers if t.persistent]
        self._pending: list[tuple[int, bytes]] = []  # (block id, hash) computed this step, to write through
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes the persistent tiers hold (or were sent)
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._qlock = threading.Lock()
        self.max_pending_bytes = max_pending_bytes
        self.dropped_writes = 0  # blocks not written through because the writer was too far behind
        self._writer: Optional[threading.Thread] = None
        self._write_pending: dict[int, threading.Event] = {}  # block id -> set once the writer has copied it
        if self.persistent:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()
        # The RAM tier's copies ahead of eviction: up to `ahead` blocks from the head of the pool's free queue,
        # queued to a worker thread (a bounded queue); block id -> event set once its copy is done.
        self.ahead = ahead if self.ram is not None else 0
        self._ram_pending: dict[int, threading.Event] = {}
        self._ram_queue: queue.Queue = queue.Queue(maxsize=max(self.ahead, 1))
        self.copies_ahead = 0  # evicted-block copies the worker made ahead
        self.sync_copies = 0  # copies made on the spot at eviction, on the engine's thread (none was made ahead)
        self.reuse_waits = 0  # blocks whose reuse waited for their copy to finish
        self._copier: Optional[threading.Thread] = None
        if self.ahead:
            self._copier = threading.Thread(target=self._copy_loop, name="kv-tier-ram", daemon=True)
            self._copier.start()

    # ---- the pool's hooks ---------------------------------------------------------------
    def copy_ahead(self, candidates: Sequence[tuple[int, bytes]]) -> None:
        """Queue copies to the RAM tier of the cached blocks the pool hands out next ((block id, hash), the next
        first); called on the engine's thread between steps. The worker copies them while the engine computes."""
        for bid, key in candidates:
            if bid in self._ram_pending or self.ram.contains(key):
                continue
            ev = threading.Event()
            self._ram_pending[bid] = ev
            try:
                self._ram_queue.put_nowait((bid, key, ev))
            except queue.Full:  # the worker is behind: these blocks get copied at eviction instead
                del self._ram_pending[bid]
                return

    def _copy_loop(self) -> None:
        while True:
            item = self._ram_queue.get()
            if item is None:
                self._ram_queue.task_done()
                return
            bid, key, ev = item
            try:
                if not self.ram.contains(key):
                    self.ram.put(key, self.read_block(bid))
                    self.copies_ahead += 1
            except Exception as e:  # noqa: BLE001 - a tier may only save work, never fail a step
                self.ram.stats.errors += 1
                log.warning("KV ram tier: could not copy a block: %s", e)
            finally:
                if self._ram_pending.get(bid) is ev:
                    del self._ram_pending[bid]
                ev.set()
                self._ram_queue.task_done()

    @property
    def watches_reuse(self) -> bool:
        """Whether the pool must call on_reuse: some copy of a block may still be in progress on a worker."""
        return bool(self.ahead or self.persistent)

    def on_reuse(self, block_id: int) -> None:
        """The pool is about to hand out this free block: a copy of it still in progress finishes first."""
        for pending in (self._ram_pending, self._write_pending):
            ev = pending.get(block_id)
            if ev is not None:
                self.reuse_waits += 1
                ev.wait()

    def on_evict(self, block_id: int, key: bytes) -> None:
        if self.ram is None or self.ram.touch(key):  # copied ahead: it now lives in the RAM tier only
            return
        try:
            self.ram.put(key, self.read_block(block_id))
            self.sync_copies += 1
        except Exception as e:  # noqa: BLE001 - a tier may only save work, never fail a step
            self.ram.stats.errors += 1
            log.warning("KV ram tier: could not copy an evicted block: %s", e)

    def computed(self, block_id: int, key: bytes) -> None:
        if self.persistent and key not in self._known:
            self._pending.append((block_id, key))

    def after_step(self, still_holds: Callable[[int, bytes], bool]) -> None:
        """Queue the blocks computed by the step just run for the persistent tiers; the writer thread copies
        them out of the pool (a full block's K/V no longer changes while the pool holds it under its hash)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for bid, key in pending:
            if key in self._known or not still_holds(bid, key):
                continue
            with self._qlock:
                if self._queued_bytes + self.block_bytes > self.max_pending_bytes:
                    self.dropped_writes += 1
                    continue
                self._queued_bytes += self.block_bytes
            self._remember(key)
            # A block is queued again only after it was handed out again, which waited for this copy
            ev = self._write_pending[bid] = threading.Event()
            self._queue.put((key, bid, ev))

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        if len(self._known) > 1 << 17:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, bid, ev = item
            try:
                try:
                    payload = self.read_block(bid)
                finally:  # the pool may hand the block out again from here on
                    if self._write_pending.get(bid) is ev:
                        del self._write_pending[bid]
                    ev.set()
                for t in self.persistent:
                    t.put(key, payload)
            except Exception as e:  # noqa: BLE001 - tiers handle their own errors; this is a last guard
                log.warning("KV tier writer: %s", e)
            finally:
                with self._qlock:
                    self._queued_bytes -= self.block_bytes
                self._queue.task_done()

    @property
    def queued_bytes(self) -> int:
        """Bytes copied and waiting for the writer thread (0 once everything computed so far is written)."""
        with self._qlock:
            return self._queued_bytes

    def flush(self) -> None:
        """Wait until every queued block has been written and every queued RAM copy made (tests, shutdown)."""
        if self._copier is not None:
            self._ram_queue.join()
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._copier is not None and self._copier.is_alive():
            self._ram_queue.put(None)
            self._copier.join()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        for t in self.tiers:
            t.close()

    # ---- lookup ---------------------------------------------------------------------------
    PROBE_EVERY = 16
    TRUST_AFTER = 3  # fetches measured before a tier may be passed by (the first, which connects, is not counted)
    SLOWER = 2.0  # passed by only when a block's fetch measured this many times its recomputation

    def note_compute(self, seconds: float, tokens: int) -> None:
        """A step computed `tokens` tokens in `seconds` (the engine, after each step with enough tokens to say)."""
        if tokens >= 32 and seconds > 0:
            v = seconds / tokens
            old = self.recompute_s_per_token
            self.recompute_s_per_token = v if old is None else 0.7 * old + 0.3 * v

    def _slower_than_recomputing(self, ti: int, t: Tier) -> bool:
        """Whether to pass tier t by for this lookup: it fetched a block more slowly than the engine computes one
        (a loaded disk, a far or slow Redis). Every PROBE_EVERY-th lookup it is tried anyway, to measure again."""
        if t.fetches < self.TRUST_AFTER or self.recompute_s_per_token is None:
            return False
        if t.s_per_block <= self.SLOWER * self.recompute_s_per_token * self.block_tokens:
            self._passed.pop(ti, None)
            return False
        n = self._passed.get(ti, 0) + 1
        if n >= self.PROBE_EVERY:
            self._passed[ti] = 0
            return False
        self._passed[ti] = n
        t.stats.slow_skips += 1
        return True

    @staticmethod
    def _measured(t: Tier, seconds: float, blocks: int) -> None:
        """A fetch's seconds per block: a faster one is taken as it is (a probe that finds the tier recovered
        makes it usable at once), a slower one moves the average a third of the way."""
        t.fetches += 1
        if t.fetches == 1:
            return  # a first call pays for connecting and opening: not what the next ones cost
        v = seconds / max(blocks, 1)
        t.s_per_block = v if t.s_per_block is None or v < t.s_per_block else 0.7 * t.s_per_block + 0.3 * v

    def fetch(self, keys: Sequence[bytes]) -> Iterator[tuple[bytes, object]]:
        """(key, payload) of keys[0], keys[1], ... while some tier holds each; stops at the first block none has.
        Networked tiers are asked for the rest of the prefix at once, the first time the walk reaches them. A tier
        measured slower than recomputing is passed by (_slower_than_recomputing): the block is computed instead."""
        batched: dict[int, dict[bytes, object]] = {}
        passed: set[int] = set()
        for i, key in enumerate(keys):
            payload = None
            for ti, t in enumerate(self.tiers):
                if ti in passed:
                    continue
                if ti not in batched and self._slower_than_recomputing(ti, t):
                    passed.add(ti)
                    continue
                t0 = time.perf_counter()
                if t.batch > 1:
                    got = batched.setdefault(ti, {})
                    if key not in got:
                        chunk = keys[i:i + t.batch]
                        got.update(zip(chunk, t.get_many(chunk)))
                        self._measured(t, time.perf_counter() - t0, len(chunk))
                    payload = got.pop(key)
                else:
                    batched.setdefault(ti, {})  # asked once this lookup: not passed by from here on
                    payload = t.get(key)
                    self._measured(t, time.perf_counter() - t0, 1)
                if payload is not None:
                    t.stats.hits += 1
                    t.stats.bytes_in += self.block_bytes
                    if t.persistent:
                        self._remember(key)
                    break
                t.stats.misses += 1
            if payload is None:
                return
            yield key, payload

    def load(self, block_id: int, payload) -> bool:
        """Copy a fetched payload into a pool block; False (logged) if that failed."""
        try:
            self.write_block(block_id, payload)
            return True
        except Exception as e:  # noqa: BLE001 - a tier may only save work, never fail a step
            log.warning("KV tiers: could not load a block into the pool: %s", e)
            return False

    def counters(self) -> dict[str, dict]:
        return {t.name: t.stats.as_dict() for t in self.tiers}

    def snapshot(self) -> list[dict]:
        """Per tier, in lookup order: its name and label, what it holds (None where unknown) and its counters."""
        out = []
        for t in self.tiers:
            held = t.held()
            out.append(dict(name=t.name, label=getattr(t, "label", t.name), blocks=held[0] if held else None,
                            bytes=held[1] if held else None, **t.stats.as_dict()))
        return out

    def describe(self) -> str:
        parts = []
        for t in self.tiers:
            parts.append(getattr(t, "label", t.name))
        return ", ".join(parts)


def env_switches() -> dict:
    """The environment switches that change a computed block's bits, as the environment spelled them (a persisted
    block's fingerprint keeps the spelling it always had)."""
    opts = options()
    return {k: opts.raw(k) for k in ("KVINFER_KERNELS", "KVINFER_BATCH_INVARIANT", "KVINFER_PROMPT_BF16")}


def plan_tiers(kv_bytes_per_token: int, block_size: int, sizes: dict[str, int], prefix_tokens: int = 4000) -> dict:
    """What each tier of the given byte size holds: blocks, tokens, and prefixes of `prefix_tokens` tokens (a disk
    or Redis record also carries its header)."""
    payload = kv_bytes_per_token * block_size
    out = {}
    for name, size in sizes.items():
        per_block = payload + (HEADER_BYTES if name != "ram" else 0)
        blocks = size // per_block
        out[name] = dict(bytes=size, bytes_per_block=per_block, blocks=blocks, tokens=blocks * block_size,
                         prefixes=blocks // max(1, -(-prefix_tokens // block_size)), prefix_tokens=prefix_tokens)
    return out
