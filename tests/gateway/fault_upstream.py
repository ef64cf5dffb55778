"""A scripted, fault-injecting OpenAI-compatible upstream for the gateway's integration tests.

`python tests/gateway/fault_upstream.py --port N` serves it on 127.0.0.1; `FaultUpstream` runs
it as a subprocess. It answers /v1/chat/completions, /v1/completions (both also as SSE) and
/v1/models with deterministic replies (`"echo: " + the last user message`, usage counted in
whitespace words), records every /v1 request (`GET /_calls`), and plays scripted faults:
`POST /_script {"key": K, "steps": [...]}` queues steps for requests carrying `x-fault-key: K`,
`{"model": M, "steps": [...]}` for requests without that header whose body names model M; each
request consumes one step, an empty queue means success. `POST /_reset` clears calls and scripts.

Steps: "ok", "status:N" (OpenAI-shaped error body), "status:N:retry-after=S" (plus Retry-After),
"slow:MS" (nothing at all is sent for MS ms), "slow-stream:MS" (MS ms between streamed events
after the first), "drop" (the TCP connection closes before any byte), "drop-mid-stream" (the
headers and part of the body, then the connection closes: two SSE events, or half the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from infire.serverproc import ServerProcess, free_port

FAULT_KEY_HEADER = "x-fault-key"
DEFAULT_MODELS = ("fault-model",)
_TRANSPORT = "fault_upstream.transport"  # scope key: the connection's asyncio transport
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Step:
    """One scripted behaviour: kind is ok, status, slow, slow-stream, drop or drop-mid-stream."""

    kind: str
    status: int = 200
    retry_after: str | None = None
    delay_s: float = 0.0
    text: str = "ok"  # as scripted, for /_calls

    @classmethod
    def parse(cls, text: str) -> Step:
        """A step from its string form; ValueError names what is wrong."""
        kind, _, rest = text.partition(":")
        if kind in ("ok", "drop", "drop-mid-stream") and not rest:
            return cls(kind, text=text)
        if kind in ("slow", "slow-stream") and rest.isdigit():
            return cls(kind, delay_s=int(rest) / 1000, text=text)
        if kind == "status":
            status, _, option = rest.partition(":")
            seconds = option.removeprefix("retry-after=")
            valid_option = not option or (seconds != option and seconds.isdigit())
            if status.isdigit() and 400 <= int(status) <= 599 and valid_option:
                return cls(kind, int(status), seconds or None, text=text)
        raise ValueError(f"unknown step {text!r}; see fault_upstream's docstring for the syntax")


@dataclass(slots=True)
class FaultState:
    """What the server remembers: the calls it received and the queued steps."""

    calls: list[dict] = field(default_factory=list)
    by_key: dict[str, deque[Step]] = field(default_factory=dict)
    by_model: dict[str, deque[Step]] = field(default_factory=dict)

    def next_step(self, key: str | None, model: str | None) -> Step:
        queue = self.by_key.get(key) if key is not None else self.by_model.get(model or "")
        return queue.popleft() if queue else Step("ok")


def _words(text: str) -> int:
    return len(text.split())


def _text_of(content: object) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _tokens(text: str) -> list[str]:
    """The streamed pieces of a reply: one per word, the spaces kept, joining back to it."""
    pieces = text.split(" ")
    return [pieces[0]] + [" " + piece for piece in pieces[1:]]


def _usage(prompt: str, completion: str) -> dict:
    prompt_tokens, completion_tokens = _words(prompt), _words(completion)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def _chat_reply(body: dict) -> tuple[str, str]:
    """(all the prompt text, the reply) for a chat request."""
    messages = body.get("messages") or []
    texts = [_text_of(message.get("content")) for message in messages]
    user = [
        _text_of(message.get("content")) for message in messages if message.get("role") == "user"
    ]
    return " ".join(texts), "echo: " + (user[-1] if user else "")


def _completion_reply(body: dict) -> tuple[str, str]:
    """(the prompt text, the reply) for a legacy completions request."""
    prompt = body.get("prompt", "")
    prompt = " ".join(prompt) if isinstance(prompt, list) else str(prompt)
    return prompt, "echo: " + prompt


def _chat_events(body: dict, head: dict) -> tuple[dict, list[dict]]:
    """The chat.completion object, and the chat.completion.chunk events of the same reply."""
    prompt, reply = _chat_reply(body)
    usage = _usage(prompt, reply)
    completion = {**head, "object": "chat.completion", "choices": [{"index": 0,
                  "message": {"role": "assistant", "content": reply}, "logprobs": None,
                  "finish_reason": "stop"}], "usage": usage}  # fmt: skip
    deltas = [{"role": "assistant", "content": ""}] + [{"content": t} for t in _tokens(reply)]
    choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"})
    return completion, _chunks(body, {**head, "object": "chat.completion.chunk"}, choices, usage)


def _completion_events(body: dict, head: dict) -> tuple[dict, list[dict]]:
    """The text_completion object, and its streamed chunks."""
    prompt, reply = _completion_reply(body)
    usage = _usage(prompt, reply)
    head = {**head, "object": "text_completion"}
    completion = {**head, "choices": [{"index": 0, "text": reply, "logprobs": None,
                  "finish_reason": "stop"}], "usage": usage}  # fmt: skip
    texts = _tokens(reply) + [""]
    choices = [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": None} for text in texts
    ]
    choices[-1]["finish_reason"] = "stop"
    return completion, _chunks(body, head, choices, usage)


def _chunks(body: dict, head: dict, choices: list[dict], usage: dict) -> list[dict]:
    """One chunk per choice; with include_usage, OpenAI's `usage: null` and a usage-only tail."""
    if not (body.get("stream_options") or {}).get("include_usage"):
        return [{**head, "choices": [choice]} for choice in choices]
    chunks = [{**head, "choices": [choice], "usage": None} for choice in choices]
    return chunks + [{**head, "choices": [], "usage": usage}]


def _error(step: Step) -> JSONResponse:
    kind = _ERROR_TYPES.get(
        step.status, "server_error" if step.status >= 500 else "invalid_request_error"
    )
    error = {
        "message": f"scripted fault: status {step.status}",
        "type": kind,
        "param": None,
        "code": None,
    }
    headers = {"retry-after": step.retry_after} if step.retry_after is not None else None
    return JSONResponse({"error": error}, status_code=step.status, headers=headers)


async def _drop_connection(request: Request) -> None:
    """Close the TCP connection under this request and wait until the server has noticed."""
    request.scope[_TRANSPORT].close()
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _paced(
    request: Request, pieces: list[bytes], step: Step, cut_at: int
) -> AsyncIterator[bytes]:
    """The body pieces, spaced by a slow-stream step, or cut after `cut_at` by drop-mid-stream."""
    for index, piece in enumerate(pieces):
        if step.kind == "drop-mid-stream" and index == cut_at:
            await _drop_connection(request)
            return
        if step.kind == "slow-stream" and index > 0:
            await asyncio.sleep(step.delay_s)
        yield piece


async def _respond(request: Request, step: Step, completion: dict, events: list[dict]) -> Response:
    if request.state.body.get("stream"):
        pieces = [f"data: {json.dumps(event)}\n\n".encode() for event in events]
        body = _paced(request, [*pieces, b"data: [DONE]\n\n"], step, cut_at=2)
        return StreamingResponse(body, media_type="text/event-stream")
    if step.kind != "drop-mid-stream":
        return JSONResponse(completion)
    data = json.dumps(completion).encode()
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]
    headers = {"content-length": str(len(data))}
    return StreamingResponse(_paced(request, halves, step, 1), 200, headers, "application/json")


async def _begin(request: Request) -> Step | Response:
    """Record the call and take its step; a Response when the step ends the request here."""
    state: FaultState = request.app.state.faults
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        body = None
    request.state.body = body if isinstance(body, dict) else {}
    key = request.headers.get(FAULT_KEY_HEADER)
    step = state.next_step(key, request.state.body.get("model"))
    state.calls.append({"method": request.method, "path": request.url.path,
                        "query": request.url.query, "headers": dict(request.headers),
                        "body": body, "time": time.time(), "step": step.text})  # fmt: skip
    if request.app.state.delay_s:  # --delay-ms: every answer waits (the benchmark's "LLM")
        await asyncio.sleep(request.app.state.delay_s)
    if step.kind == "slow":
        await asyncio.sleep(step.delay_s)
    if step.kind == "drop":
        await _drop_connection(request)
        return Response()  # never sent: the server drops messages for a closed connection
    return _error(step) if step.kind == "status" else step


def _head(request: Request) -> dict:
    state: FaultState = request.app.state.faults
    model = request.state.body.get("model", DEFAULT_MODELS[0])
    # "object" is filled in per endpoint; it stays second, where OpenAI puts it
    return {"id": f"fault-{len(state.calls)}", "object": "", "created": int(time.time()),
            "model": model}  # fmt: skip


async def chat_completions(request: Request) -> Response:
    step = await _begin(request)
    if isinstance(step, Response):
        return step
    return await _respond(request, step, *_chat_events(request.state.body, _head(request)))


async def completions(request: Request) -> Response:
    step = await _begin(request)
    if isinstance(step, Response):
        return step
    return await _respond(request, step, *_completion_events(request.state.body, _head(request)))


async def models(request: Request) -> Response:
    step = await _begin(request)
    if isinstance(step, Response):
        return step
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "fault-upstream"}
            for name in request.app.state.models]  # fmt: skip
    return await _respond(request, step, {"object": "list", "data": data}, [])


async def script(request: Request) -> Response:
    body = await request.json()
    try:
        steps = [Step.parse(text) for text in body["steps"]]
    except (KeyError, TypeError, ValueError) as error:
        return JSONResponse({"error": f"bad script: {error}"}, status_code=400)
    state: FaultState = request.app.state.faults
    if ("key" in body) == ("model" in body):
        return JSONResponse({"error": "a script names exactly one of key, model"}, 400)
    queues, name = (state.by_key, body["key"]) if "key" in body else (state.by_model, body["model"])
    queues.setdefault(name, deque()).extend(steps)
    return JSONResponse({"queued": len(queues[name])})


async def calls(request: Request) -> Response:
    return JSONResponse(request.app.state.faults.calls)


async def reset(request: Request) -> Response:
    request.app.state.faults = FaultState()
    return JSONResponse({"status": "reset"})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _expose_transport(app: ASGIApp) -> ASGIApp:
    """Put the connection's transport into the scope, so that "drop" can close it before any
    response starts (an exception there would make uvicorn answer 500 instead)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_TRANSPORT] = send.__self__.transport  # uvicorn's RequestResponseCycle.send
        await app(scope, receive, send)

    return wrapped


def build_app(model_names: Sequence[str] = DEFAULT_MODELS, delay_s: float = 0.0) -> ASGIApp:
    """The fault upstream as an ASGI app (served by uvicorn's h11 protocol)."""
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/_script", script, methods=["POST"]),
        Route("/_calls", calls, methods=["GET"]),
        Route("/_reset", reset, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ])  # fmt: skip
    app.state.faults = FaultState()
    app.state.models = list(model_names)
    app.state.delay_s = delay_s
    return _expose_transport(app)


class FaultUpstream(ServerProcess):
    """The fault upstream as a subprocess on a free port; `url` is its root, `base_url` its /v1."""

    def __init__(
        self, models: Sequence[str] = DEFAULT_MODELS, timeout: float = 30.0, delay_ms: int = 0
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        command = [sys.executable, os.path.abspath(__file__), "--port", str(port)]
        command += [arg for name in models for arg in ("--model", name)]
        command += ["--delay-ms", str(delay_ms)]
        super().__init__("fault upstream", command, port, f"{self.url}/health", timeout=timeout)

    def script(
        self, steps: Sequence[str], *, key: str | None = None, model: str | None = None
    ) -> None:
        """Queue steps for requests with `x-fault-key: key`, or for requests naming `model`."""
        target = {"key": key} if key is not None else {"model": model}
        httpx.post(f"{self.url}/_script", json={**target, "steps": list(steps)}).raise_for_status()

    def calls(self) -> list[dict]:
        """The recorded /v1 requests, oldest first."""
        return httpx.get(f"{self.url}/_calls").json()

    def reset(self) -> None:
        """Forget the recorded calls and every queued step."""
        httpx.post(f"{self.url}/_reset").raise_for_status()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", action="append", help="a name /v1/models lists (repeatable)")
    parser.add_argument("--delay-ms", type=int, default=0,
                        help="every /v1 answer waits this long before its first byte")  # fmt: skip
    args = parser.parse_args()
    app = build_app(args.model or DEFAULT_MODELS, args.delay_ms / 1000)
    uvicorn.run(app, host="127.0.0.1", port=args.port, http="h11", log_level="warning")


if __name__ == "__main__":
    main()
