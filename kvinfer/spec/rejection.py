"""Verification of proposed tokens against the target model's logits: exact match (greedy), rejection sampling."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvinfer.core.sampler import Sampler, SampleResult, SampleRow, chosen_logprobs, draw, filter_probs, process_row


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SampleRow], draft: Sequence[int],
           draft_probs: Optional[torch.Tensor] = None) -> SampleResult:
    """The tokens one sequence emits after verifying `draft` (k tokens) in one forward pass.

    logits [k + 1, vocab]: row j is the target's prediction after the context and draft[:j]; rows[j] describes
    that row as if draft[:j] had been accepted (penalties and min_tokens bans see them). Returns the accepted
    draft prefix plus one token the target chose itself (the correction, or a bonus when all were accepted),
    each with its logprobs from its own raw row, exactly as one-token-per-step decoding would report them.

    Greedy: a draft token is accepted iff it equals what the target picks at that row, so the output is the
    non-speculative output. Sampling: standard rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
    accept draft[j] with probability min(1, p_j(d) / q_j(d)); on rejection draw from max(p_j - q_j, 0)
    renormalised, so every emitted token is distributed as the target alone would have drawn it. q_j is
    draft_probs[j] ([k, vocab]) for a draft model, or a point mass on draft[j] when draft_probs is None
    (n-gram proposals), which makes the residual p_j with draft[j] removed.
    """
    k = len(draft)
    assert logits.shape[0] == k + 1 == len(rows), (logits.shape, k, len(rows))
    if rows[0].params.greedy:
        target = sampler.sample(logits, rows)
        n = 0
        while n < k and target.token_ids[n] == draft[n]:
            n += 1
        return SampleResult(target.token_ids[:n + 1], target.logprobs[:n + 1])
    gen = rows[0].generator
    tokens: list[int] = []
    for j in range(k + 1):
        p = filter_probs(process_row(logits[j], rows[j]), rows[j].params)  # [vocab]
        if j == k:  # every draft token accepted: the bonus token comes from the target alone
            tokens.append(draw(p, gen))
            break
        d = draft[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=gen))
        if q_d > 0 and u * q_d < float(p[d]):  # u < p(d) / q(d), without dividing by a tiny q
            tokens.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        mass = float(residual.sum())
        # p == q (up to rounding) leaves no residual mass; p is then the right distribution to draw from.
        tokens.append(draw(residual if mass > 0 else p, gen))
        break
    return SampleResult(tokens, chosen_logprobs(logits[:len(tokens)], rows[:len(tokens)], tokens))
