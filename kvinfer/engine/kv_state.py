"""`kv_state(engine)`: a read-only, JSON-ready picture of the KV cache and the requests that hold it."""
from __future__ import annotations

import time

from kvinfer.kv.manager import CACHED_FREE, FREE, OWNED, SHARED  # noqa: F401  (the page's block states)
from kvinfer.core.request import Request, RequestStatus


def kv_state(engine) -> dict:
    """Everything the live page draws, read from an LLMEngine that is not stepping.

    Call it on the engine's own thread (`AsyncLLMEngine.call`): block tables and ref counts change during a
    step, and a snapshot taken halfway would show blocks owned by nobody or by two requests at once.
    Prompt text is never included: only the server knows which requests may show theirs.
    """
    m, sched = engine.kv_manager, engine.scheduler
    seqs: list[Request] = list(sched.running) + list(sched.waiting)
    hits, queries = m.prefix_cache_stats()
    running = len(sched.running)
    preempted = sum(r.status == RequestStatus.PREEMPTED for r in sched.waiting)
    logical = sum(r.num_computed_tokens for r in sched.running)  # a shared prefix counts once per request
    now = time.perf_counter()
    out = {
        "time": time.time(),
        "backend": m.kind,
        "block_size": None,
        "num_blocks": m.num_units,
        "blocks_used": m.num_units - m.num_free_units,
        "bytes_per_token": engine.kv_bytes_per_token,
        "capacity_tokens": m.token_capacity,
        "kv_bytes": engine.kv_cache.nbytes,
        "max_model_len": engine.max_model_len,
        "tokens_logical": logical,
        "tokens_stored": logical,  # distinct tokens held; fewer for paged, where shared blocks hold them once
        "prefix_cache": {"enabled": m.prefix_caching, "hits": hits,
                         "queries": queries, "hit_rate": hits / queries if queries else 0.0},
        "requests": {"running": running, "waiting": len(sched.waiting) - preempted, "preempted": preempted,
                     "preemptions_total": sched.num_preemptions},
        "prompt_tokens": engine.stats["prompt_tokens"],
        "generation_tokens": engine.stats["generation_tokens"],
        "steps": engine.stats["steps"],
        "seqs": [_seq(r, now) for r in seqs],
        # The tiers below the pool (RAM, disk, Redis): what each holds and its counters, as /metrics has them.
        "tiers": engine.kv_tiers.snapshot() if getattr(engine, "kv_tiers", None) is not None else [],
    }
    units, held = m.snapshot(seqs)  # the backend's own map: blocks (paged), slots (contiguous)
    out.update(units)
    for fields, held_by in zip(out["seqs"], held):
        fields.update(held_by)
    return out

def _seq(r: Request, now: float) -> dict:
    status = "running" if r.status == RequestStatus.RUNNING else (
        "preempted" if r.status == RequestStatus.PREEMPTED else "waiting")
    return {"id": r.request_id, "group": r.group_id, "status": status, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "computed_tokens": r.num_computed_tokens,
            "cached_tokens": max(r.num_cached_tokens, 0), "max_tokens": r.params.max_tokens,
            "preemptions": r.num_preemptions, "age_s": round(max(now - r.arrival_time, 0.0), 3)}

