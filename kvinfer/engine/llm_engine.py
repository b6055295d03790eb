"""LLMEngine, the token-level core: add / abort / retire requests, and each step (the scheduler plans, the runner
executes the plan, the tokens are sampled or taken and appended) with its token-level outputs; plus the offline
`add_request` / `step` that process those outputs inline. Start-up checks and construction: engine/startup.py."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from kvinfer.config import EngineConfig
from kvinfer.engine.outputs import Logprob, RequestOutput
from kvinfer.engine.processing import CoreOutput, EngineRequest, Prompt, SampleDelta
from kvinfer.engine.startup import build, eos_token_ids
from kvinfer.errors import ValidationError
from kvinfer.loaders.model_loader import LoadedModel
from kvinfer.core.request import Request
from kvinfer.core.sampler import Sampler, SampleRow
from kvinfer.sampling_params import SamplingParams
from kvinfer.core.scheduler import MultiStep
from kvinfer.structured import GrammarCompiler, accept_token

log = logging.getLogger("kvinfer")


@dataclass
class _Group:
    """The core's view of a request: its samples and how many tokens of each were already handed out."""

    request_id: str
    reqs: list[Request]
    emitted: list[int]
    prompt_logprobs_sent: bool = False


def _child_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed * 6364136223846793005 + index * 1442695040888963407) % (1 << 63)


class LLMEngine:
    """One engine, one model, a KV budget fixed at construction."""

    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None):
        self.config = config
        parts = build(config, loaded)  # engine/startup.py: the checks, then every part
        for f in dataclasses.fields(parts):  # engine.kv_manager, engine.scheduler, engine.runner, ...
            setattr(self, f.name, getattr(parts, f.name))
        self.sampler = Sampler()
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self.groups: dict[str, _Group] = {}
        self._pending_forks: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self.stats = dict(steps=0, prompt_tokens=0, generation_tokens=0, peak_blocks=0, util_stored=0, util_capacity=0,
                          spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """Most new tokens a request with this prompt could ever get (context window and KV capacity)."""
        return self.processor.max_new_tokens(num_prompt_tokens)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: Optional[str], prompt: Prompt, params: Optional[SamplingParams] = None) -> str:
        """Check and queue a request; raises ValidationError / RequestTooLargeError if it can never run."""
        req = self.processor.process(request_id, prompt, params)
        request_id = self.add_processed(req)
        self.output_processor.add(request_id, req)  # step() turns this engine's outputs into text
        return request_id

    def add_processed(self, req: EngineRequest) -> str:
        """Queue a request the input processor has already tokenized, completed and checked: the core's entry.

        Its outputs are processed by whoever added it: `add_request` + `step` here, or the AsyncLLMEngine's
        streams (`step_core`, then `stop_sample` / `retire` commands)."""
        params, ids = req.params, req.prompt_token_ids
        request_id = req.request_id if req.request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValidationError("request_id", request_id, "is already in use")
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        grammar = self.grammar_matcher(params.structured_output) if params.structured_output is not None else None
        reqs = []
        for i in range(params.n):
            r = Request(f"{request_id}#{i}" if params.n > 1 else request_id, ids, params, group_id=request_id, index=i,
                        bad_words_ids=req.bad_words_ids)
            r.generator = torch.Generator().manual_seed(_child_seed(base_seed, i))
            if grammar is not None:
                r.grammar = grammar if i == 0 else grammar.deep_copy()
            reqs.append(r)
        share = params.n > 1 and self.kv_manager.can_fork
        for i, r in enumerate(reqs):
            if share and i > 0:
                r.fork_parent = reqs[0]
            else:
                self.scheduler.add_request(r)
        if share:
            self._pending_forks[reqs[0].request_id] = reqs[1:]
        self.groups[request_id] = _Group(request_id, reqs, [0] * len(reqs))
        return request_id

    def grammar_matcher(self, spec):
        """A matcher for a structured-output spec (compiled grammars are cached); ValidationError if unusable."""
        if self.sampler.grammars is None:
            if self.tokenizer is None:
                raise ValidationError(spec.param, spec.kind, "structured outputs need a model with a tokenizer")
            # Built once (about a second): llguidance indexes the whole vocabulary.
            self.sampler.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                                    self._eos_ids())
        return self.sampler.grammars.matcher(spec)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (the caller's or the server's act): whatever still runs of it finishes as "abort" (its
        KV freed), its outputs are dropped, and it is forgotten; False if it is unknown."""
        self.output_processor.abort(request_id)
        return self._forget(request_id, "abort")

    def retire(self, request_id: str) -> bool:
        """Forget a request that finished normally, once its output processing is done with it. The core never
        does so by itself: a stop string found after the core finished the request (by length or a stop token)
        still has its group here to correct the counts against (`stop_sample`). Its KV blocks went already, at
        `scheduler.finish`; False if it is unknown."""
        return self._forget(request_id, "stop")

    def _forget(self, request_id: str, reason: str) -> bool:
        """Drop a request's group, finishing with `reason` any sample still running or waiting (none, for a
        retired request: the reason only keeps a broken caller from leaking KV)."""
        g = self.groups.pop(request_id, None)
        if g is None:
            return False
        for r in g.reqs:
            self._pending_forks.pop(r.request_id, None)
            if not r.is_finished:
                self.scheduler.finish(r, reason)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests not yet retired (offline: `step` retires a request with its final output)."""
        return bool(self.groups)

    def has_work(self) -> bool:
        """Something to schedule: retired or not, a request whose samples all finished needs no step."""
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step, then its output processing inline (offline callers, CLI, bench, lab)."""
        outs, stops, _ = self.output_processor.process(self.step_core())
        for request_id, index, kept in stops:
            self.stop_sample(request_id, index, kept)
        for o in outs:
            if o.finished:
                self.retire(o.request_id)
        return outs

    def stop_sample(self, request_id: str, index: int, kept: int) -> None:
        """A stop string ended sample `index` after `kept` tokens: finish it if it still runs, and uncount every
        token made after (all of them, including those whose outputs are still on their way)."""
        g = self.groups.get(request_id)
        if g is None:
            return  # aborted meanwhile: nothing left to count
        r = g.reqs[index]
        if not r.is_finished:
            self.scheduler.finish(r, "stop")
            if self.speculator is not None:
                self.speculator.release(self.scheduler.running)
        dropped = r.num_output_tokens - kept
        if dropped > 0:  # truncated, so a repeated command drops nothing
            self.stats["generation_tokens"] -= dropped
            del r.output_token_ids[kept:]
            del r.logprobs[kept:]
            g.emitted[index] = min(g.emitted[index], kept)

    def step_core(self) -> list[CoreOutput]:
        """Schedule, run the model, sample; token-level outputs of the requests that got tokens."""
        outs = self._step_core()
        if self.kv_tiers is not None:  # the blocks freed by this step may be next to go: copied off this thread
            self.kv_manager.copy_ahead()
        return outs

    def _step_core(self) -> list[CoreOutput]:
        """One step, one path: the scheduler plans (a planned step, or several fused decode steps), the runner
        executes the plan, and its tokens are appended here."""
        t0, generated = time.perf_counter(), self.stats["generation_tokens"]
        spec = self.speculator is not None
        if spec:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule(self._multi_step(spec))
        touched: dict[str, None] = {}
        if sched.decode_steps:
            self._append_decode_steps(sched, self.runner.execute(sched), touched)
            if self.kv_tiers is not None:  # the blocks just computed go to the persistent tiers
                self.kv_manager.after_step()
        else:
            self.stats["steps"] += 1
            if sched.scheduled:
                self._run_planned(sched, touched)
        if spec and sched.scheduled:
            self._after_speculator_step(t0, generated, any(s.spec_token_ids for s in sched.scheduled),
                                        len(sched.scheduled),
                                        all(s.num_new_tokens - len(s.spec_token_ids) == 1 for s in sched.scheduled))
        return self._outputs(touched)

    def _multi_step(self, spec: bool) -> Optional[MultiStep]:
        """The fused decode steps this engine offers the scheduler for the next step: up to --num-scheduler-steps
        where the runner has a fused call (the same bits, less Python); with speculation on, one step in which no
        request proposed (proposals may resume the next); without it a lone step is planned. None while an n > 1
        request's siblings wait to be forked from its first sample."""
        if self._pending_forks or self.runner.multi_step_decoder() is None:
            return None
        if spec:
            return MultiStep(1, 1, not self.runner.prompt_route)
        return MultiStep(self.config.num_scheduler_steps, 2, not self.runner.prompt_route)

    def _run_planned(self, sched, touched) -> None:
        t_run = time.perf_counter()
        ran = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        if self.kv_tiers is not None:  # what recomputing costs, against which a slow tier is passed by
            self.kv_tiers.note_compute(time.perf_counter() - t_run, sched.num_batched_tokens)
            self.kv_manager.after_step()
        m = self.kv_manager
        if m.keeps_kv:
            used = m.num_units - m.num_free_units
            self.stats["peak_blocks"] = max(self.stats["peak_blocks"], used)
            # KV utilisation: tokens held in the cache over the capacity of the units (blocks, slots) allocated.
            self.stats["util_stored"] += sum(r.num_computed_tokens for r in self.scheduler.running)
            self.stats["util_capacity"] += used * m.unit_tokens
        for s in sched.scheduled:
            if s.start < s.request.num_prompt_tokens:
                self.stats["prompt_tokens"] += min(s.end, s.request.num_prompt_tokens) - s.start
        if ran.sampled:
            forked = self._fork_siblings(ran.sampled)  # a stage of its own, before any sampling
            self._sample_and_update(ran.logits, ran.sampled, forked, touched)

    def _after_speculator_step(self, t0: float, generated: int, speculated: bool, num_seqs: int,
                               decode_only: bool = True) -> None:
        """Speculation's bookkeeping after a step that began at t0 with `generated` tokens emitted so far: the
        rate of a decode-only step, requests no longer running released, the acceptance counters."""
        if decode_only:
            self.speculator.rates.observe(time.perf_counter() - t0, self.stats["generation_tokens"] - generated,
                                          speculated, num_seqs)
        self.speculator.release(self.scheduler.running)
        self.stats.update(self.speculator.metrics())

    def _outputs(self, touched) -> list[CoreOutput]:
        """The core outputs of the groups that got tokens this step (those still known)."""
        return [self._core_output(self.groups[gid]) for gid in touched if gid in self.groups]

    def _append_decode_steps(self, sched, ran, touched) -> None:
        """A fused call's tokens, step by step through _append_token (so stop tokens, max_tokens and outputs are as
        one step at a time), each with its logprobs from the same logits; then the scheduler settles the KV."""
        from kvinfer.core.sampler import row_logprob

        steps = len(ran.tokens)
        self.stats["steps"] += steps
        now = time.perf_counter()
        reqs = [s.request for s in ran.sampled]
        for st in range(steps):
            for b, r in enumerate(reqs):
                if r.is_finished:
                    continue
                tok = ran.tokens[st][b]
                k = r.params.logprobs
                self._append_token(r, tok, row_logprob(ran.logits[st, b], tok, k) if k is not None else None, now)
                touched[r.group_id] = None
        self.scheduler.update_after_step(sched)
        m = self.kv_manager
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], m.num_units - m.num_free_units)

    def _fork_siblings(self, sampled) -> dict[str, list[Request]]:
        """n>1: once a group's first sample has its prompt computed, its siblings share that KV and join the batch.

        Returns the siblings by first sample's id; they sample from the same logits row this step."""
        forked = {}
        for s in sampled:
            r = s.request
            children = self._pending_forks.pop(r.request_id, None) if not s.spec_token_ids else None
            if not children:
                continue
            for child in children:
                # The sibling shares the prompt's blocks (copy-on-write on the partial last one).
                self.kv_manager.fork(r, child)
                child.num_computed_tokens = r.num_computed_tokens
                child.num_cached_tokens = r.num_cached_tokens
                child.fork_parent = None
                self.scheduler.add_running(child)
            forked[r.request_id] = children
        return forked

    def _sample_and_update(self, logits, sampled, forked: dict[str, list[Request]], touched) -> None:
        rows, reqs, row_src = [], [], []
        verify, i = [], 0  # i: the first logits row of each sampled seq
        for s in sampled:
            r = s.request
            if s.spec_token_ids:
                verify.append((s, i))
                i += 1 + len(s.spec_token_ids)
                continue
            family = [r] + forked.get(r.request_id, [])
            for m in family:
                rows.append(self._sample_row(m))
                reqs.append(m)
                row_src.append(i)
            i += 1
        now = time.perf_counter()
        if reqs:
            plain = logits if row_src == list(range(logits.shape[0])) else logits[torch.tensor(row_src)]
            result = self.sampler.sample(plain, rows)
            for r, tok, lp in zip(reqs, result.token_ids, result.logprobs):
                self._append_token(r, tok, lp, now)
                touched[r.group_id] = None
        for s, i in verify:
            self._verify(s, logits[i:i + 1 + len(s.spec_token_ids)], now)
            touched[s.request.group_id] = None

    def _verify(self, s, logits, now: float) -> None:
        """Emit the accepted proposals and one token of the target's own; drop the rejected ones' KV."""
        from kvinfer.spec.rejection import verify

        r, draft = s.request, s.spec_token_ids
        probs = r.spec_probs[:len(draft)] if r.spec_probs is not None else None
        r.spec_probs = None
        base = r.output_token_ids
        rows = [self._sample_row(r, base + draft[:j]) for j in range(len(draft) + 1)]
        result = verify(self.sampler, logits, rows, draft, probs)
        self.speculator.record(r, len(draft), len(result.token_ids) - 1, len(self.scheduler.running))
        for tok, lp in zip(result.token_ids, result.logprobs):
            self._append_token(r, tok, lp, now)
            if r.is_finished:
                return
        self.scheduler.settle(r)

    def _sample_row(self, r: Request, output_ids: Optional[list[int]] = None) -> SampleRow:
        """output_ids: the outputs as if proposed tokens were accepted (verification rows)."""
        p = r.params
        out = r.output_token_ids if output_ids is None else output_ids
        banned = ()
        # Under a grammar the ban yields when the grammar allows nothing else (the sampler checks).
        if len(out) < p.min_tokens:
            banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else self._eos_ids())
        if r.bad_words_ids:  # a word's last token, where the output ends with the rest of it
            banned += tuple(w[-1] for w in r.bad_words_ids
                            if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]))
        return SampleRow(p, r.prompt_token_ids, out, r.generator, banned, r.grammar)

    def _eos_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.tokenizer, self.model_config)

    def _append_token(self, r: Request, tok: int, lp, now: float) -> None:
        r.output_token_ids.append(tok)
        if r.grammar is not None and not accept_token(r.grammar, tok):
            log.warning("request %s: token %d rejected by its grammar: %s", r.request_id, tok, r.grammar.get_error())
        self.stats["generation_tokens"] += 1
        if r.first_token_time is None:
            r.first_token_time = now
        r.last_token_time = now
        if lp is not None:
            r.logprobs.append(Logprob(tok, lp[0], lp[1]))
            r.cumulative_logprob += lp[0]
        p = r.params
        reason, stop_reason = None, None
        is_stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self._eos_ids())
        # A grammar only lets a banned stop token through when the output can end nowhere else.
        if is_stop_token and (r.num_output_tokens > p.min_tokens - 1 or r.grammar is not None):
            reason, stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
        elif r.num_output_tokens >= p.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            r.stop_reason = stop_reason
            self.scheduler.finish(r, reason)

    @staticmethod
    def _core_output(g: _Group) -> CoreOutput:
        """The tokens each sample got since the last output (copies: the loop reads them while this goes on)."""
        deltas = []
        for i, r in enumerate(g.reqs):
            start, g.emitted[i] = g.emitted[i], r.num_output_tokens
            lps = r.logprobs[start:] if r.params.logprobs is not None else None
            deltas.append(SampleDelta(i, r.output_token_ids[start:], lps, r.finish_reason if r.is_finished else None,
                                      r.stop_reason))
        first = g.reqs[0]
        prompt_lps = None
        if first.params.prompt_logprobs is not None and not g.prompt_logprobs_sent and not first.needs_prompt_logprobs:
            g.prompt_logprobs_sent = True  # once, with the output of the step that completed them
            ids = first.prompt_token_ids  # the first prompt token has no logprob
            prompt_lps = [None] + [Logprob(ids[i + 1], lp, top, rank)
                                   for i, (lp, top, rank) in enumerate(first.prompt_logprobs)]
        embedding, first.embedding = first.embedding, None  # once
        return CoreOutput(g.request_id, deltas, max(first.num_cached_tokens, 0), first.arrival_time,
                          first.first_token_time, first.last_token_time, prompt_lps, embedding)

    # ---- introspection -------------------------------------------------------------------------
    def kv_usage(self) -> dict:
        """Blocks used/total and tokens stored vs the capacity of the blocks in use."""
        m = self.kv_manager
        used = m.num_units - m.num_free_units
        stored = sum(r.num_computed_tokens for r in self.scheduler.running)
        return dict(blocks_used=used, blocks_total=m.num_units, tokens_stored=stored,
                    tokens_capacity=used * m.unit_tokens, bytes_in_use=used * m.unit_tokens * self.kv_bytes_per_token)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """End the tensor-parallel workers (a no-op without them), write out the KV tiers' queue; the engine cannot
        step afterwards."""
        if getattr(self, "kv_tiers", None) is not None:
            self.kv_tiers.close()
        if self.tp is not None:
            self.tp.shutdown()
