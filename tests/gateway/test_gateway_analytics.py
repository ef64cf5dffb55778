"""Analytics, time series and Prometheus metrics over a real SQLite log filled with
hand-made rows; every expected value is worked out by hand from the rows below."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infire.gateway.analytics import analytics, nearest_rank, render_metrics, timeseries
from infire.gateway.store import LogStore

MINI, GPT4O, LLAMA = ("openai", "gpt-4o-mini"), ("openai", "gpt-4o"), ("workers-ai", "@cf/llama")


def _row(log_id: str, created: float, where: tuple[str, str], gateway: str = "main",
         **fields: Any) -> dict[str, Any]:  # fmt: skip
    return {"id": log_id, "created": created, "gateway": gateway, "provider": where[0],
            "model": where[1], **fields}  # fmt: skip


def _rows() -> list[dict[str, Any]]:
    # gpt-4o-mini: 100 rows at 1000..1099 with the latencies 1..100 ms out of order
    # (37 * i mod 100 is a permutation), a TTFB only where latency <= 40 (so 1..40), 10
    # errors (i % 10 == 0), 20 HIT and 20 MISS, 10 + 2 tokens and $0.25 each.
    mini = []
    for i in range(100):
        latency = float(37 * i % 100 + 1)
        cache = {1: "HIT", 2: "MISS"}.get(i % 5)
        mini.append(_row(f"a{i}", 1000 + i, MINI, status=500 if i % 10 == 0 else 200,
                         latency_ms=latency, ttfb_ms=latency if latency <= 40 else None,
                         tokens_in=10, tokens_out=2, cost=0.25, cache_status=cache))  # fmt: skip
    return [
        *mini,
        _row("b1", 1050, GPT4O, status=200, latency_ms=300.0, ttfb_ms=100.0, tokens_in=100,
             tokens_out=50, cost=1.5, cache_status="MISS"),
        _row("b2", 1060, GPT4O, status=429, latency_ms=20.0, error="rate limited"),
        _row("b3", 1200, GPT4O, status=200, latency_ms=500.0, ttfb_ms=200.0, tokens_in=200,
             tokens_out=100, cost=3.0, cache_status="HIT"),
        _row("c1", 1100, LLAMA, status=200, latency_ms=50.0, ttfb_ms=10.0, tokens_in=5,
             tokens_out=5),  # cost unknown
        _row("c2", 999.5, LLAMA, error="connection refused"),  # no status, no latency
        _row("c3", 1300, LLAMA, status=200, latency_ms=40.0, tokens_in=1, tokens_out=1,
             cost=0.5, cache_status="MISS"),
        _row("s1", 1050, MINI, gateway="staging", status=200, latency_ms=7.0, tokens_in=1000,
             tokens_out=1000, cost=100.0),
        _row("s2", 1051, MINI, gateway="staging", status=503, latency_ms=9.0,
             error="upstream 503"),
    ]  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    store = LogStore(tmp_path / "gateway.db")
    for row in _rows():
        store.insert(row)
    yield store
    store.close()


def test_nearest_rank():
    assert nearest_rank([], 50) is None
    assert nearest_rank([7.0], 99) == 7.0
    values = [float(v) for v in range(1, 101)]
    assert [nearest_rank(values, p) for p in (1, 50, 95, 99, 100)] == [1, 50, 95, 99, 100]
    # 0.07 * 100 is 7.000000000000001 in floats: a float ceil would pick rank 8
    assert nearest_rank(values, 7) == 7
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 50) == 2 and nearest_rank([1.0, 2.0, 3.0], 50) == 2


def test_groups_by_provider_and_model(store: LogStore):
    result = analytics(store, "main", None, None)
    assert (result["gateway"], result["start"], result["end"]) == ("main", None, None)
    groups = result["groups"]
    # 100 rows first; then the two groups of 3 by name
    assert [(g["provider"], g["model"]) for g in groups] == [MINI, GPT4O, LLAMA]
    assert groups[0] == {
        "provider": "openai", "model": "gpt-4o-mini", "requests": 100, "errors": 10,
        "error_rate": 0.1, "tokens_in": 1000, "tokens_out": 200, "cost": 25.0,
        "cache_hits": 20, "cache_hit_rate": 0.5,
        "latency_ms_p50": 50.0, "latency_ms_p95": 95.0, "latency_ms_p99": 99.0,
        "ttfb_ms_p50": 20.0, "ttfb_ms_p95": 38.0,  # ranks ceil(20) and ceil(38) of 1..40
    }  # fmt: skip
    # latencies 20, 300, 500: ranks ceil(1.5) = 2 and ceil(2.85) = 3; TTFBs 100, 200
    assert groups[1] == {
        "provider": "openai", "model": "gpt-4o", "requests": 3, "errors": 1,
        "error_rate": 1 / 3, "tokens_in": 300, "tokens_out": 150, "cost": 4.5,
        "cache_hits": 1, "cache_hit_rate": 0.5,
        "latency_ms_p50": 300.0, "latency_ms_p95": 500.0, "latency_ms_p99": 500.0,
        "ttfb_ms_p50": 100.0, "ttfb_ms_p95": 200.0,
    }  # fmt: skip
    # an error without a status counts; a MISS is a lookup; a null cost adds nothing
    assert groups[2] == {
        "provider": "workers-ai", "model": "@cf/llama", "requests": 3, "errors": 1,
        "error_rate": 1 / 3, "tokens_in": 6, "tokens_out": 6, "cost": 0.5,
        "cache_hits": 0, "cache_hit_rate": 0.0,
        "latency_ms_p50": 40.0, "latency_ms_p95": 50.0, "latency_ms_p99": 50.0,
        "ttfb_ms_p50": 10.0, "ttfb_ms_p95": 10.0,
    }  # fmt: skip


def test_total_over_all_groups(store: LogStore):
    total = analytics(store, "main", None, None)["total"]
    # 106 latencies: 1..100 and 20, 40, 50, 300, 500. Sorted, the extra 20, 40 and 50
    # sit at ranks 21, 42 and 53: p50 is rank 53 (50); p95 is rank 100, which holds 97
    # (51..100 fill ranks 54..103); p99 is rank ceil(103.95) = 104 (300).
    # 43 TTFBs: 1..40 and 10, 100, 200: p50 is rank 22 (21), p95 rank 41 (40).
    assert total == {
        "requests": 106, "errors": 12, "error_rate": 12 / 106, "tokens_in": 1306,
        "tokens_out": 356, "cost": 30.0, "cache_hits": 21, "cache_hit_rate": 21 / 43,
        "latency_ms_p50": 50.0, "latency_ms_p95": 97.0, "latency_ms_p99": 300.0,
        "ttfb_ms_p50": 21.0, "ttfb_ms_p95": 40.0,
    }  # fmt: skip
    assert analytics(store, "main", None, None, "")["total"] == total
    assert analytics(store, "main", None, None, "provider")["total"] == total


def test_group_by_provider_and_nothing(store: LogStore):
    groups = analytics(store, "main", None, None, "provider")["groups"]
    assert len(groups) == 2 and all("provider" in g and "model" not in g for g in groups)
    openai, workers = groups
    assert (openai["provider"], openai["requests"], openai["errors"]) == ("openai", 103, 11)
    assert (openai["tokens_in"], openai["cost"], openai["cache_hit_rate"]) == (1300, 29.5, 0.5)
    # 103 latencies 1..100, 20, 300, 500: the extra 20 is rank 21, so rank 52 holds 51
    assert (openai["latency_ms_p50"], openai["latency_ms_p99"]) == (51.0, 300.0)
    assert (workers["provider"], workers["requests"], workers["tokens_out"]) == ("workers-ai", 3, 6)
    assert analytics(store, "main", None, None, "")["groups"] == []
    with pytest.raises(ValueError, match="group_by"):
        analytics(store, "main", None, None, "model")
    with pytest.raises(ValueError, match="cannot group by"):
        store.stats("main", group_by=["provider", "status; DROP TABLE requests"])


def test_time_range_is_start_inclusive_end_exclusive(store: LogStore):
    in_range = analytics(store, "main", 1000, 1100)
    # all 100 mini rows (the first at exactly 1000), b1, b2; not c1 (1100) nor c2 (999.5)
    assert in_range["total"]["requests"] == 102
    assert (in_range["start"], in_range["end"]) == (1000, 1100)
    assert [(g["provider"], g["model"], g["requests"]) for g in in_range["groups"]] == [
        (*MINI, 100), (*GPT4O, 2)]  # fmt: skip
    assert analytics(store, "main", 1000, 1000.5)["total"]["requests"] == 1  # a0
    assert analytics(store, "main", 1099.5, 1100)["total"]["requests"] == 0
    since_1100 = analytics(store, "main", 1100, None, "")["total"]
    assert (since_1100["requests"], since_1100["tokens_in"]) == (3, 206)  # c1, b3, c3
    at_1100 = analytics(store, "main", 1100, 1101)["total"]
    assert (at_1100["requests"], at_1100["error_rate"], at_1100["cache_hit_rate"]) == (1, 0.0, None)
    before = analytics(store, "main", None, 1000)["total"]
    assert (before["requests"], before["errors"], before["latency_ms_p50"]) == (1, 1, None)


def test_gateways_are_separate(store: LogStore):
    staging = analytics(store, "staging", None, None)
    assert staging["total"]["requests"] == 2 and staging["total"]["errors"] == 1
    assert (staging["total"]["tokens_in"], staging["total"]["cost"]) == (1000, 100.0)
    assert (staging["total"]["latency_ms_p50"], staging["total"]["latency_ms_p95"]) == (7.0, 9.0)
    empty = analytics(store, "nobody", None, None)
    assert empty["groups"] == [] and empty["total"]["requests"] == 0
    assert empty["total"]["error_rate"] is None and empty["total"]["latency_ms_p50"] is None
    assert empty["total"]["cost"] == 0.0


def test_timeseries_buckets(store: LogStore):
    buckets = timeseries(store, "main", None, None, 100)
    assert [(b["start"], b["requests"]) for b in buckets] == [
        (900, 1), (1000, 102), (1100, 1), (1200, 1), (1300, 1)]  # fmt: skip
    b900, b1000 = buckets[0], buckets[1]
    assert (b900["errors"], b900["latency_ms_p50"], b900["cache_lookups"]) == (1, None, 0)
    # 102 latencies 1..100, 20, 300: the extra 20 is rank 21; p50 rank 51 holds 50,
    # p95 rank ceil(96.9) = 97 holds 96
    assert b1000 == {
        "start": 1000, "requests": 102, "errors": 11, "tokens_in": 1100, "tokens_out": 250,
        "cost": 26.5, "cache_hits": 20, "cache_lookups": 41,
        "latency_ms_p50": 50.0, "latency_ms_p95": 96.0,
    }  # fmt: skip
    assert buckets[3]["cache_hits"] == 1 and buckets[3]["latency_ms_p95"] == 500.0  # b3
    # floor(created / 60) * 60: 999.5 and 1000..1019 -> 960, 1020..1079 -> 1020, ...
    minutes = timeseries(store, "main", None, None, 60)
    assert [(b["start"], b["requests"]) for b in minutes] == [
        (960, 21), (1020, 62), (1080, 21), (1200, 1), (1260, 1)]  # fmt: skip
    ranged = timeseries(store, "main", 1000, 1200, 100)
    assert [(b["start"], b["requests"]) for b in ranged] == [(1000, 102), (1100, 1)]
    assert timeseries(store, "nobody", None, None, 60) == []
    with pytest.raises(ValueError, match="bucket_s"):
        timeseries(store, "main", None, None, 0)


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def _labels(gateway: str, where: tuple[str, str], **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({"gateway": gateway, "provider": where[0], "model": where[1], **more}.items())


def test_metrics(store: LogStore):
    text = render_metrics(store, breaker_opened=3, cache_hits=7, cache_misses=8)
    samples = _samples(text)
    requests = "infire_gateway_requests_total"
    assert samples[requests, _labels("main", MINI, status="200")] == 90
    assert samples[requests, _labels("main", MINI, status="500")] == 10
    assert samples[requests, _labels("main", GPT4O, status="429")] == 1
    assert samples[requests, _labels("main", LLAMA, status="")] == 1  # c2: no status
    assert samples[requests, _labels("staging", MINI, status="503")] == 1
    assert sum(v for (name, _), v in samples.items() if name == requests) == 106 + 2
    tokens, cost = "infire_gateway_tokens_total", "infire_gateway_cost_usd_total"
    assert samples[tokens, _labels("main", MINI, direction="in")] == 1000
    assert samples[tokens, _labels("main", MINI, direction="out")] == 200
    assert samples[tokens, _labels("main", GPT4O, direction="in")] == 300
    assert samples[tokens, _labels("staging", MINI, direction="out")] == 1000
    assert samples[cost, _labels("main", MINI)] == 25.0
    assert samples[cost, _labels("main", GPT4O)] == 4.5
    assert samples[cost, _labels("main", LLAMA)] == 0.5
    assert samples[cost, _labels("staging", MINI)] == 100.0
    assert samples["infire_gateway_cache_hits_total", frozenset()] == 7
    assert samples["infire_gateway_cache_misses_total", frozenset()] == 8
    assert samples["infire_gateway_circuit_opened_total", frozenset()] == 3

    def bucket(where: tuple[str, str], le: str, gateway: str = "main") -> float:
        return samples["infire_gateway_request_latency_seconds_bucket",
                       _labels(gateway, where, le=le)]  # fmt: skip

    # latencies 1..100 ms: 5 at or below 5 ms, 50 at or below 50 ms, all at 100 ms
    assert [bucket(MINI, le) for le in ("0.005", "0.01", "0.025", "0.05", "0.1", "60.0", "+Inf")] \
        == [5, 10, 25, 50, 100, 100, 100]  # fmt: skip
    # 20, 300, 500 ms: the bounds are inclusive (500 ms is in le=0.5)
    assert [bucket(GPT4O, le) for le in ("0.01", "0.025", "0.25", "0.5", "+Inf")] == [0, 1, 1, 3, 3]
    histogram = "infire_gateway_request_latency_seconds"
    assert samples[f"{histogram}_count", _labels("main", MINI)] == 100
    assert samples[f"{histogram}_sum", _labels("main", MINI)] == pytest.approx(5.05)
    assert samples[f"{histogram}_count", _labels("main", LLAMA)] == 2  # c2 has no latency
    assert samples[f"{histogram}_sum", _labels("main", GPT4O)] == pytest.approx(0.82)
    assert bucket(MINI, "0.005", "staging") == 0 and bucket(MINI, "0.01", "staging") == 2

    # from the log, so a new process on the same file says the same
    store.close()
    reopened = LogStore(store.path)
    try:
        again = _samples(render_metrics(reopened, breaker_opened=3, cache_hits=7, cache_misses=8))
    finally:
        reopened.close()
    assert again == samples
