"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Streaming answers are server-sent events of `chat.completion.chunk` / `text_completion`
objects that share one id and `created`, end with `data: [DONE]`, and, when the client
asks for `stream_options.include_usage`, carry `usage: null` until a last chunk with
`choices: []` and the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from infire.engine import ChoiceDelta, RequestDelta
from infire.errors import InfireError, InvalidRequestError
from infire.outputs import CompletionOutput, Logprob
from infire.sampling_params import SamplingParams
from infire.server import tools
from infire.server.errors import error_body, json_object
from infire.server.protocol import ChatCompletionRequest, CompletionRequest
from infire.server.serving import (
    HeldTokens,
    Serving,
    finish_reason,
    output_usage,
    until_finished,
    usage,
)

M = TypeVar("M", bound=BaseModel)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


Models = Callable[[str], Awaitable[Serving]]


async def parse_for_model(request: Request, kind: type[M], models: Models) -> tuple[M, Serving]:
    """The body as `kind`, with the catalog's default parameters of the model it names
    under the ones it sets, and that model's Serving (404 for an unknown model)."""
    raw = json_object(await request.body())
    body = kind.model_validate(raw)
    serving = await models(body.model)
    if serving.defaults:
        body = kind.model_validate({**serving.defaults, **raw})
    return body, serving


def build_router(generative: Models, listing: Callable[[], list[dict]]) -> APIRouter:
    """The /v1 generation routes over the generative model each request names
    (`generative(model)`), and /v1/models over `listing` (the catalog, each entry an
    OpenAI model object)."""
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": listing()}

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body, serving = await parse_for_model(request, ChatCompletionRequest, generative)
        params = body.to_sampling_params()
        plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        param = body.structured_param
        grammar = plan.grammar() if plan is not None else None
        if grammar is not None:
            if params.structured_output is not None:
                raise InvalidRequestError("a required or named tool call and a response "
                                          "format cannot both shape the answer", param="tool_choice")  # fmt: skip
            params.structured_output, param = grammar, "tools"
        await serving.check_structured(params, param)
        template = serving.client.tokenizer.chat_template
        messages = tools.chat_messages(body.messages, plan, template)
        prompt = serving.encode_chat(messages, **tools.template_kwargs(plan, template))
        explicit = body.max_completion_tokens is not None or body.max_tokens is not None
        k = params.logprobs
        if plan is not None and body.stream:
            return await _stream_tool_calls(request, serving, prompt, params, explicit,
                                            body.include_usage, plan)  # fmt: skip
        return await _answer(
            request, serving, prompt, params, explicit, "chatcmpl", "chat.completion", body.stream,
            body.include_usage, body.kv_transfer_params, lambda d: _chat_chunk_choice(d, k),
            lambda o: {
                "index": o.index,
                **_chat_message(o, plan),
                "logprobs": {"content": _chat_logprobs(o.logprobs, k)} if k is not None else None,
            },
        )  # fmt: skip

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        body, serving = await parse_for_model(request, CompletionRequest, generative)
        params = body.to_sampling_params()
        await serving.check_structured(params, body.structured_param)
        explicit = "max_tokens" in body.model_fields_set
        k = params.logprobs
        return await _answer(
            request, serving, body.single_prompt(), params, explicit, "cmpl", "text_completion", body.stream,
            body.include_usage, body.kv_transfer_params, lambda d: _text_choice(d, k),
            lambda o: {
                "index": o.index,
                "text": o.text,
                "logprobs": _text_logprobs(o.logprobs, k) if k is not None else None,
                "finish_reason": finish_reason(o),
            },
        )  # fmt: skip

    return router


async def _answer(
    request: Request,
    serving: Serving,
    prompt: str | list[int],
    params: SamplingParams,
    explicit_max: bool,
    id_prefix: str,
    kind: str,
    stream: bool,
    include_usage: bool,
    kv_transfer: dict | None,
    chunk_choice: Callable[[ChoiceDelta], dict[str, Any]],
    full_choice: Callable[[CompletionOutput], dict[str, Any]],
) -> Any:
    """Run the request; an SSE stream of `kind` chunks, or the whole `kind` object (with
    `kv_transfer_params` on a prefill worker's answer)."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    ids, deltas = serving.generate(prompt, params, request_id, explicit_max, kv_transfer, stream)
    head = {"id": request_id, "created": int(time.time()), "model": serving.model_name}
    if stream:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        return _stream(deltas, head, chunk_kind, include_usage, params.n, chunk_choice)
    final = await until_finished(request, deltas, ids)
    choices = [full_choice(o) for o in final.outputs]
    answer = {**head, "object": kind, "choices": choices, "usage": output_usage(final)}
    if final.kv_transfer_params is not None:
        answer["kv_transfer_params"] = final.kv_transfer_params
    return answer


def _stream(
    deltas: AsyncIterator[RequestDelta],
    head: dict[str, Any],
    kind: str,
    include_usage: bool,
    n: int,
    choice: Any,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        base = {**head, "object": kind}
        extra = {"usage": None} if include_usage else {}
        if kind == "chat.completion.chunk":
            # The first chunk of each choice carries the role, as OpenAI's does.
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in range(n)]  # fmt: skip
            yield sse({**base, "choices": roles, **extra})
        last, completion_tokens, held = None, 0, HeldTokens()
        try:
            async for delta in deltas:
                last = delta
                completion_tokens += sum(len(c.token_ids) for c in delta.choices)
                if ready := held.ready(delta):
                    yield sse({**base, "choices": [choice(c) for c in ready], **extra})
        except InfireError as e:  # the stream has started: the error goes in an event
            yield sse(error_body(e))
            return
        if include_usage and last is not None:
            counts = usage(last.num_prompt_tokens, completion_tokens, last.num_cached_tokens)
            yield sse({**base, "choices": [], "usage": counts})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _chat_message(output: CompletionOutput, plan: tools.ToolPlan | None) -> dict[str, Any]:
    """A chat choice's message and finish_reason: its tool calls when it made any."""
    content, calls = output.text, []
    if plan is not None and output.finish_reason != "length":
        content, calls = plan.calls(output.text)
    if not calls:
        return {"message": {"role": "assistant", "content": output.text},
                "finish_reason": finish_reason(output)}  # fmt: skip
    return {"message": {"role": "assistant", "content": content, "tool_calls": calls},
            "finish_reason": "tool_calls"}  # fmt: skip


async def _stream_tool_calls(
    request: Request, serving: Serving, prompt: list[int], params: SamplingParams,
    explicit_max: bool, include_usage: bool, plan: tools.ToolPlan,
) -> StreamingResponse:  # fmt: skip
    """A chat stream with tools, in OpenAI's layout: each call's index, id, type and name
    first, then its argument fragments as they are generated (a tools.CallStream per
    choice says when an auto answer is content and when it is held)."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    ids, deltas = serving.generate(prompt, params, request_id, explicit_max, stream=True)
    base = {"id": request_id, "created": int(time.time()), "model": serving.model_name,
            "object": "chat.completion.chunk"}  # fmt: skip
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return sse({**base, "choices": [choice], **extra})

    async def events() -> AsyncIterator[str]:
        calls = [tools.CallStream(plan) for _ in range(params.n)]
        tokens = 0
        try:
            for index, stream in enumerate(calls):
                yield chunk(index, {"role": "assistant", "content": None})
                for delta in stream.start():
                    yield chunk(index, delta)
            async for update in deltas:
                for choice in update.choices:
                    tokens += len(choice.token_ids)
                    for delta in calls[choice.index].feed(choice.text):
                        yield chunk(choice.index, delta)
                    if choice.finish_reason:
                        last, reason = calls[choice.index].finish(choice.finish_reason)
                        for delta in last:
                            yield chunk(choice.index, delta)
                        yield chunk(choice.index, {}, reason)
        except InfireError as e:
            yield sse(error_body(e))
            return
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(ids), tokens, 0)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _chat_chunk_choice(delta: ChoiceDelta, k: int | None) -> dict[str, Any]:
    logprobs = {"content": _chat_logprobs(delta.logprobs, k)} if k is not None else None
    return {
        "index": delta.index,
        "delta": {"content": delta.text} if delta.text or not delta.finish_reason else {},
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
    }


def _text_choice(delta: ChoiceDelta, k: int | None) -> dict[str, Any]:
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": _text_logprobs(delta.logprobs, k) if k is not None else None,
        "finish_reason": delta.finish_reason,
    }


def _top(step: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens of a step (the sampled one, first in the dict, if among them)."""
    return sorted((e for e in step.values() if e.rank <= k), key=lambda e: e.rank)


def _chat_logprobs(steps: list[dict[int, Logprob]] | None, k: int) -> list[dict]:
    """Chat logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def entry(e: Logprob) -> dict:
        return {
            "token": e.decoded_token,
            "logprob": e.logprob,
            "bytes": list(e.decoded_token.encode()),
        }

    return [
        {**entry(next(iter(step.values()))), "top_logprobs": [entry(e) for e in _top(step, k)]}
        for step in steps or []
    ]


def _text_logprobs(steps: list[dict[int, Logprob]] | None, k: int) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for step in steps or []:
        sampled = next(iter(step.values()))
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        tops.append({e.decoded_token: e.logprob for e in _top(step, k)})
        offsets.append(offset)
        offset += len(sampled.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip
