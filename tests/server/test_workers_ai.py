"""The Workers AI route `/ai/run/{model}`: envelope, stream, aliases and errors."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from harness import TINY_NAME, Server, sse_events

from infire import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_blocks=64)


def run(server: Server, model: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/ai/run/{model}", json=body, timeout=30)


def test_prompt_envelope_equals_the_engine(tiny_server: Server, reference: LLM):
    messages = [{"role": "user", "content": "hello there"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=7))[0]
    for body in ({"prompt": "hello there"}, {"messages": messages}):
        response = run(tiny_server, TINY_NAME, {**body, "temperature": 0, "max_tokens": 7})
        assert response.status_code == 200
        answer = response.json()
        assert answer["success"] is True and answer["errors"] == [] and answer["messages"] == []
        assert answer["result"]["response"] == expected.outputs[0].text
        usage = answer["result"]["usage"]
        assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
        assert usage["completion_tokens"] == len(expected.outputs[0].token_ids)


def test_raw_prompt_skips_the_template(tiny_server: Server, reference: LLM):
    expected = reference.generate("the dog", SamplingParams(temperature=0, max_tokens=5))[0]
    body = {"prompt": "the dog", "raw": True, "temperature": 0, "max_tokens": 5}
    assert run(tiny_server, TINY_NAME, body).json()["result"]["response"] == (
        expected.outputs[0].text
    )


def test_default_max_tokens_is_256_capped_by_context(tiny_server: Server):
    body = {"prompt": "x", "raw": True, "temperature": 0}  # 256 > the tiny context
    assert run(tiny_server, TINY_NAME, body).status_code == 200


def test_stream(tiny_server: Server, reference: LLM):
    expected = reference.generate("the dog", SamplingParams(temperature=0, max_tokens=8))[0]
    body = {"prompt": "the dog", "raw": True, "temperature": 0, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/ai/run/{TINY_NAME}", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    *deltas, last = events[:-1]
    assert all(set(e) == {"response"} for e in deltas)
    assert "".join(e["response"] for e in deltas) == expected.outputs[0].text
    assert last["response"] == ""
    assert last["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)


def test_cf_style_alias(tiny_server: Server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert run(tiny_server, f"@cf/meta/{TINY_NAME}", body).status_code == 200
    assert run(tiny_server, f"@cf/meta/{TINY_NAME.upper()}", body).status_code == 200


def _assert_envelope_error(response: httpx.Response, status: int, code: int | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    [error] = body["errors"]
    assert error["code"] == (code or status) and error["message"]
    assert "Traceback" not in response.text
    return error["message"]


def test_errors_in_the_envelope(tiny_server: Server):
    unknown = run(tiny_server, "@cf/meta/llama-3-8b", {"prompt": "hi"})
    assert "does not exist" in _assert_envelope_error(unknown, 400, code=5007)  # Workers AI's
    _assert_envelope_error(run(tiny_server, TINY_NAME, {}), 400)
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    _assert_envelope_error(run(tiny_server, TINY_NAME, both), 400)
    message = _assert_envelope_error(
        run(tiny_server, TINY_NAME, {"prompt": "a", "temperature": 9}), 400
    )
    assert "temperature" in message
    bad_json = httpx.post(f"{tiny_server.url}/ai/run/{TINY_NAME}", content=b"{")
    _assert_envelope_error(bad_json, 400)
