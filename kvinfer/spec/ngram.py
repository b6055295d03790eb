"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the sequence's last n-gram."""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """Per sequence: every n-gram (ngram_min <= n <= ngram_max) mapped to where its latest occurrence ends.

    Updated incrementally as tokens arrive, so a lookup costs O(ngram_max) however long the context is (a scan
    of a 2000-token context per request per step would cost more than the step saves).
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.ends: list[dict[tuple, int]] = [dict() for _ in range(ngram_max + 1)]  # ends[n][gram] = end position
        self.indexed = 0  # n-grams ending at positions <= indexed (exclusive end) are in `ends`

    def _index_upto(self, tokens: Sequence[int], end: int) -> None:
        # n-grams ending strictly before `end`: the suffix ending at len(tokens) must not find itself.
        for e in range(max(self.indexed + 1, 1), end + 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if e - n >= 0:
                    self.ends[n][tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram's latest earlier occurrence; [] if none."""
        return self.propose_match(tokens, k)[0]

    def propose_match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """propose(), and the length n of the n-gram that matched (0: none). A longer match is a better bet: on
        the extractive workload of `bench spec` a 4-gram's first proposed token is right far more often than a
        single token's (docs/BENCHMARKS.md, "Figures behind code decisions")."""
        total = len(tokens)
        self._index_upto(tokens, total - 1)
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            e = self.ends[n].get(tuple(tokens[total - n:]))
            if e is not None:
                return list(tokens[e:e + k]), n
        return [], 0
