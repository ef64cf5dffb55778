"""Sequence: one generated stream's state as it moves waiting -> running -> finished.

A request with n > 1 is n sequences sharing a prompt (and, through the prefix cache,
its KV blocks). A sequence knows its tokens, how many of them have KV in the pool
(`num_computed_tokens`), its block table, and its text so far; it never touches the
pool or the scheduler itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from infire.outputs import Logprob, RequestMetrics
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens being generated for a request."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    generator: torch.Generator | None = None  # per-request seed: same tokens in any batch
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    # one per windowed KV group, entry i for the same tokens as block_table[i]; blocks
    # that fell out of the window are freed and read -1 (the engine core's tables only)
    window_block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # keys of full, computed blocks
    text: str = ""
    num_emitted_chars: int = 0  # text that may be handed out (stop strings are held back)
    num_sent_chars: int = 0  # text already sent in a delta
    num_sent_tokens: int = 0  # output tokens already sent in a delta
    finish_sent: bool = False  # the delta with the finish reason is out
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matcher: Any = None  # its grammar's state, when the request has a structured output
    # disaggregation: on a prefill engine the handle it answers with, on a decode engine
    # the handle it pulls from (disagg/transfer.py); `error` fails the request
    kv_handle: dict | None = None
    error: str | None = None
    invalid: bool = False  # the error is the request's fault (its grammar), not the engine's

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        """Number of tokens generated so far."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        """True once the sequence stopped for any reason."""
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark the sequence done; the engine frees its blocks."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
