"""InputProcessor: a request's prompt tokenized and its sampling checked and completed once, before the engine core."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

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
        for param, ids_ in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids_ if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValidationError(param, bad, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.max_tokens is None:
            # The rest of the room, as OpenAI-style servers do when max_tokens is not given.
            params = replace(params, max_tokens=max(1, self.max_new_tokens(len(ids))))
        self.scheduler.check_fits(len(ids), params.max_tokens)
        return EngineRequest(request_id, text, ids, params)
