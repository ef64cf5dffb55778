"""Gateway tokens and rate limits, on SQLite and on a real Redis: 401 without a valid
token, exact admission under 50 concurrent requests (requests and tokens, fixed and
sliding windows), 429 in OpenAI's shape with Retry-After, windows that reopen; the read
routes (logs, analytics, metrics, the dashboard's data) behind the admin token."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest
from fault_upstream import FaultUpstream
from gateway_harness import Gateway

TOKEN_A, TOKEN_B = "gw-token-alpha", "gw-token-bravo"
ADMIN = "gw-admin-charlie"


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultUpstream]:
    with FaultUpstream() as server:
        yield server


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def gateway(request: pytest.FixtureRequest, upstream: FaultUpstream,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:  # fmt: skip
    redis = ""
    if request.param == "redis":
        redis = f'redis_url = "{request.getfixturevalue("redis_url")}"'
    config = f"""
[store]
path = "gateway.db"
{redis}

[gateways.locked]
authentication = true

[gateways.open]

[gateways.fixed]
limits = [{{ kind = "requests", limit = 10, window_s = 60, technique = "fixed" }}]

[gateways.sliding]
limits = [{{ kind = "requests", limit = 7, window_s = 2, technique = "sliding" }}]

[providers.up]
kind = "openai"
base_url = "{upstream.base_url}"

[server]
admin_sha256 = "{_sha(ADMIN)}"

[tokens.alpha]
sha256 = "{_sha(TOKEN_A)}"
gateways = ["locked"]

[tokens.bravo]
sha256 = "{_sha(TOKEN_B)}"
gateways = ["open"]
limits = [{{ kind = "tokens", limit = 50, window_s = 60, technique = "sliding" }}]
"""
    gw = Gateway(config, tmp_path_factory.mktemp(f"gateway-limits-{request.param}"))
    yield gw
    gw.stop()


def _chat(max_tokens: int | None = None) -> dict:
    body = {"model": "fault-model", "messages": [{"role": "user", "content": "one two three"}]}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


def _burst(
    gw: Gateway, path: str, n: int, body: dict, headers: dict | None = None
) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(
                client.post(f"{gw.url}{path}", json=body, headers=headers or {})
                for _ in range(n)
            ))  # fmt: skip

    return asyncio.run(run())


def test_authenticated_gateway_needs_a_valid_token(gateway: Gateway):
    url = f"{gateway.url}/locked/up/chat/completions"
    for headers in (
        {},
        {"cf-aig-authorization": "Bearer wrong"},
        {"authorization": f"Bearer {TOKEN_B}"},
    ):  # bravo is not for this gateway
        r = httpx.post(url, json=_chat(), headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for headers in (
        {"cf-aig-authorization": f"Bearer {TOKEN_A}"},
        {"authorization": f"Bearer {TOKEN_A}"},
    ):
        assert httpx.post(url, json=_chat(), headers=headers, timeout=30).status_code == 200
    # tokens are stored hashed: the config file holds no token
    assert TOKEN_A not in gateway.config_path.read_text()
    assert ADMIN not in gateway.config_path.read_text()


def test_read_routes_need_the_admin_token(gateway: Gateway):
    sent = httpx.post(f"{gateway.url}/open/up/chat/completions", json=_chat(), timeout=30)
    log_id = sent.headers["cf-aig-log-id"]
    reads = ["/metrics", "/dashboard/api/gateways", "/open/analytics",
             "/open/analytics/timeseries", "/open/logs", f"/open/logs/{log_id}",
             "/locked/logs", "/nowhere/logs"]  # fmt: skip
    for path in reads:  # no token, a wrong one, a gateway token: 401 (before any 404)
        for headers in ({}, {"authorization": "Bearer wrong"},
                        {"authorization": f"Bearer {TOKEN_B}"}, {"authorization": ADMIN}):  # fmt: skip
            r = httpx.get(f"{gateway.url}{path}", headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "admin token" in r.json()["error"]["message"]
    admin = {"authorization": f"Bearer {ADMIN}"}
    for path in reads[:-1]:
        assert httpx.get(f"{gateway.url}{path}", headers=admin, timeout=30).status_code == 200
    r = httpx.get(f"{gateway.url}/nowhere/logs", headers=admin, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "gateway_not_found"
    cf = {"cf-aig-authorization": f"Bearer {ADMIN}"}
    row = httpx.get(f"{gateway.url}/open/logs/{log_id}", headers=cf, timeout=30).json()
    assert row["id"] == log_id and row["status"] == 200
    # the page itself holds no data; /health neither
    assert httpx.get(f"{gateway.url}/dashboard", timeout=30).status_code == 200
    assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200


def test_request_limit_is_exact_under_50_concurrent_requests(gateway: Gateway):
    answers = _burst(gateway, "/fixed/up/chat/completions", 50, _chat())
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 10 and statuses.count(429) == 40
    refused = next(a for a in answers if a.status_code == 429)
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60


def test_sliding_window_admits_again_as_requests_age_out(gateway: Gateway):
    answers = _burst(gateway, "/sliding/up/chat/completions", 50, _chat())
    assert [a.status_code for a in answers].count(200) == 7
    r = httpx.post(f"{gateway.url}/sliding/up/chat/completions", json=_chat(), timeout=30)
    assert r.status_code == 429 and int(r.headers["retry-after"]) in (1, 2)
    time.sleep(2.2)
    answers = _burst(gateway, "/sliding/up/chat/completions", 10, _chat())
    assert [a.status_code for a in answers].count(200) == 7


def test_token_limit_reserves_max_tokens_then_counts_real_usage(
    gateway: Gateway, upstream: FaultUpstream
):
    """50 tokens a minute for bravo: 50 concurrent requests of max_tokens 5 admit exactly 10
    (the upstream answers slowly, so all are admitted before any usage is known); their
    real usage (3 prompt + 4 completion words = 7 each, 70 in all) then keeps the next one
    out."""
    key = f"slow-{gateway.port}"
    upstream.script(["slow:1000"] * 10, key=key)
    headers = {"cf-aig-authorization": f"Bearer {TOKEN_B}", "x-fault-key": key}
    answers = _burst(gateway, "/open/up/chat/completions", 50, _chat(max_tokens=5), headers)
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 10 and statuses.count(429) == 40
    time.sleep(0.5)  # the last answers' usage is booked when their bodies are done
    r = httpx.post(f"{gateway.url}/open/up/chat/completions", json=_chat(max_tokens=1),
                   headers=headers, timeout=30)  # fmt: skip
    assert r.status_code == 429 and "tokens per 60 s" in r.json()["error"]["message"]
    # without the token, the open gateway has no limit
    assert httpx.post(f"{gateway.url}/open/up/chat/completions", json=_chat(),
                      timeout=30).status_code == 200  # fmt: skip
