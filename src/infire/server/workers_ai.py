"""Cloudflare Workers AI-compatible route: POST /ai/run/{model}.

Answers `{"result": {"response", "usage"}, "success": true, "errors": [], "messages": []}`,
or, with `stream: true`, events `data: {"response": "..."}`, a last event with the usage
and `data: [DONE]`. Errors come in the same envelope with `success: false` (errors.py).
Model ids like `@cf/huggingface/smollm2-135m-instruct` name a catalog model (an unknown
one is error 5007); an encoder model takes its task's input (server/encoders.py). A
`prompt` goes through the chat template as one user message unless `raw` is true, as on
Workers AI. The catalog's default parameters of the model apply under the request's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from infire.engine import RequestDelta
from infire.errors import InfireError, InvalidRequestError
from infire.outputs import RequestOutput
from infire.server import encoders, speech, tools
from infire.server.errors import error_body, json_object
from infire.server.openai import SSE_HEADERS, sse
from infire.server.protocol import WorkersAIRequest
from infire.server.serving import Serving, until_finished


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def build_router(models: Callable[[str], Awaitable[Any]], max_audio_seconds: float = 3600.0
                 ) -> APIRouter:  # fmt: skip
    """The /ai/run route over the model `models(model)` gives: a Serving, or an encoder
    (embeddings, reranking, classification: server/encoders.py)."""
    router = APIRouter()

    @router.post("/ai/run/{model:path}")
    async def run(model: str, request: Request) -> Any:
        serving = await models(model)
        if getattr(serving, "task", None) == "automatic-speech-recognition":
            result = await speech.workers_ai_run(serving, request, model, max_audio_seconds)
            return {"result": result, "success": True, "errors": [], "messages": []}
        if not isinstance(serving, Serving):
            result = await encoders.workers_ai_run(serving, request)
            return {"result": result, "success": True, "errors": [], "messages": []}
        raw = json_object(await request.body())
        body = WorkersAIRequest.model_validate({**serving.defaults, **raw})
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        plan = tools.plan(body.openai_tools(), body.tool_choice, None)
        params = body.to_sampling_params()
        param = "response_format"
        grammar = plan.grammar() if plan is not None else None
        if grammar is not None:
            params.structured_output, param = grammar, "tools"
        await serving.check_structured(params, param)
        if body.messages is not None:
            template = serving.client.tokenizer.chat_template
            messages = tools.chat_messages(body.messages, plan, template)
            kwargs = tools.template_kwargs(plan, template)
        else:
            messages, kwargs = [{"role": "user", "content": body.prompt}], {}
            if plan is not None:
                messages = tools.chat_messages([], plan, None) + messages
        raw = body.raw and body.prompt and plan is None
        prompt = body.prompt if raw else serving.encode_chat(messages, **kwargs)
        ids, deltas = serving.generate(prompt, params, f"ai-{uuid.uuid4().hex}",
                                       kv_transfer=body.kv_transfer_params, stream=body.stream)  # fmt: skip
        if body.stream:
            return StreamingResponse(
                _events(deltas, plan), media_type="text/event-stream", headers=SSE_HEADERS
            )
        final: RequestOutput = await until_finished(request, deltas, ids)
        output = final.outputs[0]
        result = {"response": output.text, "usage": _usage(len(ids), len(output.token_ids))}
        if plan is not None and output.finish_reason != "length":
            content, calls = plan.calls(output.text)
            if calls:
                result["response"] = content
                result["tool_calls"] = [{"name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"])}
                                        for c in calls]  # fmt: skip
        if final.kv_transfer_params is not None:  # a prefill worker's leg
            result["kv_transfer_params"] = final.kv_transfer_params
        return {"result": result, "success": True, "errors": [], "messages": []}

    return router


async def _events(
    deltas: AsyncIterator[RequestDelta], plan: tools.ToolPlan | None
) -> AsyncIterator[str]:
    """`{"response": ...}` events as text is generated. With tools, the text goes through
    tools.CallStream (an auto answer's content streams, calls are held); the calls go in
    one event, `{"response": "", "tool_calls": [{"name", "arguments"}]}`, before the last."""
    last, completion, reason = None, 0, None
    calls = tools.CallStream(plan) if plan is not None else None
    found: dict[int, dict] = {}
    _collect(calls.start() if calls else [], found)
    try:
        async for delta in deltas:
            last = delta
            for choice in delta.choices:
                completion += len(choice.token_ids)
                reason = choice.finish_reason or reason
                parts = calls.feed(choice.text) if calls else [{"content": choice.text}]
                for event in _collect(parts, found):
                    yield event
    except InfireError as e:  # the stream has started: the error goes in an event
        yield sse(error_body(e, workers_ai=True))
        return
    if calls is not None:
        parts, reason = calls.finish(reason)
        for event in _collect(parts, found):
            yield event
        if reason == "tool_calls":  # not cut short by max_tokens
            tool_calls = [{"name": c["name"], "arguments": json.loads(c["arguments"])}
                          for c in found.values()]  # fmt: skip
            yield sse({"response": "", "tool_calls": tool_calls})
    if last is not None:
        yield sse({"response": "", "usage": _usage(last.num_prompt_tokens, completion)})
    yield sse("[DONE]")


def _collect(parts: list[dict], found: dict[int, dict]) -> list[str]:
    """The content parts as events; the tool-call parts gathered into `found`."""
    events = []
    for part in parts:
        if part.get("content"):
            events.append(sse({"response": part["content"]}))
        for call in part.get("tool_calls", []):
            into = found.setdefault(call["index"], {"name": None, "arguments": ""})
            into["name"] = call["function"].get("name") or into["name"]
            into["arguments"] += call["function"].get("arguments", "")
    return events
