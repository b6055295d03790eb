"""Sampler: logits -> next tokens with penalties, temperature, top-k/top-p/min-p and per-request RNG."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvinfer.sampling_params import SamplingParams
from kvinfer.structured import GrammarCompiler, apply_grammar_masks


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first one on ties; a NaN counts as the largest, as in torch).
    On CPU through numpy, which is an order of magnitude faster than torch's over a large vocabulary
    (docs/BENCHMARKS.md, "Figures behind code decisions")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.reshape(-1, logits.shape[-1]).numpy().argmax(axis=-1).tolist()
    return logits.reshape(-1, logits.shape[-1]).argmax(dim=-1).tolist()


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: Optional[torch.Generator]
    banned_ids: Sequence[int] = ()  # EOS / stop ids masked out while min_tokens is not reached
    grammar: Any = None  # the sequence's grammar matcher (structured outputs), at the state after output_ids


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Optional[tuple[float, list[tuple[int, float]]]]]  # (chosen logprob, top-k pairs) per row


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """Repetition penalty (HF / CTRL style, over prompt and output) and OpenAI presence/frequency penalties."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(output_ids):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[-1]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; returns probabilities with disallowed tokens at exactly 0. On the
    CPU the C kernel's (the distribution sample_row draws from; speculative rejection sampling compares these),
    elsewhere torch's."""
    if c_sampling(logits):
        from kvinfer import kernels

        return kernels.active().sample_probs(logits.contiguous(), p.temperature, p.top_k, p.top_p, p.min_p)
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[0] = False  # the most likely token always survives (top_p may round to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One token from probs [vocab] (zeros never drawn) by inverse CDF: a single uniform number per draw.

    torch.multinomial draws one exponential number per vocabulary entry; this costs one cumulative sum, far less
    (docs/BENCHMARKS.md, "Figures behind code decisions"). The sum runs
    in float64 in index order, so the draw depends only on the row and its generator.
    """
    cdf = probs.to(torch.float64).cumsum(0)  # [vocab]
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= len(cdf):  # u rounded up to the total: the last token with any mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def c_sampling(row: torch.Tensor) -> bool:
    """Whether a row is drawn by the C kernel (kvq_sample_row), as the fused multi-step decode draws: CPU float32
    rows where the kernels are available."""
    from kvinfer import kernels

    return row.device.type == "cpu" and row.dtype == torch.float32 and kernels.available()


def uniform(generator: Optional[torch.Generator], n: int = 1) -> torch.Tensor:
    """The next n uniform numbers in [0, 1) of a request's generator, as each draw takes them (float64; n of them
    at once are the same numbers as n calls one at a time)."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def row_params(params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p, min_p) as the C kernels take them (float32 / int64 / float32 / float32
    [rows]): temperature 0 for a greedy row (the argmax), which is how kvq_sample_rows and kvq_decode_steps tell
    the two apart."""
    return (torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


def sample_row(row: torch.Tensor, p: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """One token from a processed row of logits [vocab] (temperature > 0) with the request's generator: on the CPU
    by the C kernel (one uniform number per draw, the arithmetic the fused multi-step decode shares), elsewhere by
    filter_probs + draw."""
    if c_sampling(row):
        from kvinfer import kernels

        return kernels.sample_row(row.contiguous(), p.temperature, p.top_k, p.top_p, p.min_p,
                                  float(uniform(generator)))
    return draw(filter_probs(row, p), generator)


def process_row(row: torch.Tensor, r: SampleRow) -> torch.Tensor:
    """One row of logits [vocab] with banned ids masked and penalties applied: a new tensor, or the row itself when
    nothing applies (callers only read it)."""
    p = r.params
    if not (p.logit_bias or p.allowed_token_ids is not None or r.banned_ids or p.uses_penalties):
        return row
    row = row.clone()
    if r.params.logit_bias:  # added to the raw logits, before penalties and temperature
        ids, bias = zip(*r.params.logit_bias.items())
        row[torch.tensor(ids, dtype=torch.long)] += torch.tensor(bias, dtype=row.dtype)
    if r.params.allowed_token_ids is not None:
        allowed = torch.tensor(r.params.allowed_token_ids, dtype=torch.long)
        masked = torch.full_like(row, float("-inf"))
        masked[allowed] = row[allowed]
        if bool(torch.isfinite(masked).any()):
            row = masked
        # else a grammar already forbids every allowed id: the grammar wins, rather than a draw from nothing
    if r.banned_ids:
        idx = torch.tensor(list(r.banned_ids), dtype=torch.long)
        kept = row[idx]  # index by tensor: already a copy
        row[idx] = float("-inf")
        if not bool(torch.isfinite(row).any()):
            # Nothing else is left (a complete grammar, or allowed_token_ids all banned now): the ban yields,
            # rather than a draw from nothing.
            row[idx] = kept

    if r.params.uses_penalties:
        row = apply_penalties(row, r.params, r.prompt_ids, r.output_ids)
    return row


def row_logprob(row: torch.Tensor, token: int, k: int, rank: bool = False) -> tuple:
    """(logprob of `token`, the k most likely (id, logprob) pairs[, its rank]) from one row of raw logits [vocab]:
    the one computation behind the logprobs of generated and of prompt tokens alike (rank: 1 + how many tokens
    are more likely). One row at a time: a softmax over [rows, vocab] may reduce differently with the row count."""
    logp = torch.log_softmax(row, dim=-1)
    top = []
    if k:
        v, ix = logp.topk(k)
        top = list(zip(ix.tolist(), v.tolist()))
    lp = logp[token]
    if rank:
        return float(lp), top, int((logp > lp).sum()) + 1
    return float(lp), top


def chosen_logprobs(raw: torch.Tensor, rows: Sequence[SampleRow], tokens: Sequence[int]) -> list:
    """(logprob of the chosen token, top-k pairs) per row that asked for logprobs, from the raw logits [n, vocab]."""
    lps: list = [None] * len(rows)
    for i, r in enumerate(rows):
        if r.params.logprobs is not None:
            lps[i] = row_logprob(raw[i], tokens[i], r.params.logprobs)
    return lps


class Sampler:
    def __init__(self, grammars: Optional[GrammarCompiler] = None):
        self.grammars = grammars  # set by the engine before the first constrained request

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """logits: [n, vocab] float32, one row per entry of `rows`."""
        simple = all(r.params.plain_greedy and not r.banned_ids for r in rows)
        raw = logits  # logprobs are reported from the model's distribution, before any mask
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not simple and c_sampling(logits) and all(r.params.plain and not r.banned_ids for r in rows):
            # Grammar masks, argmaxes and draws of all rows in one C call: the tokens masking, then argmax_rows
            # or sample_row would give.
            tokens = self._sample_in_c(logits, rows, constrained)
            return SampleResult(tokens, chosen_logprobs(raw, rows, tokens))
        if constrained:
            # All constrained rows of the step at once: the masks are computed in parallel by llguidance.
            logits = logits.clone()
            apply_grammar_masks(logits, constrained, [rows[i].grammar for i in constrained], self.grammars)
        if simple:
            tokens = argmax_rows(logits)
        else:
            tokens = []
            for i, r in enumerate(rows):
                row = process_row(logits[i], r)
                if r.params.greedy:
                    tokens.append(argmax_rows(row)[0])
                    continue
                tokens.append(sample_row(row, r.params, r.generator))
        return SampleResult(tokens, chosen_logprobs(raw, rows, tokens))

    def _sample_in_c(self, logits: torch.Tensor, rows: Sequence[SampleRow], constrained: list[int]) -> list[int]:
        """kernels.sample_rows over plain rows (nothing but temperature and the filters, no bans): the grammar rows'
        masks as bits, each sampled row's next uniform number from its generator."""
        from kvinfer import kernels

        n = len(rows)
        u = torch.zeros(n, dtype=torch.float64)
        for i, r in enumerate(rows):
            if not r.params.greedy:
                u[i] = uniform(r.generator)[0]
        allow = None
        if constrained:
            masks = self.grammars.bitmask([rows[i].grammar for i in constrained])
            allow = torch.full((n, masks.shape[1]), -1, dtype=torch.int32)
            allow[torch.tensor(constrained)] = masks
        return kernels.active().sample_rows(logits.contiguous(), *row_params([r.params for r in rows]), u, allow)
