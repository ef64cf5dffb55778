"""The response cache, on SQLite and on a real Redis: hits replay the same bytes, TTLs
expire, skip-cache and custom keys work, concurrent identical misses collapse to one
upstream call. Upstream calls are counted by the upstream's own generated-token counter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_harness import Gateway
from harness import TINY_NAME, Server

TOKENS = 5  # every request generates exactly this many (ignore_eos)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def gateway(request: pytest.FixtureRequest, infire_upstream: Server,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:  # fmt: skip
    cache = ""
    if request.param == "redis":
        cache = f'[store]\nredis_url = "{request.getfixturevalue("redis_url")}"\n'
    config = f"""
[gateways.main]
[providers.local]
kind = "infire"
base_url = "{infire_upstream.url}"
{cache}"""
    gw = Gateway(config, tmp_path_factory.mktemp(f"gateway-cache-{request.param}"))
    yield gw
    gw.stop()


def _generated(upstream: Server) -> float:
    return upstream.metrics()["infire:generation_tokens_total"]


def _body(content: str, stream: bool = False) -> dict:
    return {"model": f"local/{TINY_NAME}", "messages": [{"role": "user", "content": content}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def _post(gw: Gateway, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/main/compat/chat/completions", json=body, timeout=60,
                      headers=headers)  # fmt: skip


def test_second_identical_request_is_a_hit(gateway: Gateway, infire_upstream: Server):
    before = _generated(infire_upstream)
    body = _body(f"cache me {time.time()}")
    first = _post(gateway, body, **{"cf-aig-cache-ttl": "60"})
    second = _post(gateway, body, **{"cf-aig-cache-ttl": "60"})
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert second.headers["cf-aig-cache-status"] == "HIT"
    assert second.content == first.content  # the same bytes
    assert second.headers["cf-aig-log-id"] != first.headers["cf-aig-log-id"]
    assert _generated(infire_upstream) - before == TOKENS  # one upstream call
    no_ttl = _post(gateway, body)  # caching is off unless asked (gateway default 0)
    assert "cf-aig-cache-status" not in no_ttl.headers
    assert _generated(infire_upstream) - before == 2 * TOKENS


def test_streamed_answer_is_replayed_as_the_same_stream(gateway: Gateway, infire_upstream: Server):
    before = _generated(infire_upstream)
    body = _body(f"stream me {time.time()}", stream=True)
    answers = []
    for _ in range(2):
        with httpx.stream("POST", f"{gateway.url}/main/compat/chat/completions", json=body,
                          headers={"cf-aig-cache-ttl": "60"}, timeout=60) as r:  # fmt: skip
            answers.append((r.headers["cf-aig-cache-status"], r.headers["content-type"],
                            r.read()))  # fmt: skip
    assert [a[0] for a in answers] == ["MISS", "HIT"]
    assert answers[1][1].startswith("text/event-stream")
    assert answers[1][2] == answers[0][2] and answers[0][2].endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in answers[1][2]  # the usage the gateway asked for stays out
    assert _generated(infire_upstream) - before == TOKENS


def test_skip_cache_ttl_expiry_and_custom_keys(gateway: Gateway, infire_upstream: Server):
    body = _body(f"expire me {time.time()}")
    assert (
        _post(gateway, body, **{"cf-aig-cache-ttl": "1"}).headers["cf-aig-cache-status"] == "MISS"
    )
    before = _generated(infire_upstream)
    skipped = _post(gateway, body, **{"cf-aig-cache-ttl": "1", "cf-aig-skip-cache": "true"})
    assert "cf-aig-cache-status" not in skipped.headers
    assert _generated(infire_upstream) - before == TOKENS  # went upstream
    time.sleep(1.5)
    assert (
        _post(gateway, body, **{"cf-aig-cache-ttl": "1"}).headers["cf-aig-cache-status"] == "MISS"
    )
    key = {"cf-aig-cache-ttl": "60", "cf-aig-cache-key": f"greeting-{time.time()}"}
    first = _post(gateway, _body("hello one"), **key)
    other = _post(gateway, _body("a different question"), **key)
    assert other.headers["cf-aig-cache-status"] == "HIT" and other.content == first.content
    # another client's credentials never see this client's entries
    mine = _body(f"private {time.time()}")
    _post(gateway, mine, **{"cf-aig-cache-ttl": "60", "authorization": "Bearer alice"})
    theirs = _post(gateway, mine, **{"cf-aig-cache-ttl": "60", "authorization": "Bearer bob"})
    assert theirs.headers["cf-aig-cache-status"] == "MISS"


def test_concurrent_identical_misses_collapse_to_one_upstream_call(
    gateway: Gateway, infire_upstream: Server
):
    body = _body(f"all at once {time.time()}")
    before = _generated(infire_upstream)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(
                client.post(f"{gateway.url}/main/compat/chat/completions", json=body,
                            headers={"cf-aig-cache-ttl": "60"})
                for _ in range(12)
            ))  # fmt: skip

    answers = asyncio.run(burst())
    assert all(a.status_code == 200 for a in answers)
    assert len({a.content for a in answers}) == 1
    statuses = sorted(a.headers["cf-aig-cache-status"] for a in answers)
    assert statuses == ["HIT"] * 11 + ["MISS"]
    assert _generated(infire_upstream) - before == TOKENS
