"""SamplingParams: how one request picks its tokens and when it stops, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from kvinfer.errors import ValidationError

MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's limit on biased tokens per request
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_BAD_WORDS = 64  # bad_words per request; each one's token sequences are checked at every sampled token


@dataclass
class StructuredOutput:
    """What a constrained request's output must match: exactly one of a JSON Schema (`json`; True or {} for any
    JSON object), a regular expression, a list of choices, or an llguidance Lark grammar.

    `param` is the request parameter that errors name (the server sets `response_format` or `tool_choice`).
    """

    json: Union[None, bool, dict, str] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    lark: Optional[str] = None
    param: str = "structured_output"

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "lark") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(self.param, given or None, "give exactly one of json, regex, choice or lark")
        if self.json is not None and not isinstance(self.json, (bool, dict, str)):
            raise ValidationError(self.param, type(self.json).__name__, "json must be a schema dict, its JSON "
                                  "text, or True for any JSON object")
        for k in ("regex", "lark"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValidationError(self.param, v, f"{k} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValidationError(self.param, self.choice, "choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "lark") if getattr(self, k) not in (None, False))


def _listed(value):
    """A list of an iterable's items; anything else as it is, for the validation to name."""
    try:
        return list(value)
    except TypeError:
        return value


@dataclass
class SamplingParams:
    """Per-request sampling and stopping; temperature 0 means greedy."""

    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-k logprobs per generated token
    prompt_logprobs: Optional[int] = None  # top-k logprobs of each prompt token after the first (vLLM's)
    # An embedding request: the prompt's final-norm hidden states pooled into one vector (last | mean | cls),
    # reported with its (one, discarded) token; it takes no prefix-cache hits.
    pooling: Optional[str] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[dict] = None  # token id -> value added to its logit before sampling (OpenAI's logit_bias)
    # A grammar the output must follow (token masks from llguidance, see kvinfer/structured.py).
    structured_output: Optional[StructuredOutput] = None
    # vLLM's: only these token ids may be sampled; words the output never ends (their last token is masked when
    # the output so far ends with the rest of the word); only the last k prompt tokens are kept (-1: the context
    # window's worth).
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.structured_output, dict):
            unknown = set(self.structured_output) - {"json", "regex", "choice", "lark", "param"}
            if unknown:
                raise ValidationError("structured_output", sorted(unknown), "unknown keys; use json, regex, "
                                      "choice or lark")
            self.structured_output = StructuredOutput(**self.structured_output)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (str, bytes, Mapping)):
            self.allowed_token_ids = _listed(self.allowed_token_ids)
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else _listed(self.bad_words or [])
        # -1 disables top-k, as 0 does; so does a k larger than any vocabulary (the kernels take it as an int64,
        # which a k past 2^63 - 1 would not fit)
        if self.top_k == -1 or (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                                and self.top_k >= 2 ** 63):
            self.top_k = 0
        self._validate()

    def _validate(self):
        def bad(param, reason):
            raise ValidationError(param, getattr(self, param), reason)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a number > 0 (1 disables it)")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.pooling not in (None, "last", "mean", "cls"):
            bad("pooling", "must be one of last, mean, cls")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            bad("logit_bias", f"may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for t, v in self.logit_bias.items():
            if not is_int(t) or t < 0 or not is_num(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"must map token ids (integers >= 0) to numbers in "
                                  f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; got {t!r}: {v!r}")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list)
                                                   or not self.allowed_token_ids
                                                   or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS \
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings, none of them empty or blank")
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                        or not (self.truncate_prompt_tokens >= 1
                                                                or self.truncate_prompt_tokens == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1 (keep the prompt's last k tokens) or -1 (the "
                                          "context window's worth)")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            bad("structured_output", "must be a StructuredOutput or a dict of its fields")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow float32; such temperatures are greedy in effect.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def plain(self) -> bool:
        """Nothing changes the logits before temperature and the top-k/top-p/min-p filters (no penalties,
        logit_bias, allowed or bad tokens): the token depends on the raw row (and the draw) alone."""
        return (not self.uses_penalties and not self.logit_bias and self.allowed_token_ids is None
                and not self.bad_words)

    @property
    def plain_greedy(self) -> bool:
        """Greedy and plain: the argmax of the raw row."""
        return self.greedy and self.plain

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
