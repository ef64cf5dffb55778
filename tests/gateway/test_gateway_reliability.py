"""Retries, backoff, timeouts, fallbacks, the circuit breaker and stream relaying, against
the scripted fault upstream (tests/gateway/fault_upstream.py). Timings are asserted as
lower bounds, or relative to each other, never as upper limits on this noisy machine."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_upstream import FaultUpstream
from gateway_harness import Gateway

KEY_A, KEY_B = "sk-a-secret-0001", "sk-b-secret-0002"
MODEL = "fault-model"


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultUpstream]:
    with FaultUpstream() as server:
        yield server


def _config(upstream: FaultUpstream, failures: int) -> str:
    providers = "".join(
        f"""
[providers.{name}]
kind = "openai"
base_url = "{upstream.base_url}"
api_key_env = "{env}"
"""
        for name, env in (("a", "KEY_A"), ("b", "KEY_B"), ("c", "KEY_B"))
    )
    return f"""
[gateways.main]
request_timeout_ms = 5000

[circuit_breaker]
failures = {failures}
cooldown_s = 1.5

[prices."a/{MODEL}"]
input = 3.0
output = 5.0
{providers}"""


@pytest.fixture(scope="module")
def gateway(upstream: FaultUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Its circuit breaker never opens in these tests (but in the breaker's own)."""
    gw = Gateway(_config(upstream, 1000), tmp_path_factory.mktemp("gateway-faults"),
                 env={"KEY_A": KEY_A, "KEY_B": KEY_B})  # fmt: skip
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean(upstream: FaultUpstream) -> None:
    upstream.reset()


def _chat(content: str = "hello there", **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _calls(upstream: FaultUpstream, key: str) -> list[dict]:
    return [c for c in upstream.calls() if c["headers"].get("x-fault-key") == key]


def _row(gw: Gateway, log_id: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        db = sqlite3.connect(gw.config_path.parent / "gateway.db")
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM requests WHERE id = ?", (log_id,)).fetchone()
        db.close()
        if row is not None or time.monotonic() > deadline:
            assert row is not None, f"no log row {log_id}"
            return dict(row)
        time.sleep(0.05)


def _post(gw: Gateway, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, headers=headers, timeout=30)


def test_streams_pass_through_without_buffering(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["slow-stream:300"], key="paced")
    start = time.monotonic()
    arrivals = []
    with httpx.stream("POST", f"{gateway.url}/main/a/chat/completions",
                      json=_chat("one two three four five", stream=True),
                      headers={"x-fault-key": "paced"}, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.monotonic() - start)
    # 300 ms between upstream events: the first reached the client long before the last
    assert len(arrivals) >= 6 and arrivals[-1] - arrivals[0] >= 1.2
    assert arrivals[0] < arrivals[-1] - 1.0


def test_retries_with_backoff_then_success(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["status:500", "status:502", "ok"], key="retry")
    start = time.monotonic()
    r = _post(gateway, "/main/a/chat/completions", _chat(), **{
        "x-fault-key": "retry", "cf-aig-max-attempts": "3", "cf-aig-retry-delay": "200",
        "cf-aig-backoff": "linear"})  # fmt: skip
    elapsed = time.monotonic() - start
    assert (
        r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: hello there"
    )
    assert len(_calls(upstream, "retry")) == 3
    assert elapsed >= 0.6  # linear: 200 ms, then 400 ms
    row = _row(gateway, r.headers["cf-aig-log-id"])
    assert (row["attempts"], row["status"], row["step"]) == (3, 200, 0)


def test_exponential_backoff_and_retry_after(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["status:503", "status:503", "status:503", "ok"], key="exp")
    start = time.monotonic()
    r = _post(gateway, "/main/a/chat/completions", _chat(), **{
        "x-fault-key": "exp", "cf-aig-max-attempts": "4", "cf-aig-retry-delay": "100",
        "cf-aig-backoff": "exponential"})  # fmt: skip
    assert r.status_code == 200 and time.monotonic() - start >= 0.7  # 100 + 200 + 400 ms
    upstream.script(["status:429:retry-after=1", "ok"], key="later")
    start = time.monotonic()
    r = _post(gateway, "/main/a/chat/completions", _chat(),
              **{"x-fault-key": "later", "cf-aig-max-attempts": "2"})  # fmt: skip
    assert r.status_code == 200 and time.monotonic() - start >= 1.0  # the upstream's Retry-After


def test_client_errors_are_never_retried(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["status:400", "ok"], key="bad")
    r = _post(gateway, "/main/a/chat/completions", _chat(),
              **{"x-fault-key": "bad", "cf-aig-max-attempts": "3"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert len(_calls(upstream, "bad")) == 1


def test_timeout_then_fallback_to_the_next_step(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["slow:3000"], key="sleepy")
    steps = [
        {"provider": "a", "endpoint": "chat/completions", "headers": {"x-fault-key": "sleepy"},
         "query": _chat(), "config": {"requestTimeout": 300}},
        {"provider": "b", "endpoint": "chat/completions", "headers": {"x-fault-key": "fine"},
         "query": _chat("second")},
    ]  # fmt: skip
    r = _post(gateway, "/main", steps)
    assert r.status_code == 200 and r.headers["cf-aig-step"] == "1"
    assert r.json()["choices"][0]["message"]["content"] == "echo: second"
    row = _row(gateway, r.headers["cf-aig-log-id"])
    assert (row["provider"], row["step"], row["attempts"]) == ("b", 1, 2)
    assert row["error"] is None  # answered: the failed attempts are counted, not an error


def test_fallback_order_and_all_failing(gateway: Gateway, upstream: FaultUpstream):
    upstream.script(["status:500"], key="s0")
    upstream.script(["drop"], key="s1")
    steps = [
        {"provider": "a", "endpoint": "chat/completions", "headers": {"x-fault-key": "s0"},
         "query": _chat()},
        {"provider": "b", "endpoint": "chat/completions", "headers": {"x-fault-key": "s1"},
         "query": _chat()},
        {"provider": "c", "endpoint": "chat/completions", "headers": {"x-fault-key": "s2"},
         "query": _chat("third")},
    ]  # fmt: skip
    r = _post(gateway, "/main", steps)
    assert r.status_code == 200 and r.headers["cf-aig-step"] == "2"
    assert [len(_calls(upstream, k)) for k in ("s0", "s1", "s2")] == [1, 1, 1]
    # every step failing: the last provider error answer comes back as it was
    upstream.script(["status:500"], key="f0")
    upstream.script(["status:503"], key="f1")
    failing = [{**steps[0], "headers": {"x-fault-key": "f0"}},
               {**steps[1], "headers": {"x-fault-key": "f1"}}]  # fmt: skip
    r = _post(gateway, "/main", failing)
    assert r.status_code == 503 and r.json()["error"]["message"] == "scripted fault: status 503"
    # only dropped connections: 502 in OpenAI's shape, naming each failure
    upstream.script(["drop"], key="d0")
    r = _post(gateway, "/main/a/chat/completions", _chat(), **{"x-fault-key": "d0"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    assert "step 0 (a)" in r.json()["error"]["message"]
    upstream.script(["slow:2000"], key="t0")
    r = _post(gateway, "/main/a/chat/completions", _chat(),
              **{"x-fault-key": "t0", "cf-aig-request-timeout": "200"})  # fmt: skip
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_a_stream_that_breaks_off_upstream_breaks_off_for_the_client(
    gateway: Gateway, upstream: FaultUpstream
):
    upstream.script(["drop-mid-stream"], key="cut")
    received = []
    log_id = None
    with (  # noqa: PT012 (the error comes while reading)
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", f"{gateway.url}/main/a/chat/completions",
                     json=_chat("a b c d e f g", stream=True),
                     headers={"x-fault-key": "cut"}, timeout=30) as r,
    ):  # fmt: skip
        log_id = r.headers["cf-aig-log-id"]
        for line in r.iter_lines():
            received.append(line)
    assert any(line.startswith("data:") for line in received)
    assert "broke off" in _row(gateway, log_id)["error"]
    # the gateway keeps serving
    assert _post(gateway, "/main/a/chat/completions", _chat()).status_code == 200


def test_a_whole_answer_that_breaks_off_upstream_is_a_502(
    gateway: Gateway, upstream: FaultUpstream
):
    # not a stream: the gateway reads the answer whole, so half of it is never relayed
    upstream.script(["drop-mid-stream"], key="half")
    r = _post(gateway, "/main/a/chat/completions", _chat("a b c"), **{"x-fault-key": "half"})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert "broke off" in r.json()["error"]["message"]
    row = _row(gateway, r.headers["cf-aig-log-id"])
    assert row["status"] == 502 and "broke off" in row["error"]
    assert _post(gateway, "/main/a/chat/completions", _chat()).status_code == 200


def test_circuit_breaker_skips_a_failing_provider_for_its_cooldown(
    upstream: FaultUpstream, tmp_path: Path
):
    gateway = Gateway(_config(upstream, 5), tmp_path, env={"KEY_A": KEY_A, "KEY_B": KEY_B})
    try:
        _trip_and_recover(gateway, upstream)
    finally:
        gateway.stop()


def _trip_and_recover(gateway: Gateway, upstream: FaultUpstream) -> None:
    upstream.script(["status:500"] * 5, key="flaky")
    for _ in range(5):
        r = _post(gateway, "/main/c/chat/completions", _chat(), **{"x-fault-key": "flaky"})
        assert r.status_code == 500
    r = _post(gateway, "/main/c/chat/completions", _chat(), **{"x-fault-key": "flaky"})
    assert r.status_code == 502 and "circuit open" in r.json()["error"]["message"]
    assert len(_calls(upstream, "flaky")) == 5  # the sixth never went upstream
    # another provider is not affected; after the cool-down c is tried again
    assert _post(gateway, "/main/a/chat/completions", _chat()).status_code == 200
    time.sleep(1.6)
    r = _post(gateway, "/main/c/chat/completions", _chat(), **{"x-fault-key": "flaky"})
    assert r.status_code == 200


def test_stream_usage_and_cost_are_logged(gateway: Gateway, upstream: FaultUpstream):
    with httpx.stream("POST", f"{gateway.url}/main/compat/chat/completions",
                      json={**_chat("count these five words"), "model": f"a/{MODEL}",
                            "stream": True}, timeout=30) as r:  # fmt: skip
        log_id = r.headers["cf-aig-log-id"]
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in e for e in events)  # asked upstream, removed for the client
    sent = upstream.calls()[-1]["body"]
    assert sent["stream_options"] == {"include_usage": True} and sent["model"] == MODEL
    row = _row(gateway, log_id)
    assert (row["tokens_in"], row["tokens_out"]) == (4, 5)  # "echo: count these five words"
    assert row["cost"] == pytest.approx((4 * 3.0 + 5 * 5.0) / 1e6)
    assert row["stream"] == 1 and row["provider"] == "a" and row["model"] == MODEL


def test_provider_keys_reach_the_upstream_only(gateway: Gateway, upstream: FaultUpstream):
    r = _post(
        gateway,
        "/main/a/chat/completions",
        _chat(),
        **{"authorization": "Bearer client-token", "cf-aig-metadata": '{"team": "x"}'},
    )
    call = upstream.calls()[-1]
    assert call["headers"]["authorization"] == f"Bearer {KEY_A}"  # the provider's key, not ours
    assert not any(k.startswith("cf-aig-") for k in call["headers"])
    assert KEY_A not in r.text and all(KEY_A not in v for v in r.headers.values())
    db = sqlite3.connect(gateway.config_path.parent / "gateway.db")
    dump = json.dumps(db.execute("SELECT * FROM requests").fetchall())
    assert KEY_A not in dump and KEY_B not in dump
    assert KEY_A not in gateway.log.read_text() and KEY_B not in gateway.log.read_text()
    assert _row(gateway, r.headers["cf-aig-log-id"])["metadata"] == '{"team": "x"}'


def test_a_client_that_goes_away_mid_stream_is_still_logged(
    gateway: Gateway, upstream: FaultUpstream
):
    # 2 s between events: the whole stream takes over 14 s, so a row within _row's 5 s
    # shows that the gateway stopped relaying (and reading upstream) when the client left
    upstream.script(["slow-stream:2000"], key="leaver")
    with httpx.stream("POST", f"{gateway.url}/main/a/chat/completions",
                      json=_chat("one two three four five six", stream=True),
                      headers={"x-fault-key": "leaver"}, timeout=30) as r:  # fmt: skip
        log_id = r.headers["cf-aig-log-id"]
        next(r.iter_lines())  # one line, then hang up
    row = _row(gateway, log_id)
    assert row["status"] == 200 and "client went away" in row["error"]
    assert _post(gateway, "/main/a/chat/completions", _chat()).status_code == 200


def test_access_log_lines_and_no_access_log(
    gateway: Gateway, upstream: FaultUpstream, tmp_path: Path
):
    r = _post(gateway, "/main/a/chat/completions", _chat())
    log_id = r.headers["cf-aig-log-id"]
    _row(gateway, log_id)  # logged, so its stderr line went out before
    line = next(json.loads(line.split(" infire.gateway.access ", 1)[1])
                for line in gateway.output().splitlines() if log_id in line)  # fmt: skip
    assert line["status"] == 200 and line["provider"] == "a" and line["error"] is None
    quiet = Gateway(_config(upstream, 1000), tmp_path, env={"KEY_A": KEY_A, "KEY_B": KEY_B},
                    args=["--no-access-log"])  # fmt: skip
    try:
        r = _post(quiet, "/main/a/chat/completions", _chat())
        assert _row(quiet, r.headers["cf-aig-log-id"])["status"] == 200  # still in the store
        assert r.headers["cf-aig-log-id"] not in quiet.output()
    finally:
        quiet.stop()
