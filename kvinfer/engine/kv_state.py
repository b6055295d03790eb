"""`kv_state(engine)`: a read-only, JSON-ready picture of the KV cache and the requests that hold it."""
from __future__ import annotations

import time

from kvinfer.request import Request, RequestStatus

# Block states in `blocks.state`, one small int per block so a map of thousands of blocks stays a few KB.
FREE, CACHED_FREE, OWNED, SHARED = 0, 1, 2, 3


def kv_state(engine) -> dict:
    """Everything the live page draws, read from an LLMEngine that is not stepping.

    Call it on the engine's own thread (`AsyncLLMEngine.call`): block tables and ref counts change during a
    step, and a snapshot taken halfway would show blocks owned by nobody or by two requests at once.
    Prompt text is never included: only the server knows which requests may show theirs.
    """
    m, sched = engine.kv_manager, engine.scheduler
    seqs: list[Request] = list(sched.running) + list(sched.waiting)
    pool = getattr(m, "pool", None)
    running = len(sched.running)
    preempted = sum(r.status == RequestStatus.PREEMPTED for r in sched.waiting)
    logical = sum(r.num_computed_tokens for r in sched.running)  # a shared prefix counts once per request
    now = time.perf_counter()
    out = {
        "time": time.time(),
        "backend": m.kind,
        "block_size": m.block_size if m.kind == "paged" else None,
        "num_blocks": m.num_total_blocks,
        "blocks_used": m.num_total_blocks - m.num_free_blocks,
        "bytes_per_token": engine.kv_bytes_per_token,
        "capacity_tokens": m.token_capacity,
        "kv_bytes": engine.kv_cache.nbytes,
        "max_model_len": engine.max_model_len,
        "tokens_logical": logical,
        "tokens_stored": logical,  # distinct tokens held; below for paged, where shared blocks hold them once
        "prefix_cache": {
            "enabled": bool(pool is not None and pool.enable_caching),
            "hits": getattr(pool, "num_hits", 0), "queries": getattr(pool, "num_queries", 0),
            "hit_rate": pool.num_hits / pool.num_queries if pool is not None and pool.num_queries else 0.0},
        "requests": {"running": running, "waiting": len(sched.waiting) - preempted, "preempted": preempted,
                     "preemptions_total": sched.num_preemptions},
        "prompt_tokens": engine.stats["prompt_tokens"],
        "generation_tokens": engine.stats["generation_tokens"],
        "steps": engine.stats["steps"],
        "seqs": [_seq(r, now) for r in seqs],
    }
    index = {r.request_id: i for i, r in enumerate(seqs)}
    if m.kind == "paged":
        out["blocks"] = _paged_blocks(m, seqs, index)
        out["blocks_shared"] = out["blocks"]["state"].count(SHARED)
        out["blocks_cached_free"] = out["blocks"]["state"].count(CACHED_FREE)
        out["tokens_stored"] = sum(out["blocks"]["fill"])
        out["tokens_allocated"] = out["blocks_used"] * m.block_size
        for i, r in enumerate(seqs):
            out["seqs"][i]["block_table"] = list(m.block_tables.get(r.request_id, ()))
    elif m.kind == "contiguous":
        out["slots"] = _slots(m, seqs, index)
        out["tokens_allocated"] = out["blocks_used"] * m.max_len  # a slot reserves max_model_len tokens
        for i, r in enumerate(seqs):
            out["seqs"][i]["slot"] = m.slot_of.get(r.request_id)
    else:
        out["tokens_allocated"] = 0
    return out


def _seq(r: Request, now: float) -> dict:
    status = "running" if r.status == RequestStatus.RUNNING else (
        "preempted" if r.status == RequestStatus.PREEMPTED else "waiting")
    return {"id": r.request_id, "group": r.group_id, "status": status, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "computed_tokens": r.num_computed_tokens,
            "cached_tokens": max(r.num_cached_tokens, 0), "max_tokens": r.params.max_tokens,
            "preemptions": r.num_preemptions, "age_s": round(max(now - r.arrival_time, 0.0), 3)}


def _paged_blocks(m, seqs: list[Request], index: dict[str, int]) -> dict:
    """Per block: state, owner (index into seqs: the oldest holder of a shared block; -1 none), ref count, and
    tokens held (a request's last block is partly empty: the only memory paging still wastes)."""
    pool, bs = m.pool, m.block_size
    n = pool.num_blocks
    owner, fill = [-1] * n, [0] * n
    for r in seqs:  # running first, oldest first: a shared prefix block is drawn in its first holder's colour
        for j, b in enumerate(m.block_tables.get(r.request_id, ())):
            if owner[b] < 0:
                owner[b] = index[r.request_id]
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
    return {"state": state, "owner": owner, "refs": refs, "fill": fill}


def _slots(m, seqs: list[Request], index: dict[str, int]) -> list[dict]:
    by_slot = {s: rid for rid, s in m.slot_of.items()}
    out = []
    for s in range(m.num_slots):
        rid = by_slot.get(s)
        r = seqs[index[rid]] if rid in index else None
        out.append({"slot": s, "owner": index[rid] if r is not None else -1,
                    "used_tokens": r.num_computed_tokens if r is not None else 0, "reserved_tokens": m.max_len})
    return out
