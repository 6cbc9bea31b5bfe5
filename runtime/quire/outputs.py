"""What the engine hands back: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class Logprob:
    logprob: float
    rank: int                      # 1 = the most likely token
    decoded_token: str | None = None


class TokenLogprobs(NamedTuple):
    """What the sampler reports for one sampled token (engine-internal)."""
    logprob: float               # of the sampled token
    rank: int                    # of the sampled token, 1 = the most likely
    top_ids: list[int]           # the top-k token ids, most likely first
    top_logprobs: list[float]    # ... and their logprobs


# One dict per generated token: token id -> Logprob (the top-k plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None        # 'stop', 'length', 'abort', 'error' or None
    stop_reason: int | str | None = None    # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one dict per prompt token, the first None (vLLM's)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # the pooling runner's: the prompt's embedding


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: `.outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
