"""Scheduler: continuous batching under a token budget; plain data out, no torch."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvinfer.errors import RequestTooLargeError, ValidationError
from kvinfer.kv.interface import KVManager
from kvinfer.core.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    # Proposed tokens verified this step: the last len(spec_token_ids) of the num_new_tokens (after the
    # sequence's one pending token), not yet part of the request.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step's plan. decode_steps 0: a planned step (prefill chunks, decodes, verifications) the runner lays out
    row by row. decode_steps n >= 1: n decode steps of every scheduled request in one fused call (vLLM's multi-step
    scheduling), each seq one token per step, with KV slots allocated for all n; the call may stop sooner (a stop
    token), and `update_after_step` gives back the slots it did not reach."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    decode_steps: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class MultiStep:
    """What the engine's runner can take in one fused call, offered to `Scheduler.schedule` each step."""

    most: int  # decode steps per call at most
    least: int = 2  # fewer than this many and the step is planned instead
    # Whether a request's last prompt token may be a step of the call (not where prompt rows take a route of their
    # own: the fused call has none).
    prompt_tail: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


class Scheduler:
    """Every request has num_computed_tokens and num_tokens; each step hands out a token budget.

    Running requests are served first, oldest first; if the KV manager runs out, the most recently
    admitted running request is preempted (its cache freed, recomputed later) and goes to the front
    of the waiting queue so it resumes before newer requests.

    A waiting request is admitted only if one block per running sequence stays free after its prompt: each of
    them crosses a block boundary within the next block_size tokens, and without that headroom the newcomer
    (the newest, so the first victim) is preempted soon after its prefill and computes it again. A request
    alone is admitted whenever it fits, so nothing waits forever.
    """

    def __init__(self, cfg: SchedulerConfig, kv_manager: KVManager):
        self.cfg = cfg
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: Optional[int]) -> None:
        """Reject at once a request that can never run, so the engine keeps serving the others.

        Reads only what is fixed at start-up, so the input processor calls it on the caller's thread; add_request
        takes requests already checked here."""
        total = num_prompt_tokens + (max_tokens or 0)
        if num_prompt_tokens == 0:
            raise ValidationError("prompt", "", "is empty; give at least one token")
        if num_prompt_tokens >= self.cfg.max_model_len:
            raise RequestTooLargeError(
                f"the prompt has {num_prompt_tokens} tokens; the context window (max_model_len) is "
                f"{self.cfg.max_model_len}, leaving no room to generate", "prompt")
        if total > self.cfg.max_model_len:
            raise RequestTooLargeError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"the context window (max_model_len={self.cfg.max_model_len})", "max_tokens")
        if not self.kv.can_ever_fit(total):
            raise RequestTooLargeError(
                f"prompt + max_tokens = {total} tokens needs more KV cache than exists "
                f"({self.kv.token_capacity} tokens); raise --kv-cache-memory or lower max_tokens", "max_tokens")

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def add_running(self, req: Request) -> None:
        """A forked sibling: its cache is already shared from its parent."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.requests[req.request_id] = req

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, multi: Optional[MultiStep] = None) -> SchedulerOutput:
        """The next step's plan: several fused decode steps where `multi` allows them and the pool holds their
        slots, else a planned step under the token budget."""
        n = self._decode_steps(multi) if multi is not None else 0
        if n:
            out = self._schedule_decode_steps(n)
            if out is not None:
                return out
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            need = req.num_tokens - req.num_computed_tokens
            spec = req.spec_token_ids[:budget - 1] if need == 1 else []
            req.spec_token_ids = []
            n = min(need, budget) + len(spec)
            if n <= 0:
                i += 1
                continue
            if self._must_wait_whole(n, need):
                break
            while not self.kv.allocate_slots(req, n):
                if spec:  # out of blocks: drop the proposals before preempting anyone
                    n, spec = need, []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing else can fit either
            out.scheduled.append(ScheduledSeq(req, req.num_computed_tokens, n, spec))
            scheduled_ids.add(req.request_id)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            # A prompt's logprobs (or pooled embedding) need its every position computed: no prefix-cache hit.
            computed, num_cached = ([], 0) if req.needs_prompt_logprobs or req.params.pooling is not None \
                else self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_cached, budget)
            if self._must_wait_whole(n, req.num_tokens - num_cached):
                break
            if not self.kv.allocate_slots(req, n, computed, reserve=len(self.running)):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledSeq(req, num_cached, n))
            budget -= n

        out.block_copies = self.kv.take_copies()
        return out

    def _decode_steps(self, multi: MultiStep) -> int:
        """How many decode steps, up to multi.most, the next call may make fused (0: none). Only while every running
        request decodes with nothing for the sampler to change but temperature and top-k/top-p/min-p (no penalties,
        bias, grammar, banned stop tokens, proposed tokens) and no request waits for admission, so none waits longer
        than one call; no request may pass its max_tokens or the context window inside the call."""
        n = multi.most
        if n < 1 or self.waiting or not self.running:
            return 0
        for r in self.running:
            p = r.params
            if (r.num_tokens - r.num_computed_tokens != 1 or not p.plain or r.grammar is not None
                    or r.num_output_tokens < p.min_tokens or r.spec_token_ids
                    or (not multi.prompt_tail and r.num_computed_tokens < r.num_prompt_tokens)):
                return 0
            n = min(n, p.max_tokens - r.num_output_tokens, self.cfg.max_model_len - r.num_tokens)
        return n if n >= max(multi.least, 1) else 0

    def _schedule_decode_steps(self, n: int) -> Optional[SchedulerOutput]:
        """Slots for n more positions of every running request, or None (nothing changed) if the pool cannot hold
        them all: the caller plans a step instead, preempting as it must."""
        reqs = list(self.running)
        for i, r in enumerate(reqs):
            if not self.kv.allocate_slots(r, n):
                for q in reqs[:i]:
                    self.kv.trim(q, q.num_computed_tokens)
                return None
        # block_copies: a fork sibling's shared last block, copied before the call writes into it
        return SchedulerOutput([ScheduledSeq(r, r.num_computed_tokens, 1) for r in reqs],
                               block_copies=self.kv.take_copies(), decode_steps=n)

    def _must_wait_whole(self, n: int, need: int) -> bool:
        """Without chunked prefill a sequence runs whole, once a step's budget holds it; one longer than the
        whole budget (a long prompt, or prompt + outputs recomputed after preemption) would wait forever and
        block the queue behind it, so it goes in budget-sized pieces."""
        return not self.cfg.enable_chunked_prefill and n < need <= self.cfg.max_num_batched_tokens

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids, req.spec_probs = [], None
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """A planned step: its positions are computed (called before its tokens are sampled). Fused decode steps:
        called once their tokens are appended, when each request has computed all its tokens but the last; the
        slots of the steps the call did not reach go back, request by request in the plan's order."""
        if not out.decode_steps:
            for s in out.scheduled:
                s.request.num_computed_tokens = s.end
            return
        for s in out.scheduled:
            r = s.request
            if r.is_finished:  # its KV went back when it finished
                r.num_computed_tokens = r.num_tokens - 1
            else:
                self.settle(r)

    def settle(self, req: Request) -> None:
        """After a step appended a running request's tokens: what it has computed is every token but its last; the
        slots allocated past that (rejected proposals, decode steps a fused call did not reach) go back."""
        self.rollback(req, req.num_tokens - 1)

    def rollback(self, req: Request, num_computed_tokens: int) -> None:
        """Keep the KV of the first num_computed_tokens tokens: the slots past them are dropped (the block table
        trimmed) and recomputed as needed."""
        req.num_computed_tokens = num_computed_tokens
        self.kv.trim(req, num_computed_tokens)

    # ---- finishing -------------------------------------------------------------------------
    def finish(self, req: Request, reason: Optional[str] = None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        elif req.request_id in self.requests:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = RequestStatus.FINISHED
        if reason is not None:
            req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
