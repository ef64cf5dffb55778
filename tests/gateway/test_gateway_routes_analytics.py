"""The gateway's own read routes over HTTP: analytics sums equal the logged rows, the log
pages and filters, one log entry with its bodies, /metrics, and the dashboard's files."""

from __future__ import annotations

import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_upstream import FaultUpstream
from gateway_harness import Gateway
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def traffic() -> Iterator[tuple[Gateway, FaultUpstream]]:
    """A gateway that served 12 answers, 3 upstream errors and 2 cache hits."""
    with FaultUpstream() as upstream:
        config = f"""
[gateways.main]
[gateways.other]
[providers.up]
kind = "openai"
base_url = "{upstream.base_url}"
[prices."up/fault-model"]
input = 1.0
output = 2.0
"""
        gw = Gateway(config, Path(tempfile.mkdtemp()) / "gw")
        try:
            upstream.script(["status:500"] * 3, key="bad")
            for i in range(12):
                body = {
                    "model": "fault-model",
                    "messages": [{"role": "user", "content": f"q {i} x"}],
                }
                httpx.post(f"{gw.url}/main/up/chat/completions", json=body, timeout=30,
                           headers={"cf-aig-metadata": f'{{"i": {i}}}'})  # fmt: skip
            for _ in range(3):
                httpx.post(f"{gw.url}/main/up/chat/completions", json={"model": "fault-model"},
                           headers={"x-fault-key": "bad"}, timeout=30)  # fmt: skip
            cached = {"model": "fault-model", "messages": [{"role": "user", "content": "same"}]}
            for _ in range(3):
                httpx.post(f"{gw.url}/main/compat/chat/completions", timeout=30,
                           json={**cached, "model": "up/fault-model"},
                           headers={"cf-aig-cache-ttl": "60"})  # fmt: skip
            httpx.post(f"{gw.url}/other/up/chat/completions", json=cached, timeout=30)
            time.sleep(0.3)  # the last rows are written after their answers
            yield gw, upstream
        finally:
            gw.stop()


def _logged(gw: Gateway, gateway: str = "main") -> list[dict]:
    db = sqlite3.connect(gw.config_path.parent / "gateway.db")
    db.row_factory = sqlite3.Row
    return [dict(r) for r in db.execute("SELECT * FROM requests WHERE gateway = ?", (gateway,))]


def test_analytics_sums_equal_the_logged_rows(traffic):
    gw, _ = traffic
    rows = _logged(gw)
    total = httpx.get(f"{gw.url}/main/analytics").json()["total"]
    assert total["requests"] == len(rows) == 18
    assert total["errors"] == sum(1 for r in rows if r["status"] >= 400) == 3
    assert total["tokens_in"] == sum(r["tokens_in"] or 0 for r in rows)
    assert total["tokens_out"] == sum(r["tokens_out"] or 0 for r in rows)
    assert total["cost"] == pytest.approx(sum(r["cost"] or 0 for r in rows))
    assert total["cache_hits"] == 2 and total["cache_hit_rate"] == pytest.approx(2 / 3)
    latencies = sorted(r["latency_ms"] for r in rows)
    assert total["latency_ms_p50"] == pytest.approx(latencies[8])  # nearest rank: 9th of 18
    by_model = httpx.get(f"{gw.url}/main/analytics", params={"group_by": "provider,model"}).json()
    assert sum(g["requests"] for g in by_model["groups"]) == 18
    future = httpx.get(f"{gw.url}/main/analytics", params={"start": time.time() + 60}).json()
    assert future["total"]["requests"] == 0
    other = httpx.get(f"{gw.url}/other/analytics").json()["total"]
    assert other["requests"] == 1
    r = httpx.get(f"{gw.url}/main/analytics", params={"group_by": "colour"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_by"
    assert httpx.get(f"{gw.url}/nowhere/analytics").status_code == 404
    series = httpx.get(f"{gw.url}/main/analytics/timeseries", params={"bucket_s": 3600}).json()
    assert sum(b["requests"] for b in series["buckets"]) == 18


def test_logs_page_filter_and_entry(traffic):
    gw, _ = traffic
    first = httpx.get(f"{gw.url}/main/logs", params={"limit": 10}).json()
    second = httpx.get(f"{gw.url}/main/logs", params={"limit": 10, "offset": 10}).json()
    assert first["total"] == second["total"] == 18
    ids = [r["id"] for r in first["rows"] + second["rows"]]
    assert len(ids) == len(set(ids)) == 18
    created = [r["created"] for r in first["rows"] + second["rows"]]
    assert created == sorted(created, reverse=True)
    assert "request_body" not in first["rows"][0]
    errors = httpx.get(f"{gw.url}/main/logs", params={"status": "5xx"}).json()
    assert errors["total"] == 3 and {r["status"] for r in errors["rows"]} == {500}
    hits = httpx.get(f"{gw.url}/main/logs", params={"cache": "HIT"}).json()
    assert hits["total"] == 2
    entry = httpx.get(f"{gw.url}/main/logs/{errors['rows'][0]['id']}").json()
    assert entry["response_body"] and "scripted fault" in entry["response_body"]
    with_meta = [r for r in _logged(gw) if r["metadata"]]
    one = httpx.get(f"{gw.url}/main/logs/{with_meta[0]['id']}").json()
    assert set(one["metadata"]) == {"i"} and "q " in one["request_body"]
    missing = httpx.get(f"{gw.url}/main/logs/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    assert httpx.get(f"{gw.url}/main/logs", params={"limit": 0}).status_code == 400


def test_metrics_and_dashboard_files(traffic):
    gw, _ = traffic
    text = httpx.get(f"{gw.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    requests = sum(s.value for s in samples["infire_gateway_requests_total"]
                   if s.labels["gateway"] == "main")  # fmt: skip
    assert requests == 18
    assert sum(s.value for s in samples["infire_gateway_cache_hits_total"]) == 2
    page = httpx.get(f"{gw.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(f"{gw.url}/dashboard/api/gateways").json() == {"gateways": ["main", "other"]}
