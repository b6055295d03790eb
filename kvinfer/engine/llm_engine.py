"""LLMEngine: add_request / step / abort over the scheduler, KV manager, model runner and sampler."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from kvinfer.config import EngineConfig, kv_scale_bytes
from kvinfer.engine.model_runner import ModelRunner
from kvinfer.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvinfer.errors import RequestTooLargeError, ValidationError
from kvinfer.kv.cache import ContiguousCache, NoCache, PagedCache
from kvinfer.kv.manager import NullManager, PagedKVManager, SlotManager
from kvinfer.loaders.model_loader import LoadedModel, load_model
from kvinfer.request import Request, RequestStatus
from kvinfer.sampler import Sampler, SampleRow
from kvinfer.sampling_params import SamplingParams
from kvinfer.scheduler import Scheduler, SchedulerConfig
from kvinfer.structured import GrammarCompiler, accept_token
from kvinfer.utils import format_bytes

log = logging.getLogger("kvinfer")

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB


@dataclass
class _SampleState:
    """Output-side state of one sample: detokenizer, text, stop-string hold-back."""

    req: Request
    detok: object = None
    text: str = ""
    emitted: int = 0  # characters of `text` already reported
    emitted_tokens: int = 0


@dataclass
class _Group:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    finished_reported: bool = False


def _child_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed * 6364136223846793005 + index * 1442695040888963407) % (1 << 63)


class LLMEngine:
    """One engine, one model, a KV budget fixed at construction."""

    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(config)
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings and mc.position == "learned":
            raise ValidationError("max_model_len", self.max_model_len,
                                  f"must be <= {mc.max_position_embeddings} for learned positions")
        dtype, device = self.loaded.dtype, self.loaded.device
        kv_dtype = config.kv_cache_dtype if config.kv_cache != "none" else "auto"  # `none` keeps no K/V
        if kv_dtype != "auto":  # 8-bit values and a float32 scale per token, kv head and K or V
            self.kv_bytes_per_token = mc.kv_bytes_per_token(1, kv_scale_bytes(mc.head_dim))
        else:
            self.kv_bytes_per_token = mc.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        self.kv_dtype = kv_dtype if kv_dtype != "auto" else str(dtype).replace("torch.", "")
        budget = self._kv_budget()
        kind = config.kv_cache
        if kind == "paged":
            bs = config.block_size
            num_blocks = budget // (self.kv_bytes_per_token * bs)
            if num_blocks < 1:
                raise ValidationError("kv_cache_memory", budget,
                                      f"too small for one block of {bs} tokens ({self.kv_bytes_per_token * bs} bytes)")
            self.kv_manager = PagedKVManager(num_blocks, bs, config.enable_prefix_caching)
            self.kv_cache = PagedCache(mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, dtype, device,
                                       kv_dtype)
        elif kind == "contiguous":
            per_slot = self.kv_bytes_per_token * self.max_model_len
            num_slots = min(budget // per_slot, config.max_num_seqs)
            if num_slots < 1:
                raise ValidationError("kv_cache_memory", budget,
                                      f"too small for one contiguous slot of max_model_len={self.max_model_len} "
                                      f"tokens ({format_bytes(per_slot)})")
            self.kv_manager = SlotManager(num_slots, self.max_model_len)
            self.kv_cache = ContiguousCache(mc.num_layers, num_slots, mc.num_kv_heads, self.max_model_len,
                                            mc.head_dim, dtype, device, kv_dtype)
        else:
            self.kv_manager = NullManager()
            self.kv_cache = NoCache(mc.num_layers, device, dtype)
        if mc.position == "alibi":
            self.kv_cache.alibi = self.loaded.model.alibi
        self.kv_cache.sliding_window = mc.sliding_window
        cap = self.kv_manager.token_capacity
        log.info("KV cache: %s, %s, %s (%s per token, %d %s, token capacity %d)", kind, self.kv_dtype,
                 format_bytes(self.kv_cache.nbytes), format_bytes(self.kv_bytes_per_token),
                 self.kv_manager.num_total_blocks,
                 f"blocks of {config.block_size}" if kind == "paged" else "slots", cap)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.enable_chunked_prefill), self.kv_manager)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, self.kv_manager, device)
        self.sampler = Sampler()
        self._rng = torch.Generator().manual_seed(config.seed)
        self.groups: dict[str, _Group] = {}
        self._pending_forks: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self.stats = dict(steps=0, prompt_tokens=0, generation_tokens=0, peak_blocks=0, util_stored=0, util_capacity=0)

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory:
            return self.config.kv_cache_memory
        if self.config.kv_cache_fraction:
            import psutil

            return int(psutil.virtual_memory().available * self.config.kv_cache_fraction)
        return DEFAULT_KV_CACHE_MEMORY

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Union[str, Sequence[int]]) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError("prompt", prompt[:40], "this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValidationError("prompt", t, f"token ids must be integers in [0, {vocab})")
        return None, ids

    def add_request(self, request_id: Optional[str], prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None) -> str:
        """Queue a request; raises ValidationError / RequestTooLargeError if it can never run."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValidationError("request_id", request_id, "is already in use")
        text, ids = self.tokenize_prompt(prompt)
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError("stop_token_ids", bad, f"token ids must be in [0, {vocab})")
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": max(1, self.max_model_len - len(ids))})
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        grammar = self.grammar_matcher(params.structured_output) if params.structured_output is not None else None
        reqs = []
        for i in range(params.n):
            r = Request(f"{request_id}#{i}" if params.n > 1 else request_id, ids, params, group_id=request_id, index=i)
            r.generator = torch.Generator().manual_seed(_child_seed(base_seed, i))
            if grammar is not None:
                r.grammar = grammar if i == 0 else grammar.deep_copy()
            reqs.append(r)
        self.scheduler.check_fits(reqs[0])
        share = params.n > 1 and self.kv_manager.kind == "paged"
        for i, r in enumerate(reqs):
            if share and i > 0:
                r.fork_parent = reqs[0]
            else:
                self.scheduler.add_request(r)
        if share:
            self._pending_forks[reqs[0].request_id] = reqs[1:]
        self.groups[request_id] = _Group(request_id, text, ids, [self._new_state(r) for r in reqs])
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

    def _new_state(self, r: Request) -> _SampleState:
        st = _SampleState(r)
        if self.tokenizer is not None:
            from kvinfer.detokenizer import IncrementalDetokenizer

            st.detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, r.params.skip_special_tokens)
        return st

    def abort(self, request_id: str) -> bool:
        g = self.groups.pop(request_id, None)
        if g is None:
            return False
        for st in g.samples:
            r = st.req
            self._pending_forks.pop(r.request_id, None)
            if not r.is_finished:
                self.scheduler.finish(r, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats["steps"] += 1
        touched: dict[str, None] = {}
        if sched.scheduled:
            logits, sampled = self.runner.execute(sched)
            self.scheduler.update_after_step(sched)
            if self.kv_manager.kind == "paged":
                used = self.kv_manager.pool.num_used_blocks
                self.stats["peak_blocks"] = max(self.stats["peak_blocks"], used)
                # KV utilisation: tokens held in the cache over the capacity of the blocks allocated.
                self.stats["util_stored"] += sum(r.num_computed_tokens for r in self.scheduler.running)
                self.stats["util_capacity"] += used * self.kv_manager.block_size
            for s in sched.scheduled:
                if s.start < s.request.num_prompt_tokens:
                    self.stats["prompt_tokens"] += min(s.end, s.request.num_prompt_tokens) - s.start
            if sampled:
                self._sample_and_update(logits, sampled, touched)
        outs = []
        for gid in touched:
            g = self.groups.get(gid)
            if g is not None:
                outs.append(self._make_output(g))
        return outs

    def _sample_and_update(self, logits, sampled, touched) -> None:
        rows, reqs, row_src = [], [], []
        for i, s in enumerate(sampled):
            r = s.request
            family = [r] + self._pending_forks.pop(r.request_id, [])
            if len(family) > 1:
                for child in family[1:]:
                    # The sibling shares the prompt's blocks (copy-on-write on the partial last one).
                    self.kv_manager.fork(r, child)
                    child.num_computed_tokens = r.num_computed_tokens
                    child.num_cached_tokens = r.num_cached_tokens
                    child.fork_parent = None
                    self.scheduler.add_running(child)
            for m in family:
                rows.append(self._sample_row(m))
                reqs.append(m)
                row_src.append(i)
        if len(row_src) != len(sampled):
            logits = logits[torch.tensor(row_src)]
        result = self.sampler.sample(logits, rows)
        now = time.perf_counter()
        for r, tok, lp in zip(reqs, result.token_ids, result.logprobs):
            self._append_token(r, tok, lp, now)
            touched[r.group_id] = None

    def _sample_row(self, r: Request) -> SampleRow:
        p = r.params
        banned = ()
        # A grammar decides alone when the output may end: banning EOS could leave it no token at all.
        if r.num_output_tokens < p.min_tokens and r.grammar is None:
            banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else self._eos_ids())
        return SampleRow(p, r.prompt_token_ids, r.output_token_ids, r.generator, banned, r.grammar)

    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.model_config.eos_token_ids)

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
        g = self.groups[r.group_id]
        st = g.samples[r.index]
        p = r.params
        reason, stop_reason = None, None
        is_stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self._eos_ids())
        if is_stop_token and r.num_output_tokens > p.min_tokens - 1:
            reason, stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
        if st.detok is not None and reason is None:
            st.text += st.detok.add([tok])
            if p.stop and r.num_output_tokens >= p.min_tokens:
                hit = self._find_stop(st, p)
                if hit is not None:
                    reason, stop_reason = "stop", hit
        if reason is None:
            if r.num_output_tokens >= p.max_tokens or r.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            if st.detok is not None and not isinstance(stop_reason, str):
                st.text += st.detok.flush()
            r.stop_reason = stop_reason
            self.scheduler.finish(r, reason)

    def _find_stop(self, st: _SampleState, p: SamplingParams) -> Optional[str]:
        window_start = st.emitted  # held-back text starts here, so a new stop string cannot start earlier
        best = None
        for s in p.stop:
            i = st.text.find(s, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        st.text = st.text[: i + len(s)] if p.include_stop_str_in_output else st.text[:i]
        return s

    def _make_output(self, g: _Group) -> RequestOutput:
        outs = []
        for st in g.samples:
            r = st.req
            finished = r.is_finished
            hold = 0
            if not finished and r.params.stop:
                hold = max(len(s) for s in r.params.stop) - 1  # might still become a stop string
            safe = max(st.emitted, len(st.text) - hold)
            delta = st.text[st.emitted:safe]
            st.emitted = safe
            dtoks = r.output_token_ids[st.emitted_tokens:]
            st.emitted_tokens = r.num_output_tokens
            outs.append(CompletionOutput(
                index=r.index, text=st.text[:safe], token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason if finished else None, stop_reason=r.stop_reason,
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
                delta_text=delta, delta_token_ids=dtoks))
        finished = all(st.req.is_finished for st in g.samples)
        first = g.samples[0].req
        m = RequestMetrics(first.arrival_time, first.first_token_time, first.last_token_time, first.num_output_tokens)
        out = RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, finished,
                            max(first.num_cached_tokens, 0), m)
        if finished:
            self.groups.pop(g.request_id, None)
        return out

    # ---- introspection -------------------------------------------------------------------------
    def kv_usage(self) -> dict:
        """Blocks used/total and tokens stored vs the capacity of the blocks in use."""
        m = self.kv_manager
        used = m.num_total_blocks - m.num_free_blocks
        stored = sum(r.num_computed_tokens for r in self.scheduler.running)
        cap = used * self.config.block_size if m.kind == "paged" else used * self.max_model_len
        return dict(blocks_used=used, blocks_total=m.num_total_blocks, tokens_stored=stored, tokens_capacity=cap,
                    bytes_in_use=used * (self.config.block_size if m.kind == "paged" else self.max_model_len)
                    * self.kv_bytes_per_token)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
