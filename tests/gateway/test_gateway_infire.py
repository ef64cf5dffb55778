"""The gateway in front of a real `infire serve`: pass-through, unified and universal
routes, streaming, usage logging, and bad input."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import openai
import pytest
from gateway_harness import Gateway
from harness import TINY_NAME, Server, sse_events

KEY = "sk-upstream-secret-123"


@pytest.fixture(scope="module")
def gateway(infire_upstream: Server, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gateway")
    config = f"""
[store]
path = "log.db"

[gateways.main]
request_timeout_ms = 20000

[providers.local]
kind = "infire"
base_url = "{infire_upstream.url}"
api_key_env = "UPSTREAM_KEY"

[prices."local/{TINY_NAME}"]
input = 1.0
output = 2.0
"""
    gw = Gateway(config, folder, env={"UPSTREAM_KEY": KEY})
    yield gw
    gw.stop()


def _rows(gw: Gateway) -> list[dict]:
    db = sqlite3.connect(gw.config_path.parent / "log.db")
    db.row_factory = sqlite3.Row
    return [dict(r) for r in db.execute("SELECT * FROM requests ORDER BY created")]


def _row(gw: Gateway, **match: object) -> dict:
    """The newest log row with these values (a streamed answer's row is written once the
    stream has ended: wait up to 5 s for it)."""
    deadline = time.monotonic() + 5
    while True:
        found = [r for r in _rows(gw) if all(r[k] == v for k, v in match.items())]
        if found or time.monotonic() > deadline:
            assert found, f"no log row with {match}"
            return found[-1]
        time.sleep(0.05)


def test_passthrough_equals_calling_the_upstream(gateway: Gateway, infire_upstream: Server):
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    direct = httpx.post(f"{infire_upstream.base_url}/chat/completions", json=body).json()
    r = httpx.post(f"{gateway.url}/main/local/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == direct["choices"]
    for key in ("prompt_tokens", "completion_tokens"):  # (the second call hits the prefix cache)
        assert r.json()["usage"][key] == direct["usage"][key]
    assert r.headers["cf-aig-step"] == "0" and len(r.headers["cf-aig-log-id"]) == 32
    row = _row(gateway, id=r.headers["cf-aig-log-id"])
    usage = direct["usage"]
    assert (row["provider"], row["model"], row["status"]) == ("local", TINY_NAME, 200)
    assert (row["tokens_in"], row["tokens_out"]) == (usage["prompt_tokens"],
                                                     usage["completion_tokens"])  # fmt: skip
    assert row["cost"] == pytest.approx(
        (usage["prompt_tokens"] * 1 + usage["completion_tokens"] * 2) / 1e6
    )


def test_openai_client_through_the_unified_route(gateway: Gateway, infire_upstream: Server):
    client = openai.OpenAI(base_url=f"{gateway.url}/main/compat", api_key="unused")
    direct = openai.OpenAI(base_url=infire_upstream.base_url, api_key="unused")
    messages = [{"role": "user", "content": "name a color"}]
    ours = client.chat.completions.create(model=f"local/{TINY_NAME}", messages=messages,
                                          max_tokens=10, temperature=0)  # fmt: skip
    theirs = direct.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=10,
                                            temperature=0)  # fmt: skip
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    stream = client.chat.completions.create(model=f"local/{TINY_NAME}", messages=messages,
                                            max_tokens=10, temperature=0, stream=True)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == theirs.choices[0].message.content
    # the gateway asked upstream for usage and took it back out of the client's stream
    assert all(c.choices and c.usage is None for c in chunks)
    row = _row(gateway, stream=1, endpoint="compat/chat/completions")
    assert row["tokens_out"] == theirs.usage.completion_tokens
    assert row["tokens_in"] == theirs.usage.prompt_tokens


def test_stream_with_include_usage_is_left_as_asked(gateway: Gateway):
    body = {"model": f"local/{TINY_NAME}", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{gateway.url}/main/compat/chat/completions", json=body,
                      timeout=30) as r:  # fmt: skip
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6


def test_universal_route_falls_back_past_a_dead_provider(gateway: Gateway):
    steps = [
        {"provider": "local", "endpoint": "v1/chat/nowhere", "query": {}},  # 404: not retried
    ]
    r = httpx.post(f"{gateway.url}/main", json=steps, timeout=30)
    assert r.status_code == 404  # the provider's own answer, passed through
    query = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    steps = [{"provider": "local", "endpoint": "v1/chat/completions", "query": query}]
    r = httpx.post(f"{gateway.url}/main", json=steps, timeout=30)
    assert r.status_code == 200 and r.headers["cf-aig-step"] == "0"
    assert r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/main/compat/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/main/compat/chat/completions", b'{"model": "nope/x"}', 404, "unknown provider"),
        ("/main/compat/chat/completions", b'{"model": "plain"}', 400, "provider/model"),
        ("/nogateway/local/v1/chat/completions", b"{}", 404, "unknown gateway"),
        ("/main/elsewhere/v1/chat/completions", b"{}", 404, "unknown provider"),
        ("/main", b'{"provider": "local"}', 400, "JSON array of steps"),
        ("/main", b"[1]", 400, "step 0 is not an object"),
        ("/main", b'[{"provider": "ghost", "endpoint": "x"}]', 404, "unknown provider"),
        (
            "/main",
            b'[{"provider": "local", "endpoint": "x", "headers": {"x-a": "1\\r\\nx-b: 2"}}]',
            400,
            "step 0: header 'x-a' has a line break",
        ),
        (
            "/main",
            b'[{"provider": "local", "endpoint": "x", "headers": {"bad name": "1"}}]',
            400,
            "step 0: header name 'bad name' is not valid",
        ),
    ],
)
def test_bad_input_is_a_clear_openai_error(gateway: Gateway, path: str, body: bytes,
                                           status: int, fragment: str):  # fmt: skip
    r = httpx.post(gateway.url + path, content=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}
    if not path.startswith("/nogateway"):  # refused requests of a known gateway are logged
        row = _row(gateway, status=status, error=error["message"])
        assert row["gateway"] == "main"


def test_oversized_body_is_413(gateway: Gateway):
    r = httpx.post(f"{gateway.url}/main/local/v1/chat/completions",
                   content=b"x" * (5 * 1024 * 1024), timeout=30)  # fmt: skip
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_the_provider_key_reaches_the_upstream_only(gateway: Gateway):
    # the gateway's answers, its log table and its process output never show the key
    r = httpx.post(f"{gateway.url}/main/local/v1/chat/completions",
                   json={"model": TINY_NAME, "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 2}, timeout=30)  # fmt: skip
    assert KEY not in r.text and all(KEY not in v for v in r.headers.values())
    assert KEY not in json.dumps(_rows(gateway))
    assert KEY not in gateway.log.read_text()
