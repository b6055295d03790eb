"""What the engine hands back: per-sample completions grouped per request, with timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: Optional[int] = None  # prompt logprobs: 1 + how many tokens were more likely (vLLM's rank)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # stop | length | abort
    stop_reason: Any = None  # the stop string or stop token id that ended it
    logprobs: Optional[list[Logprob]] = None
    cumulative_logprob: Optional[float] = None
    delta_text: str = ""  # text new since the previous RequestOutput for this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: Optional[RequestMetrics] = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then the Logprob of each later one given
    # the tokens before it (None until the prompt has been computed).
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None
    embedding: Optional[list[float]] = None  # SamplingParams.pooling: the pooled final hidden state (float32 values)

    @property
    def ttft(self):
        return self.metrics.ttft if self.metrics else None

    @property
    def tpot(self):
        return self.metrics.tpot if self.metrics else None
