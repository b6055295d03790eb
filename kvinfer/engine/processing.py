"""Request processing around the engine core: InputProcessor before it (token ids in), OutputProcessor after it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence, Union

from kvinfer.detokenizer import IncrementalDetokenizer
from kvinfer.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvinfer.errors import ValidationError
from kvinfer.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class EngineRequest:
    """What the engine core takes: token ids and complete sampling (max_tokens set), already known to fit."""

    request_id: Optional[str]
    prompt: Optional[str]  # the text, when the prompt came as text (reported back in outputs)
    prompt_token_ids: list[int]
    params: SamplingParams
    bad_words_ids: tuple = ()  # params.bad_words as token sequences (each word with and without a leading space)


class InputProcessor:
    """Runs on the caller's side (the offline caller's thread, the server's event loop), never on the stepping
    thread. It reads only what is fixed at start-up (tokenizer, vocabulary, context window, KV capacity), so
    any thread may use it while the engine steps."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, scheduler):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler  # for check_fits and the KV capacity: both fixed at start-up

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """Most new tokens a request with this prompt could ever get (context window and KV capacity)."""
        return min(self.max_model_len, self.scheduler.kv.max_request_tokens) - num_prompt_tokens

    def tokenize(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError("prompt", prompt[:40], "this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValidationError("prompt", t, f"token ids must be integers in [0, {self.vocab_size})")
        return None, ids

    def process(self, request_id: Optional[str], prompt: Prompt,
                params: Optional[SamplingParams] = None) -> EngineRequest:
        """Raises ValidationError / RequestTooLargeError for a request that can never run."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        for param, ids_ in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias),
                            ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids_ if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValidationError(param, bad, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        keep = params.truncate_prompt_tokens
        keep = self.max_model_len if keep == -1 else keep
        if keep is not None and len(ids) > keep:  # left truncation, as vLLM: the answer follows the prompt's end
            text, ids = None, ids[-keep:]  # the text no longer spells the tokens: outputs report prompt None
        bad_words = self._bad_words_ids(params.bad_words)
        if params.max_tokens is None:
            # The rest of the room, as OpenAI-style servers do when max_tokens is not given.
            params = replace(params, max_tokens=max(1, self.max_new_tokens(len(ids))))
        self.scheduler.check_fits(len(ids), params.max_tokens)
        return EngineRequest(request_id, text, ids, params, bad_words)

    def _bad_words_ids(self, words: Sequence[str]) -> tuple:
        """Each bad word's token sequences: as text starts with it and, when that spells it differently, after
        a space (a word inside text), without duplicates."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise ValidationError("bad_words", words, "this model has no tokenizer to spell them")
        seqs: list[tuple[int, ...]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                t = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if t and t not in seqs:
                    seqs.append(t)
        return tuple(seqs)


# ---- after the core ------------------------------------------------------------------------------------
@dataclass
class SampleDelta:
    """The core's token-level output for one sample of a request: tokens since the last one, and its finish."""

    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[Logprob]]
    finish_reason: Optional[str]  # the core's: "stop" (a stop token), "length"
    stop_reason: Any


@dataclass
class CoreOutput:
    """One step's token-level output of a request (all its samples); plain data, safe to hand to another thread."""

    request_id: str
    samples: list[SampleDelta]
    num_cached_tokens: int
    arrival_time: float
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    prompt_logprobs: Optional[list] = None  # once, when complete: None, then a Logprob per later prompt token
    embedding: Optional[list] = None  # a pooling request's vector, once the prompt is computed


@dataclass
class _Sample:
    params: SamplingParams
    detok: Any = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    emitted: int = 0  # characters of `text` already reported
    emitted_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Request:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_Sample]
    stop_found: bool = False  # a stop string ended a sample here: the core's counts wait for our stop command
    # The first sample's token times, as of the tokens kept (the core may have made more after a stop string).
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    prompt_logprobs: Optional[list] = None
    embedding: Optional[list] = None


class OutputProcessor:
    """Token-level outputs to RequestOutputs: detokenization, stop strings, stop-string hold-back, logprobs.

    It runs after the core: inline in `LLMEngine.step` offline, on the caller's event loop under the
    AsyncLLMEngine (one per stream, so no state is shared between threads). A stop string is found here, after
    the core appended the tokens (and perhaps more after them): `process` returns the samples to stop in the
    core with how many of their tokens to keep; tokens the core made after the stop are dropped here."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, req: EngineRequest) -> None:
        samples = []
        for _ in range(req.params.n):
            s = _Sample(req.params)
            if self.tokenizer is not None:
                s.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
            samples.append(s)
        self.requests[request_id] = _Request(req.prompt, req.prompt_token_ids, samples)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, outs: list[CoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int, int]], set[str]]:
        """RequestOutputs of the requests still known; (request_id, sample index, tokens kept) to stop in the core;
        and the ids among the finished ones where a stop string was found (the core's counts need the stop
        commands first). A finished request is forgotten here."""
        results, stops, corrected = [], [], set()
        for out in outs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted, or finished here while deltas the core made after it were in flight
            if out.prompt_logprobs is not None:
                req.prompt_logprobs = out.prompt_logprobs
            if out.embedding is not None:
                req.embedding = out.embedding
            for d in out.samples:
                s = req.samples[d.index]
                if s.finished:
                    continue  # stopped here by a stop string: the core's later tokens are not part of it
                if d.index == 0 and d.new_token_ids:
                    req.first_token_time = req.first_token_time or out.first_token_time
                    req.last_token_time = out.last_token_time
                if self._advance(s, d):
                    req.stop_found = True
                    stops.append((out.request_id, d.index, len(s.token_ids)))
            o = self._output(out, req)
            if o.finished:
                del self.requests[out.request_id]
                if req.stop_found:
                    corrected.add(out.request_id)
            results.append(o)
        return results, stops, corrected

    def _advance(self, s: _Sample, d: SampleDelta) -> bool:
        """Take a sample's new tokens; True when a stop string ended it here (the core must stop it too)."""
        p = s.params
        last = len(d.new_token_ids) - 1
        for k, tok in enumerate(d.new_token_ids):
            s.token_ids.append(tok)
            if d.new_logprobs is not None:
                lp = d.new_logprobs[k]
                s.logprobs.append(lp)
                s.cumulative_logprob += lp.logprob
            if s.detok is None or (k == last and d.finish_reason == "stop"):
                continue  # a stop token's text is not part of the output
            s.text += s.detok.add([tok])
            if p.stop and len(s.token_ids) >= p.min_tokens:
                hit = self._find_stop(s)
                if hit is not None:
                    s.finish_reason, s.stop_reason = "stop", hit
                    return True
        if d.finish_reason is not None:
            if s.detok is not None:
                s.text += s.detok.flush()
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
        return False

    @staticmethod
    def _find_stop(s: _Sample) -> Optional[str]:
        window_start = s.emitted  # held-back text starts here, so a new stop string cannot start earlier
        best = None
        for stop in s.params.stop:
            i = s.text.find(stop, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        s.text = s.text[: i + len(stop)] if s.params.include_stop_str_in_output else s.text[:i]
        return stop

    @staticmethod
    def _output(out: CoreOutput, req: _Request) -> RequestOutput:
        comps = []
        for i, s in enumerate(req.samples):
            p = s.params
            hold = 0
            if not s.finished and p.stop:
                hold = max(len(x) for x in p.stop) - 1  # might still become a stop string
            safe = max(s.emitted, len(s.text) - hold)
            delta = s.text[s.emitted:safe]
            s.emitted = safe
            dtoks = s.token_ids[s.emitted_tokens:]
            s.emitted_tokens = len(s.token_ids)
            comps.append(CompletionOutput(
                index=i, text=s.text[:safe], token_ids=list(s.token_ids), finish_reason=s.finish_reason,
                stop_reason=s.stop_reason, logprobs=list(s.logprobs) if p.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if p.logprobs is not None else None,
                delta_text=delta, delta_token_ids=dtoks))
        m = RequestMetrics(out.arrival_time, req.first_token_time, req.last_token_time, len(req.samples[0].token_ids))
        return RequestOutput(out.request_id, req.prompt, req.prompt_token_ids, comps,
                             all(s.finished for s in req.samples), out.num_cached_tokens, m, req.prompt_logprobs,
                             req.embedding)
