"""Request: one sequence being generated — its tokens, progress, state and timings."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens` step by step (vLLM v1's framing)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (set at first admission)
    num_preemptions: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    generator: Any = None  # torch.Generator, owned by the engine
    # Grammar matcher of a constrained request, advanced per accepted token; it survives preemption, because
    # recompute replays the same tokens through the model only.
    grammar: Any = None
    logprobs: list = field(default_factory=list)
    # params.prompt_logprobs: (logprob, top-k pairs, rank) of prompt token i + 1 at index i, filled as the prompt is
    # computed (by the first sample of a group only; prefix-cache hits are not taken until the list is complete).
    prompt_logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # params.pooling: the final-norm hidden states of the prompt rows computed so far (chunks, float32 copies, in
    # order), then the pooled vector once the whole prompt is computed.
    pooled: list = field(default_factory=list)
    num_pooled: int = 0
    embedding: Optional[list] = None
    group_id: Optional[str] = None
    index: int = 0  # sample index within its group (n > 1)
    # Set for a sibling waiting to be forked from its group's first request after that one's prefill.
    fork_parent: Optional["Request"] = None
    # Speculative decoding: tokens proposed for the next step to verify, and the draft model's distribution
    # over them ([k, vocab] tensor; None for n-gram proposals, point masses).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None
    bad_words_ids: tuple = ()  # token sequences the output must not complete (params.bad_words, tokenized)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (they come from the first sample's prefill)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + (self.params.max_tokens or 0)
