"""Cloudflare Workers AI-compatible route: POST /ai/run/{model}.

Answers `{"result": {"response", "usage"}, "success": true, "errors": [], "messages": []}`,
or, with `stream: true`, events `data: {"response": "..."}`, a last event with the usage
and `data: [DONE]`. Errors come in the same envelope with `success: false` (errors.py).
Model ids like `@cf/huggingface/smollm2-135m-instruct` name the loaded model. A `prompt`
goes through the chat template as one user message unless `raw` is true, as on Workers AI.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from infire.errors import InvalidRequestError
from infire.outputs import RequestOutput
from infire.server.errors import parse_body
from infire.server.openai import SSE_HEADERS, sse
from infire.server.protocol import WorkersAIRequest
from infire.server.serving import Choices, Serving, until_finished


def _usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def build_router(current: Callable[[], Serving]) -> APIRouter:
    """The /ai/run route over one Serving."""
    router = APIRouter()

    @router.post("/ai/run/{model:path}")
    async def run(model: str, request: Request) -> Any:
        serving = current()
        body = await parse_body(request, WorkersAIRequest)
        serving.check_model(model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        else:
            messages = [{"role": "user", "content": body.prompt}]
        encode_chat = serving.engine.tokenizer.encode_chat
        prompt = body.prompt if body.raw and body.prompt else encode_chat(messages)
        params = body.to_sampling_params()
        ids = serving.prompt_ids(prompt, params, explicit_max=False)
        outputs = serving.generate(ids, params, f"ai-{uuid.uuid4().hex}")
        if body.stream:
            return StreamingResponse(
                _events(outputs), media_type="text/event-stream", headers=SSE_HEADERS
            )
        final = await until_finished(request, outputs)
        result = {"response": final.outputs[0].text, "usage": _usage(final)}
        return {"result": result, "success": True, "errors": [], "messages": []}

    return router


async def _events(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    tracker = Choices()
    final = None
    async for output in outputs:
        final = output
        for delta in tracker.deltas(output):
            if delta.text:
                yield sse({"response": delta.text})
    if final is not None:
        yield sse({"response": "", "usage": _usage(final)})
    yield sse("[DONE]")
