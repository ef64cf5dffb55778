"""SamplingParams: how one request is sampled and when it stops, named as in vLLM.

Every field is checked once at construction; an invalid value raises InvalidRequestError
naming the field, so bad input never reaches the engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infire.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Sampling controls of one request (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context window
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; 0: only the sampled one
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    # a grammar the output must follow (engine/structured.py): one of {"json": schema},
    # {"json_object": True}, {"regex": ...}, {"choice": [...]}, {"grammar": lark_or_gbnf}
    structured_output: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k < 0:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        _require(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _require(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            f"must fit in 64 bits (-2**63 <= seed < 2**63), got {self.seed}",
        )
        _require(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        for token, bias in (self.logit_bias or {}).items():
            _require(
                isinstance(token, int) and token >= 0 and -100 <= bias <= 100,
                "logit_bias",
                f"needs token ids >= 0 and biases in [-100, 100], got {token!r}: {bias!r}",
            )
        if self.structured_output is not None:
            from infire.engine.structured import spec_kind

            spec_kind(self.structured_output)  # its shape; the grammar compiles at the edge
        _require(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """True when any repetition / frequency / presence penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _require(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid sampling parameter {name}: {problem}", param=name)
