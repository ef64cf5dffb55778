"""What every generation route shares: model-name checks, admission, the output stream.

`Serving.generate` validates a prompt before anything is queued (so errors are answered
before a stream starts), refuses new work when the waiting queue is over its limit, and
yields the engine's RequestOutputs while observing latency metrics. `Choices` turns
successive RequestOutputs into per-choice deltas for streaming. `until_finished`
collects a non-streaming request while watching for the client to go away.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from infire.engine.async_engine import AsyncLLMEngine
from infire.errors import ContextLengthError, ModelNotFoundError, ServerOverloadedError
from infire.outputs import CompletionOutput, Logprob, RequestOutput
from infire.sampling_params import SamplingParams
from infire.server.metrics import ServerMetrics

_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|f16|f32|bf16|iq\d\w*)$", re.IGNORECASE)


class ClientDisconnected(Exception):
    """The client closed the connection; its request was aborted."""


def model_aliases(name: str) -> set[str]:
    """Lower-case ids that name the served model: itself and without a quantization suffix."""
    name = name.lower().removesuffix(".gguf")
    return {name, _QUANT_SUFFIX.sub("", name)}


class Serving:
    """The engine behind the routes, with its model names, limits and metrics."""

    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, max_waiting: int, metrics: ServerMetrics
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._aliases = model_aliases(model_name)

    def check_model(self, requested: str) -> None:
        """Accept the served name, case-insensitively, also as `@cf/author/name`."""
        last = requested.rsplit("/", 1)[-1] if requested.startswith("@cf/") else requested
        if model_aliases(last) & self._aliases:
            return
        raise ModelNotFoundError(
            f"model {requested!r} does not exist; this server serves {self.model_name!r}",
            param="model",
        )

    def prompt_ids(
        self, prompt: str | list[int], params: SamplingParams, explicit_max: bool
    ) -> list[int]:
        """Tokenize and check a prompt (and an explicit max_tokens) against the context, and
        the parameters' token ids against the vocabulary."""
        engine = self.engine.engine
        engine.check_params(params)
        ids = engine.tokenize_prompt(prompt)
        if (
            explicit_max
            and params.max_tokens
            and len(ids) + params.max_tokens > engine.max_model_len
        ):
            raise ContextLengthError(
                f"this model's context is {engine.max_model_len} tokens, but the prompt has "
                f"{len(ids)} and max_tokens asks for {params.max_tokens} more",
                param="max_tokens",
            )
        return ids

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; raises ServerOverloadedError now when the queue is full."""
        waiting = len(self.engine.engine.scheduler.waiting)
        if waiting >= self.max_waiting:
            raise ServerOverloadedError(
                f"server is overloaded: {waiting} requests are waiting (--max-waiting "
                f"{self.max_waiting}); retry later"
            )
        return self._observed(self.engine.generate(prompt_ids, params, request_id))

    async def _observed(
        self, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        last_time, last_tokens = None, 0
        async for output in outputs:
            now = time.monotonic()
            tokens = sum(len(o.token_ids) for o in output.outputs)
            if last_time is not None and tokens > last_tokens:
                gap = (now - last_time) / (tokens - last_tokens)
                for _ in range(tokens - last_tokens):
                    self.metrics.itl.observe(gap)
            if tokens > last_tokens:
                last_time, last_tokens = now, tokens
            if output.finished:
                self.metrics.observe_finished(output)
            yield output


@dataclass(slots=True)
class Delta:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None


@dataclass(slots=True)
class Choices:
    """Remembers how much of each choice was already sent."""

    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def deltas(self, output: RequestOutput) -> list[Delta]:
        """New text, tokens and logprobs per choice; a finished choice is reported once."""
        deltas = []
        for choice in output.outputs:
            i = choice.index
            chars, tokens = self.sent_chars.get(i, 0), self.sent_tokens.get(i, 0)
            if i in self.finished or (len(choice.text) == chars and not choice.finished):
                continue
            self.sent_chars[i], self.sent_tokens[i] = len(choice.text), len(choice.token_ids)
            if choice.finished:
                self.finished.add(i)
            deltas.append(
                Delta(
                    i, choice.text[chars:], choice.token_ids[tokens:],
                    (choice.logprobs or [])[tokens:], finish_reason(choice),
                )
            )  # fmt: skip
        return deltas


def finish_reason(choice: CompletionOutput) -> str | None:
    """OpenAI's finish_reason: stop / length (an abort shows as stop)."""
    if choice.finish_reason is None:
        return None
    return "length" if choice.finish_reason == "length" else "stop"


def usage(output: RequestOutput) -> dict:
    """OpenAI usage of a request, cached prompt tokens included."""
    prompt = len(output.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


async def until_finished(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output; aborts the request and raises ClientDisconnected if the client leaves."""
    last: list[RequestOutput] = []

    async def consume() -> None:
        async for output in outputs:
            last[:] = [output]

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            task.result()
            return last[0]
        if await request.is_disconnected():
            task.cancel()  # the engine's iterator aborts the request in its finally
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
