"""Grammar-constrained decoding over llguidance: grammars compiled and cached per spec, a matcher per sequence,
the token masks of every constrained row of a step computed and applied together."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import torch

from kvinfer.errors import ValidationError
from kvinfer.sampling_params import StructuredOutput

# Compiled matchers kept for reuse; a new request with the same spec deep-copies one instead of compiling.
GRAMMAR_CACHE_SIZE = 256

# JSON written without free whitespace: the grammar then cannot let a small model pad forever between tokens,
# and the output is as compact as OpenAI's.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llg():
    import llguidance

    return llguidance


def spec_key(spec: StructuredOutput) -> str:
    """A cache key for a spec: the same schema written with other key order or spacing hits the same entry."""
    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # reported as invalid when compiled
    return kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def _lark_string(s: str) -> str:
    # Lark string literals take JSON escapes.
    return json.dumps(s, ensure_ascii=False)


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for a spec; raises ValidationError naming spec.param if malformed."""
    llg = _llg()
    kind = spec.kind
    if kind == "json":
        schema: Any = spec.json
        if schema is True or schema == {}:
            schema = {"type": "object"}  # JSON mode: any object, as OpenAI's json_object
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValidationError(spec.param, schema[:60], f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValidationError(spec.param, type(schema).__name__, "a JSON schema must be an object")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ValidationError(spec.param, "schema", f"the JSON schema cannot be used: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in spec.choice))
    return llg.LLMatcher.grammar_from_lark(spec.lark)


class GrammarCompiler:
    """One per engine: the tokenizer llguidance needs, the compiled-grammar cache and the mask executor."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        llg = _llg()
        self.vocab_size = vocab_size  # the width of the logits, which may exceed the tokenizer's vocabulary
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self.executor = llg.LLExecutor()
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # requests may be added from several threads (server and engine)
        self.stats = dict(compiled=0, cache_hits=0)

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of the spec's grammar; raises ValidationError if it cannot compile."""
        key = spec_key(spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return cached.deep_copy()
        llg = _llg()
        grammar = grammar_text(spec)
        err = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise ValidationError(spec.param, spec.kind, f"the grammar is invalid or unsupported: {_first_line(err)}")
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValidationError(spec.param, spec.kind, f"the grammar cannot be compiled: "
                                                         f"{_first_line(m.get_error())}")
        with self._lock:
            self._cache[key] = m
            self.stats["compiled"] += 1
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return m.deep_copy()

    def bitmask(self, matchers: Sequence[Any], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Allowed-token bits of the matchers' next tokens, computed in parallel: int32 [rows, words], bit j of word
        w is token 32w + j (1 = allowed); written into `out` (rows of it, contiguous) when given. A matcher in an
        error state allows nothing; its row then allows the EOS tokens, to end the sequence rather than sample
        from nothing."""
        n = len(matchers)
        bitmask = out if out is not None else torch.full((n, self.words), -1, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              self.words * 4, n)
        words = bitmask.numpy()
        dead = np.flatnonzero(~words.any(axis=1))
        for e in self.eos_token_ids if len(dead) else ():
            words[dead, e // 32] |= np.int32(np.uint32(1 << (e % 32)).view(np.int32))
        return bitmask

    def allowed(self, matchers: Sequence[Any]) -> np.ndarray:
        """Allowed-token masks of the matchers' next tokens, computed in parallel: [rows, vocab] uint8 (1 = allowed)."""
        words = self.bitmask(matchers).numpy()
        # Bit j of word w is token 32w + j: little-endian bytes unpacked little-bit-first are in token order.
        return np.unpackbits(words.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")  # [rows, vocab]


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any],
                        compiler: GrammarCompiler) -> None:
    """Set the logits of tokens the grammars forbid to -inf, in place, for the given rows of `logits` [n, vocab]."""
    allowed = compiler.allowed(matchers)  # [len(rows), vocab]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        # numpy, one row view at a time: torch's boolean masking is many times slower on a busy CPU.
        x = logits.numpy()
        for j, i in enumerate(rows):
            np.putmask(x[i], allowed[j] == 0, np.float32("-inf"))
        return
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    keep = torch.from_numpy(allowed.astype(bool)).to(logits.device)
    logits[idx] = torch.where(keep, logits[idx], float("-inf"))


def accept_token(matcher, token_id: int) -> bool:
    """Advance a matcher by a sampled token; False if the grammar did not allow it (the matcher is then dead)."""
    return bool(matcher.consume_token(token_id))


def _first_line(msg: Optional[str]) -> str:
    msg = " ".join((msg or "").split())
    return msg[:300] or "unknown error"
