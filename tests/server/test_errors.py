"""Every error the server answers, in OpenAI's shape with the right status, and what a
client that goes away leaves behind (nothing)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from harness import TINY_NAME, Server, assert_openai_error

KEY = {"Authorization": "Bearer sk-test-key"}
CHAT = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server: Server, path: str, **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", 30)
    return httpx.post(f"{server.base_url}{path}", **kwargs)


def test_malformed_json(tiny_server: Server):
    for body in (b"{not json", b"", b"\xff\xfe", b"[1, 2]"):
        error = assert_openai_error(post(tiny_server, "/chat/completions", content=body), 400)
        assert error["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"model": None}, "model"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"top_logprobs": 99, "logprobs": True}, "top_logprobs"),
        ({"stop": 5}, "stop"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_invalid_chat_fields(tiny_server: Server, change: dict, param: str):
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    error = assert_openai_error(post(tiny_server, "/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_unsupported_features_say_so(tiny_server: Server):
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}
    error = assert_openai_error(post(tiny_server, "/chat/completions", json=body), 400)
    assert "needs json_schema.schema" in error["message"]
    body = {"model": TINY_NAME, "prompt": ["a", "b"]}
    error = assert_openai_error(post(tiny_server, "/completions", json=body), 400, "prompt")
    assert "not supported yet" in error["message"]


def test_context_too_long(tiny_server: Server):
    body = {**CHAT, "max_tokens": 1000}  # the tiny model's context is 256
    error = assert_openai_error(post(tiny_server, "/chat/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded" and "256" in error["message"]
    long_prompt = {"model": TINY_NAME, "prompt": "x" * 400, "max_tokens": 1}
    error = assert_openai_error(post(tiny_server, "/completions", json=long_prompt), 400)
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_404(tiny_server: Server):
    body = {**CHAT, "model": "gpt-4o"}
    error = assert_openai_error(post(tiny_server, "/chat/completions", json=body), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    client = openai.OpenAI(base_url=tiny_server.base_url, api_key="unused")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_unknown_route_is_404_json(tiny_server: Server):
    response = httpx.get(f"{tiny_server.base_url}/nothing-here")
    assert_openai_error(response, 404)


def test_api_key(guarded_server: Server):
    assert_openai_error(post(guarded_server, "/chat/completions", json=CHAT), 401)
    wrong = {"Authorization": "Bearer sk-wrong"}
    error = assert_openai_error(
        post(guarded_server, "/chat/completions", json=CHAT, headers=wrong), 401
    )
    assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded_server.base_url}/models").status_code == 401
    assert post(guarded_server, "/chat/completions", json=CHAT, headers=KEY).status_code == 200
    assert httpx.get(f"{guarded_server.url}/health").status_code == 200  # probes need no key
    client = openai.OpenAI(base_url=guarded_server.base_url, api_key="sk-test-key")
    assert client.models.list().data[0].id == TINY_NAME
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_server.base_url, api_key="bad").models.list()


def test_body_too_large(guarded_server: Server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    error = assert_openai_error(
        post(guarded_server, "/chat/completions", json=big, headers=KEY), 413
    )
    assert "65536" in error["message"]

    def chunked():  # no content-length: the limit holds while reading
        for _ in range(70):
            yield b"x" * 1024

    response = post(guarded_server, "/chat/completions", content=chunked(), headers=KEY)
    assert_openai_error(response, 413)


def _wait_for(server: Server, condition, timeout: float) -> float:
    """Seconds until condition(metrics) holds; fails after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition(server.metrics()):
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout}s: {server.metrics()}")


def _long_stream(server: Server, close: threading.Event) -> None:
    body = {"model": TINY_NAME, "prompt": "run for a long time", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=KEY,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping it would close the stream now
        next(lines)
        close.wait(60)
    # leaving the block closes the connection mid-stream


def test_overload_is_429_and_disconnects_free_everything(guarded_server: Server):
    # One running sequence at a time, at most two waiting: three long streams fill both.
    close = threading.Event()
    threads = [threading.Thread(target=_long_stream, args=(guarded_server, close))
               for _ in range(3)]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        _wait_for(guarded_server, lambda m: m["infire:num_requests_waiting"] == 2, 30)
        response = post(guarded_server, "/chat/completions", json=CHAT, headers=KEY)
        error = assert_openai_error(response, 429)
        assert error["type"] == "rate_limit_error" and "--max-waiting" in error["message"]
        assert guarded_server.metrics()["infire:kv_cache_usage_perc"] > 0
    finally:
        close.set()
        for thread in threads:
            thread.join(30)
    elapsed = _wait_for(
        guarded_server,
        lambda m: (
            m["infire:num_requests_running"] == 0
            and m["infire:num_requests_waiting"] == 0
            and m["infire:kv_cache_usage_perc"] == 0
        ),
        5,
    )
    assert elapsed < 1.0
    # and the server still answers
    assert post(guarded_server, "/chat/completions", json=CHAT, headers=KEY).status_code == 200


def test_non_streaming_disconnect_aborts(guarded_server: Server):
    body = {"model": TINY_NAME, "prompt": "long", "max_tokens": 4000, "ignore_eos": True}
    errors: list[BaseException] = []

    def impatient() -> None:
        try:
            post(guarded_server, "/completions", json=body, headers=KEY, timeout=1.0)
        except httpx.ReadTimeout as e:  # the client gives up and closes the connection
            errors.append(e)

    thread = threading.Thread(target=impatient)
    thread.start()
    _wait_for(guarded_server, lambda m: m["infire:num_requests_running"] == 1, 5)
    thread.join(10)
    assert len(errors) == 1
    elapsed = _wait_for(
        guarded_server,
        lambda m: m["infire:num_requests_running"] == 0 and m["infire:kv_cache_usage_perc"] == 0,
        5,
    )
    assert elapsed < 1.0


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 300}, {"999999": 1}], ids=["key", "value", "id"])
def test_bad_logit_bias(tiny_server: Server, bias: dict):
    body = {**CHAT, "logit_bias": bias}
    assert_openai_error(post(tiny_server, "/chat/completions", json=body), 400, "logit_bias")
