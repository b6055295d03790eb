"""Draft-model proposals: a smaller model with the same vocabulary and its own paged KV cache runs k steps ahead."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvinfer.engine.model_runner import ModelRunner
from kvinfer.kv.factory import KVSpec, make_kv
from kvinfer.core.request import Request
from kvinfer.core.sampler import argmax_rows, draw, filter_probs
from kvinfer.core.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class _Shadow:
    """The draft's copy of one request: the real tokens it last saw, then its own proposals."""

    req: Request  # prompt_token_ids: real tokens; output_token_ids: the draft's proposals
    num_real: int


class DraftProposer:
    """Runs the draft model over every proposing request at once, one batched step per proposed token.

    The draft keeps each request's KV in its own block pool between steps: after the target verified a
    proposal, the draft's cache stays valid up to the first token where its guesses and the real tokens part,
    so each round it only computes the tokens it has not seen (usually 1 + the accepted ones) and k - 1 more.
    """

    def __init__(self, loaded, num_blocks: int, block_size: int, sliding_window=None):
        mc = loaded.config
        self.loaded = loaded
        spec = KVSpec("paged", mc.num_layers, num_blocks, block_size, mc.num_kv_heads, 0, mc.head_dim, loaded.dtype,
                      loaded.device, enable_prefix_caching=False, sliding_window=mc.sliding_window)
        self.manager, self.cache = make_kv(spec, alibi=getattr(loaded.model, "alibi", None),
                                           prompt_roles=ModelRunner.prompt_route_for(loaded.model))
        self.runner = ModelRunner(loaded.model, self.cache, self.manager, loaded.device)
        self.runner.computes_prompt_logprobs = False  # its requests are shadows of the target's
        self.shadows: dict[str, _Shadow] = {}

    def release(self, keep: set[str]) -> None:
        """Free the draft cache of requests no longer running (finished, aborted, preempted)."""
        for rid in [rid for rid in self.shadows if rid not in keep]:
            self.manager.free(self.shadows.pop(rid).req)

    def _sync(self, r: Request) -> _Shadow:
        sh = self.shadows.get(r.request_id)
        if sh is None:
            sh = _Shadow(Request(r.request_id, list(r.all_token_ids), r.params), r.num_tokens)
            self.shadows[r.request_id] = sh
            return sh
        d = sh.req
        # Still valid: the real tokens it saw plus its guesses up to the first one the real sequence disagrees on.
        new = r.token_slice(sh.num_real, r.num_tokens)
        agree = 0
        while agree < min(len(new), d.num_output_tokens) and new[agree] == d.output_token_ids[agree]:
            agree += 1
        valid = min(d.num_computed_tokens, sh.num_real + agree)
        d.prompt_token_ids += new
        d.output_token_ids = []
        sh.num_real = r.num_tokens
        d.num_computed_tokens = valid
        self.manager.trim(d, valid)
        return sh

    @torch.inference_mode()
    def propose(self, cands: Sequence[tuple[Request, int]]) -> None:
        """Sets r.spec_token_ids (up to k tokens each) and r.spec_probs ([k, vocab] draft distributions)."""
        active = [(r, k, self._sync(r)) for r, k in cands]
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in active}
        step = 0
        while active:
            sched = SchedulerOutput()
            going = []
            for r, k, sh in active:
                d = sh.req
                n = d.num_tokens - d.num_computed_tokens
                if not self.manager.allocate_slots(d, n):
                    continue  # the draft's pool is full: this request proposes what it has so far
                sched.scheduled.append(ScheduledSeq(d, d.num_computed_tokens, n))
                going.append((r, k, sh))
            if not going:
                break
            ran = self.runner.execute(sched)
            logits, sampled = ran.logits, ran.sampled
            for s in sched.scheduled:
                s.request.num_computed_tokens = s.end
            row_of = {id(s.request): i for i, s in enumerate(sampled)}  # the runner reorders sequences
            active = []
            for r, k, sh in going:
                row = logits[row_of[id(sh.req)]]
                p = r.params
                if p.greedy:
                    tok = argmax_rows(row)[0]
                else:
                    q = filter_probs(row.clone(), p)  # [vocab]
                    tok = draw(q, r.generator)
                    probs[r.request_id].append(q)
                sh.req.output_token_ids.append(tok)
                if step + 1 < k:
                    active.append((r, k, sh))
            step += 1
        for r, _ in cands:
            d = self.shadows[r.request_id].req
            r.spec_token_ids = list(d.output_token_ids)
            ps = probs[r.request_id]
            r.spec_probs = torch.stack(ps) if ps and not r.params.greedy else None
