"""What the engine returns: RequestOutput / CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True, slots=True)
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely)."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (index i of n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled + top alternatives
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """True once this sequence has stopped."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step: its prompt and every sequence so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None  # a prefill engine's handle (disaggregation)
