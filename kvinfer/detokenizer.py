"""IncrementalDetokenizer: turns a stream of generated token ids into text deltas, one small decode per step."""
from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens.

    Decoding token by token is wrong (a character's UTF-8 bytes can span tokens; SentencePiece drops a
    token's leading space when it starts a decode), and decoding everything each step is O(n^2). So,
    like vLLM and TGI, each step decodes only a window `ids[window_start:]` that begins a little before
    the new tokens, and emits the part of it past what was already emitted.

    Invariants:
      * `window_start` and `_read` sit on character boundaries: every token before `_read` has been
        fully emitted and `decode(ids[window_start:_read])` ended without a pending partial character.
      * `_emitted` counts the characters of `decode(ids[window_start:])` already handed out.
    A trailing run of U+FFFD is held back: it is what an unfinished multi-byte character decodes to,
    and it either turns into the real character once the next bytes arrive or, if the bytes really are
    invalid, is emitted once a real character follows; flush() drops a run still trailing at the end.

    The joined deltas equal `tokenizer.decode(all_output_ids, skip_special_tokens)` without its trailing
    U+FFFD run (an incomplete last character). The prompt is not
    used as decoding context: with SentencePiece it would keep the first output token's leading space,
    which decode(output_ids) strips.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self._window_start = 0
        self._read = 0
        self._emitted = 0
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.output_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete ("" while a character is still partial)."""
        if not new_ids:
            return ""
        self.output_ids.extend(int(i) for i in new_ids)
        window = self._decode(self._window_start)
        stable = len(window.rstrip(_REPLACEMENT))
        delta = window[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(window):
            # Clean boundary: slide the window so the next decode starts at the previous read point,
            # which keeps one step of left context (spaces, byte merges) and bounds the work per step.
            self._window_start, self._read = self._read, len(self.output_ids)
            self._emitted = len(self._decode(self._window_start, self._read))
        if delta:
            self._text_parts.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is still held back, at the end of the sequence. A trailing run of U+FFFD is dropped:
        it is a character whose remaining bytes were never generated (e.g. max_tokens cut an emoji in two),
        and a half character is no character, not a replacement sign."""
        window = self._decode(self._window_start)
        end = len(window.rstrip(_REPLACEMENT))
        delta = window[self._emitted:end] if end > self._emitted else ""
        self._emitted = len(window)
        if delta:
            self._text_parts.append(delta)
        return delta
