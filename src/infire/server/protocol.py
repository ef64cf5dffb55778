"""Request bodies of the OpenAI and Workers AI APIs, and their mapping to SamplingParams.

Pydantic validates types and ranges the APIs document; anything the engine checks itself
(sampling ranges, context length) is left to SamplingParams and the engine so that each
rule lives in one place. Structured outputs come as OpenAI's `response_format` (text,
json_object, json_schema) or vLLM's extras (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `structured_outputs`); at most one of them. Fields a
client may send that infire does not implement yet (`tools`) are rejected with a clear
message rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infire.errors import InvalidRequestError
from infire.sampling_params import MAX_LOGPROBS, SamplingParams

# vLLM's guided_* fields and the structured_output kind each one gives
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip


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
    # structured outputs (engine/structured.py): OpenAI's, then vLLM's extras
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
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
            structured_output=self.structured_output(),
        )

    def structured_output(self) -> dict | None:
        """The one grammar the request asks for, as SamplingParams.structured_output."""
        given: dict[str, dict] = {}
        if (spec := _response_format(self.response_format)) is not None:
            given["response_format"] = spec
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                given[name] = {kind: getattr(self, name)}
        if (spec := _vllm_structured(self.structured_outputs)) is not None:
            given["structured_outputs"] = spec
        if len(given) > 1:
            raise InvalidRequestError(f"send one of {', '.join(given)}, not several",
                                      param=next(iter(given)))  # fmt: skip
        return next(iter(given.values()), None)

    @property
    def structured_param(self) -> str:
        """The field the request's grammar came from (for errors)."""
        names = (*_GUIDED, "structured_outputs")
        return next((n for n in names if getattr(self, n) is not None), "response_format")

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
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, top)


def _response_format(value: dict[str, Any] | None) -> dict | None:
    """OpenAI's response_format as a structured_output spec (None for text)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format json_schema needs json_schema.schema, "
                                      "a JSON Schema object", param="response_format")  # fmt: skip
        return {"json": schema}
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, not {kind!r}",
        param="response_format",
    )


def _vllm_structured(value: dict[str, Any] | None) -> dict | None:
    """vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object})."""
    if value is None:
        return None
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, "
                                  "grammar, json_object", param="structured_outputs")  # fmt: skip
    return given


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
    response_format: dict[str, Any] | None = None  # json_object or json_schema, as OpenAI's
    # tools: Workers AI's flat {name, description, parameters} or OpenAI's wrapped form;
    # tool_choice (an infire extension there) as OpenAI's
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def openai_tools(self) -> list[dict[str, Any]] | None:
        """The tools in OpenAI's form."""
        if not self.tools:
            return None
        return [t if "function" in t else {"type": "function", "function": t} for t in self.tools]

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            structured_output=_response_format(self.response_format),
            temperature=self.temperature,
            top_p=min(self.top_p, 1.0) if self.top_p is not None else 1.0,
            top_k=self.top_k or 0,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            max_tokens=self.max_tokens,
        )
