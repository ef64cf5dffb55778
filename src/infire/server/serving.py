"""What every generation route shares: model-name checks, admission, the delta stream.

`Serving.generate` validates a request before anything is queued (so errors are answered
before a stream starts), refuses new work when the waiting queue is over its limit, and
yields the engine client's RequestDeltas while observing latency metrics.
`until_finished` collects a non-streaming request while watching for the client to go
away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from infire.engine import ChoiceDelta, EngineClient, GenerateRequest, RequestDelta, merge_delta
from infire.errors import (
    ContextLengthError,
    InvalidRequestError,
    ServerOverloadedError,
)
from infire.outputs import CompletionOutput, RequestOutput
from infire.sampling_params import SamplingParams
from infire.server.metrics import ModelMetrics

logger = logging.getLogger("infire.server")


class ClientDisconnected(Exception):
    """The client closed the connection; its request was aborted."""


class Serving:
    """A generative model's engine client behind the routes, with its name, default
    request parameters (the catalog's), limits and metrics."""

    def __init__(
        self, client: EngineClient, model_name: str, max_waiting: int, metrics: ModelMetrics,
        defaults: dict | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.defaults = defaults or {}
        self._releases: set[asyncio.Task] = set()  # lease releases in flight (decode role)

    @property
    def dead_reason(self) -> str | None:
        """Why its engine stopped, or None while it runs."""
        return self.client.dead_reason

    def footprint(self) -> int | None:
        """Resident bytes of its engine processes (None in-process: not separable)."""
        footprint = getattr(self.client, "footprint", None)
        return footprint() if footprint is not None else None

    def shutdown(self) -> None:
        """Stop its engine (requests still running end with engine_dead)."""
        self.client.shutdown()

    async def check_structured(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar off the event loop; a 400 naming `param` (the
        field it came from) when it does not compile."""
        try:
            await self.client.check_structured(params)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=param) from None

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """Prompt token ids of a conversation, through the model's chat template
        (`kwargs`: more template variables, such as `tools`)."""
        return self.client.tokenizer.encode_chat(messages, **kwargs)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        explicit_max: bool = False,
        kv_transfer: dict | None = None,
        stream: bool = False,
    ) -> tuple[list[int], AsyncIterator[RequestDelta]]:
        """The prompt's token ids and the request's deltas. Raises now, before anything is
        queued, for invalid input (an explicit max_tokens must fit the context too) and
        with ServerOverloadedError when the waiting queue is full. `kv_transfer` is the
        request's kv_transfer_params (disaggregated roles, checked by the client)."""
        ids = self.client.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if stream and self.client.model_info.kv_role == "prefill":
            raise InvalidRequestError(
                "a prefill worker answers its leg whole: send stream false", param="stream"
            )
        request = GenerateRequest(request_id, ids, params, kv_transfer=kv_transfer)
        deltas = self.client.generate(request)
        limit = self.client.model_info.max_model_len
        if explicit_max and params.max_tokens and len(ids) + params.max_tokens > limit:
            raise ContextLengthError(
                f"this model's context is {limit} tokens, but the prompt has "
                f"{len(ids)} and max_tokens asks for {params.max_tokens} more",
                param="max_tokens",
            )
        waiting = self.client.stats().num_waiting
        if waiting >= self.max_waiting:
            raise ServerOverloadedError(
                f"server is overloaded: {waiting} requests are waiting (--max-waiting "
                f"{self.max_waiting}); retry later"
            )
        lease = None
        if self.client.model_info.kv_role == "decode" and kv_transfer:
            lease = (kv_transfer.get("prefill_url"), kv_transfer.get("lease"))
        return ids, self._observed(deltas, lease)

    async def _observed(
        self, deltas: AsyncIterator[RequestDelta], lease: tuple[str | None, str | None] | None
    ) -> AsyncIterator[RequestDelta]:
        """The deltas, observed into the metrics. A decode worker releases the prefill
        worker's lease once its pull ended, or when the request ends before that."""
        last_time, reason = None, None
        try:
            async for delta in deltas:
                if lease is not None and delta.kv_transfer is not None:
                    self._release(*lease)
                    lease = None
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in delta.choices)
                if last_time is not None and tokens:
                    for _ in range(tokens):
                        self.metrics.itl.observe((now - last_time) / tokens)
                if tokens:
                    last_time = now
                reason = next((c.finish_reason for c in delta.choices if c.index == 0), reason)
                if delta.finished:
                    self.metrics.observe_finished(delta.metrics, reason)
                yield delta
        finally:
            if lease is not None:
                self._release(*lease)

    def _release(self, prefill_url: str | None, lease_id: str | None) -> None:
        """Tell the prefill worker (in the background) that its lease can go; without a
        URL, or if the call fails, the lease expires there on its own."""
        if not prefill_url or not lease_id:
            return
        from infire.disagg.balancer import release_lease

        task = asyncio.ensure_future(release_lease(prefill_url, lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


class HeldTokens:
    """Holds back, per choice, tokens that came without text, so that a stream sends
    chunks with text (or a finish) only, each carrying all its tokens and logprobs."""

    def __init__(self) -> None:
        self.held: dict[int, ChoiceDelta] = {}

    def ready(self, delta: RequestDelta) -> list[ChoiceDelta]:
        """The choices of this delta that are worth a chunk, with the held tokens in front."""
        out = []
        for choice in delta.choices:
            held = self.held.pop(choice.index, None)
            if held is not None:
                logprobs = None
                if choice.logprobs is not None:
                    logprobs = (held.logprobs or []) + choice.logprobs
                choice = dataclasses.replace(
                    choice, token_ids=held.token_ids + choice.token_ids, logprobs=logprobs
                )
            if choice.text or choice.finish_reason:
                out.append(choice)
            else:
                self.held[choice.index] = choice
        return out


def finish_reason(choice: CompletionOutput | ChoiceDelta) -> str | None:
    """OpenAI's finish_reason: stop / length (an abort shows as stop)."""
    if choice.finish_reason is None:
        return None
    return "length" if choice.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI usage of a request, cached prompt tokens included."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def output_usage(output: RequestOutput) -> dict:
    """Usage of a collected output."""
    completion = sum(len(o.token_ids) for o in output.outputs)
    return usage(len(output.prompt_token_ids), completion, output.num_cached_tokens)


async def until_finished(
    request: Request, deltas: AsyncIterator[RequestDelta], prompt_ids: list[int]
) -> RequestOutput:
    """The whole output; aborts the request and raises ClientDisconnected if the client leaves."""
    output = RequestOutput("", None, prompt_ids, [], False)

    async def consume() -> None:
        async for delta in deltas:
            merge_delta(output, delta)

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            task.result()
            return output
        if await request.is_disconnected():
            task.cancel()  # the client's iterator aborts the request in its finally
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
