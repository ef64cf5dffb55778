"""The fault upstream itself, as a real subprocess: its replies, its SSE layout, each scripted
fault, and what it records. The gateway tests rely on every behaviour checked here."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from fault_upstream import FaultUpstream

MODEL = "fault-model"
CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hello big world"}]}  # fmt: skip
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
DELTAS = [{"role": "assistant", "content": ""}, {"content": "echo:"}, {"content": " hello"},
          {"content": " big"}, {"content": " world"}]  # fmt: skip


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultUpstream]:
    with FaultUpstream(models=[MODEL, "other-model"]) as server:
        yield server


@pytest.fixture
def client(upstream: FaultUpstream) -> Iterator[httpx.Client]:
    upstream.reset()
    with httpx.Client(base_url=upstream.base_url, timeout=10) as client:
        yield client


def events(text: str) -> list[dict | str]:
    """The data payloads of a complete SSE body, checking its exact `data: ...\\n\\n` layout."""
    assert text.endswith("data: [DONE]\n\n")
    blocks = text.split("\n\n")[:-1]
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks)
    payloads = [block[len("data: ") :] for block in blocks]
    return [json.loads(p) for p in payloads[:-1]] + [payloads[-1]]


def with_key(key: str) -> dict[str, str]:
    return {"x-fault-key": key}


def test_chat_completion_echoes_the_last_user_message(client: httpx.Client) -> None:
    body = client.post("/chat/completions", json={**CHAT, "model": "any-name"}).json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "any-name"
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "echo: hello big world"}}]  # fmt: skip
    assert body["usage"] == USAGE


def test_chat_stream_layout(client: httpx.Client) -> None:
    response = client.post("/chat/completions", json={**CHAT, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(response.text)
    assert done == "[DONE]"
    assert [set(chunk) for chunk in chunks] == [{"id", "object", "created", "model", "choices"}] * 6
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], "chat.completion.chunk", chunks[0]["created"], MODEL)
    }
    choices = [chunk["choices"] for chunk in chunks]
    expected = [[{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}] for d in DELTAS]
    assert choices == expected + [
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    ]


def test_chat_stream_with_include_usage(client: httpx.Client) -> None:
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    *chunks, done = events(client.post("/chat/completions", json=request).text)
    assert done == "[DONE]"
    assert [chunk["usage"] for chunk in chunks] == [None] * 6 + [USAGE]
    assert [len(chunk["choices"]) for chunk in chunks] == [1] * 6 + [0]
    assert chunks[5]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == (
        "echo: hello big world"
    )


def test_completions(client: httpx.Client) -> None:
    body = client.post("/completions", json={"model": MODEL, "prompt": "one two"}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "echo: one two"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    request = {"model": MODEL, "prompt": "one two", "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, done = events(client.post("/completions", json=request).text)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["echo:", " one", " two", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_models(client: httpx.Client) -> None:
    body = client.get("/models").json()
    assert body["object"] == "list"
    assert [model["id"] for model in body["data"]] == [MODEL, "other-model"]


@pytest.mark.parametrize(("step", "status", "error_type", "retry_after"), [
    ("status:500", 500, "server_error", None),
    ("status:503:retry-after=7", 503, "server_error", "7"),
    ("status:400", 400, "invalid_request_error", None),
    ("status:401", 401, "authentication_error", None),
    ("status:429:retry-after=2", 429, "rate_limit_error", "2"),
])  # fmt: skip
def test_scripted_status(
    upstream: FaultUpstream,
    client: httpx.Client,
    step: str,
    status: int,
    error_type: str,
    retry_after: str | None,
) -> None:
    upstream.script([step], key="k")
    response = client.post("/chat/completions", json=CHAT, headers=with_key("k"))
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.headers.get("retry-after") == retry_after
    error = response.json()["error"]
    assert set(response.json()) == {"error"}
    assert error == {"message": f"scripted fault: status {status}", "type": error_type,
                     "param": None, "code": None}  # fmt: skip


def test_slow_delays_the_first_byte(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["slow:1500"], key="k")
    start = time.monotonic()
    with client.stream("POST", "/chat/completions", json=CHAT, headers=with_key("k")) as response:
        waited = time.monotonic() - start  # the headers are in: the first byte came
        assert response.status_code == 200
        response.read()
    assert waited >= 1.4
    assert response.json()["choices"][0]["message"]["content"] == "echo: hello big world"


def test_slow_stream_spaces_the_chunks(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["slow-stream:200", "slow-stream:200"], key="k")
    request = {**CHAT, "stream": True}
    arrivals = []
    with client.stream("POST", "/chat/completions", json=request, headers=with_key("k")) as r:
        for line in r.iter_lines():
            if line:
                arrivals.append(time.monotonic())
    assert len(arrivals) == 7
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) >= 0.15, gaps
    # not streaming: a plain success
    response = client.post("/chat/completions", json=CHAT, headers=with_key("k"))
    assert response.json()["usage"] == USAGE


def test_drop_closes_without_a_response(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["drop", "drop"], key="k")
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        client.post("/chat/completions", json=CHAT, headers=with_key("k"))
    with pytest.raises(httpx.TransportError):
        client.post("/chat/completions", json={**CHAT, "stream": True}, headers=with_key("k"))
    assert client.post("/chat/completions", json=CHAT, headers=with_key("k")).status_code == 200
    assert [call["step"] for call in upstream.calls()] == ["drop", "drop", "ok"]
    assert "Traceback" not in upstream.output()


def test_drop_mid_stream_after_two_chunks(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["drop-mid-stream"], key="k")
    received = []
    request = {**CHAT, "stream": True}
    with (
        pytest.raises(httpx.RemoteProtocolError, match="incomplete"),
        client.stream("POST", "/chat/completions", json=request, headers=with_key("k")) as r,
    ):
        assert r.status_code == 200
        received.extend(line for line in r.iter_lines() if line)
    assert [json.loads(line[len("data: ") :])["choices"][0]["delta"] for line in received] == (
        DELTAS[:2]
    )


def test_drop_mid_stream_truncates_a_json_body(
    upstream: FaultUpstream, client: httpx.Client
) -> None:
    upstream.script(["drop-mid-stream"], key="k")
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete|expected"):
        client.post("/chat/completions", json=CHAT, headers=with_key("k"))


def test_steps_are_consumed_in_order_per_key(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["status:500", "status:502"], key="a")
    upstream.script(["status:429"], key="b")
    upstream.script(["ok", "status:503"], key="a")  # appended to a's queue

    def status(headers: dict[str, str]) -> int:
        return client.post("/chat/completions", json=CHAT, headers=headers).status_code

    assert status(with_key("a")) == 500
    assert status({}) == 200  # no key: untouched
    assert status(with_key("unknown")) == 200
    assert status(with_key("b")) == 429
    assert status(with_key("a")) == 502
    assert status(with_key("b")) == 200  # b's queue is empty
    assert [status(with_key("a")) for _ in range(3)] == [200, 503, 200]


def test_model_scripts(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["status:500", "status:429"], model="flaky")
    flaky = {**CHAT, "model": "flaky"}
    assert client.post("/chat/completions", json=CHAT).status_code == 200  # another model
    assert client.post("/chat/completions", json=flaky, headers=with_key("x")).status_code == 200
    assert client.post("/chat/completions", json=flaky).status_code == 500
    assert client.post("/completions", json={"model": "flaky", "prompt": "p"}).status_code == 429
    assert client.post("/chat/completions", json=flaky).status_code == 200


def test_calls_record_the_requests(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["status:500"], key="k")
    headers = {"authorization": "Bearer sk-client-secret", "x-fault-key": "k"}
    client.post("/chat/completions", json=CHAT, headers=headers)
    client.get("/models", params={"limit": "3"})
    first, second = upstream.calls()
    assert (first["method"], first["path"], first["query"]) == ("POST", "/v1/chat/completions", "")
    assert first["headers"]["authorization"] == "Bearer sk-client-secret"
    assert first["headers"]["x-fault-key"] == "k"
    assert first["body"] == CHAT
    assert first["step"] == "status:500"
    assert (second["method"], second["path"], second["query"]) == ("GET", "/v1/models", "limit=3")
    assert second["body"] is None
    assert first["time"] <= second["time"] <= time.time()
    upstream.reset()
    assert upstream.calls() == []


def test_reset_clears_the_scripts(upstream: FaultUpstream, client: httpx.Client) -> None:
    upstream.script(["status:500"], key="k")
    upstream.script(["status:500"], model=MODEL)
    upstream.reset()
    assert client.post("/chat/completions", json=CHAT, headers=with_key("k")).status_code == 200
    assert client.post("/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize(
    "script",
    [
        {"key": "k", "steps": ["explode"]},
        {"key": "k", "steps": ["status:abc"]},
        {"key": "k", "steps": ["status:429:retry=2"]},
        {"key": "k", "steps": ["slow"]},
        {"key": "k", "model": "m", "steps": ["ok"]},
        {"steps": ["ok"]},
    ],
)
def test_bad_scripts_are_refused(upstream: FaultUpstream, script: dict) -> None:
    response = httpx.post(f"{upstream.url}/_script", json=script)
    assert response.status_code == 400
    assert "error" in response.json()


def test_health(upstream: FaultUpstream) -> None:
    assert httpx.get(f"{upstream.url}/health").json() == {"status": "ok"}


def test_delay_ms_holds_every_answer() -> None:
    with FaultUpstream(delay_ms=400) as slow, httpx.Client(base_url=slow.base_url) as client:
        for _ in range(2):  # every answer, not only the first (and after a reset)
            start = time.monotonic()
            r = client.post("/chat/completions", json=CHAT)
            assert r.status_code == 200 and time.monotonic() - start >= 0.4
            slow.reset()
        assert client.get(f"{slow.url}/health").status_code == 200
