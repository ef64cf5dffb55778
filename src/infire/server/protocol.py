"""Request bodies of the OpenAI and Workers AI APIs, and their mapping to SamplingParams.

Pydantic validates types and ranges the APIs document; anything the engine checks itself
(sampling ranges, context length) is left to SamplingParams and the engine so that each
rule lives in one place. Fields a client may send that infire does not implement yet
(`tools`, `response_format` other than text) are rejected with a clear message rather
than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infire.errors import InvalidRequestError
from infire.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined; other parts refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"message content part of type {part.get('type')!r} is not supported; "
                    "only text parts are",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)


class _Sampling(BaseModel):
    """Fields shared by chat and text completions (OpenAI names, vLLM extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    # disaggregation (vLLM's name): what `infire balance` sends each worker's leg
    kv_transfer_params: dict | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (which validates the ranges)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} with string keys, as ints."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError(
                "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
            ) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def check_supported(self) -> None:
        """Refuse what infire does not do yet, naming it."""
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise InvalidRequestError(
                f"response_format {kind!r} is not supported yet", param="response_format"
            )
        if self.tools:
            raise InvalidRequestError("tools are not supported yet", param="tools")

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, top)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (batched prompts are refused for now)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    "several prompts in one request are not supported yet; send one each",
                    param="prompt",
                )
            prompt = prompt[0]
        if self.echo:
            raise InvalidRequestError("echo is not supported yet", param="echo")
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class WorkersAIRequest(BaseModel):
    """Workers AI text generation input: a prompt or messages plus its parameters."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    raw: bool = False  # prompt as is, without the chat template
    stream: bool = False
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.6, ge=0, le=5)
    top_p: float | None = Field(None, gt=0, le=2)
    top_k: int | None = Field(None, ge=1, le=50)
    seed: int | None = Field(None, ge=1, le=9999999999)
    repetition_penalty: float | None = Field(None, ge=0, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    kv_transfer_params: dict | None = None  # disaggregation: see _Sampling

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=min(self.top_p, 1.0) if self.top_p is not None else 1.0,
            top_k=self.top_k or 0,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            max_tokens=self.max_tokens,
        )
