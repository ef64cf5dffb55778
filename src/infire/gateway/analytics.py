"""The gateway's analytics and Prometheus metrics, read from the request log.

`analytics` and `timeseries` answer the dashboard's JSON routes over a time range of one
gateway; `render_metrics` answers `GET /metrics` over the whole log, so its counters
survive restarts. The SQL lives in `LogStore`; here are the percentiles (nearest rank),
the rates and the shapes the routes return.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from infire.gateway.store import LogStore, RequestStats

GROUPINGS = ("provider,model", "provider", "")  # the group_by values analytics takes
# Upper bounds of the latency histogram's buckets, in ms (so they compare exactly).
LATENCY_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)


def nearest_rank(sorted_values: Sequence[float], percent: int) -> float | None:
    """The nearest-rank percentile: the smallest value with at least percent% of the
    values at or below it; None for no values."""
    if not sorted_values:
        return None
    rank = -(-percent * len(sorted_values) // 100)  # ceil in integers, no float rounding
    return sorted_values[max(rank, 1) - 1]


def analytics(
    store: LogStore,
    gateway: str,
    start: float | None,
    end: float | None,
    group_by: str = "provider,model",
) -> dict[str, Any]:
    """Totals of one gateway's requests with created in [start, end), and per group."""
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {', '.join(map(repr, GROUPINGS))}")
    columns = tuple(group_by.split(",")) if group_by else ()
    found = store.stats(gateway, start, end, columns)
    groups = [{**dict(zip(columns, s.key, strict=True)), **_measures(s)} for s in found]
    if not columns:
        groups = []  # the one entry is the total
    groups.sort(key=lambda g: (-g["requests"], *(g[c] or "" for c in columns)))
    return {"gateway": gateway, "start": start, "end": end, "total": _measures(_merged(found)),
            "groups": groups}  # fmt: skip


def timeseries(
    store: LogStore, gateway: str, start: float | None, end: float | None, bucket_s: int
) -> list[dict[str, Any]]:
    """One gateway's requests per time bucket (only buckets with rows), oldest first."""
    found = sorted(store.stats(gateway, start, end, bucket_s=bucket_s), key=lambda s: s.key)
    return [
        {"start": s.key[0], "requests": s.requests, "errors": s.errors,
         "tokens_in": s.tokens_in, "tokens_out": s.tokens_out, "cost": s.cost,
         "cache_hits": s.cache_hits, "cache_lookups": s.cache_lookups,
         "latency_ms_p50": nearest_rank(s.latencies_ms, 50),
         "latency_ms_p95": nearest_rank(s.latencies_ms, 95)}
        for s in found
    ]  # fmt: skip


def render_metrics(store: LogStore, breaker_opened: int, cache_hits: int, cache_misses: int) -> str:
    """The Prometheus text exposition of the log's counters and of this process's cache
    and circuit-breaker counters."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LogCollector(store, breaker_opened, cache_hits, cache_misses))
    return generate_latest(registry).decode()


class _LogCollector:
    """Counters and the latency histogram, aggregated from the log at scrape time."""

    def __init__(
        self, store: LogStore, breaker_opened: int, cache_hits: int, cache_misses: int
    ) -> None:
        self.store = store
        self.process_counts = (
            ("infire_gateway_cache_hits", "Cache lookups answered from the cache", cache_hits),
            ("infire_gateway_cache_misses", "Cache lookups that went upstream", cache_misses),
            ("infire_gateway_circuit_opened", "Times a provider's circuit opened", breaker_opened),
        )

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        labels = ["gateway", "provider", "model"]
        requests = CounterMetricFamily("infire_gateway_requests", "Requests through the gateway",
                                       labels=[*labels, "status"])  # fmt: skip
        tokens = CounterMetricFamily("infire_gateway_tokens", "Tokens in (prompt) and out",
                                     labels=[*labels, "direction"])  # fmt: skip
        sums: dict[tuple[str, ...], list[float]] = {}  # tokens in, out and cost per model
        for t in self.store.counter_totals():
            names = (t.gateway, t.provider or "", t.model or "")
            requests.add_metric([*names, "" if t.status is None else str(t.status)], t.requests)
            model_sums = sums.setdefault(names, [0, 0, 0.0])
            model_sums[0] += t.tokens_in
            model_sums[1] += t.tokens_out
            model_sums[2] += t.cost
        cost_usd = CounterMetricFamily("infire_gateway_cost_usd", "Cost of the requests in USD",
                                       labels=labels)  # fmt: skip
        for names, (tokens_in, tokens_out, cost) in sums.items():
            tokens.add_metric([*names, "in"], tokens_in)
            tokens.add_metric([*names, "out"], tokens_out)
            cost_usd.add_metric(list(names), cost)
        yield from (requests, tokens, cost_usd)
        for name, doc, value in self.process_counts:
            yield CounterMetricFamily(name, doc, value=value)
        latency = HistogramMetricFamily("infire_gateway_request_latency_seconds",
                                        "Request latency until the last byte", labels=labels)  # fmt: skip
        for h in self.store.latency_counts(LATENCY_BOUNDS_MS):
            buckets = [
                (str(bound / 1000), n)
                for bound, n in zip(LATENCY_BOUNDS_MS, h.at_most, strict=True)
            ]
            latency.add_metric([h.gateway, h.provider or "", h.model or ""],
                               [*buckets, ("+Inf", h.count)], h.sum_ms / 1000)  # fmt: skip
        yield latency


def _measures(s: RequestStats) -> dict[str, Any]:
    """The JSON of one group's (or the total's) aggregates."""
    return {
        "requests": s.requests, "errors": s.errors,
        "error_rate": s.errors / s.requests if s.requests else None,
        "tokens_in": s.tokens_in, "tokens_out": s.tokens_out, "cost": s.cost,
        "cache_hits": s.cache_hits,
        "cache_hit_rate": s.cache_hits / s.cache_lookups if s.cache_lookups else None,
        "latency_ms_p50": nearest_rank(s.latencies_ms, 50),
        "latency_ms_p95": nearest_rank(s.latencies_ms, 95),
        "latency_ms_p99": nearest_rank(s.latencies_ms, 99),
        "ttfb_ms_p50": nearest_rank(s.ttfbs_ms, 50),
        "ttfb_ms_p95": nearest_rank(s.ttfbs_ms, 95),
    }  # fmt: skip


def _merged(found: list[RequestStats]) -> RequestStats:
    """The aggregates of the union of groups."""
    total = RequestStats(())
    for s in found:
        total.requests += s.requests
        total.errors += s.errors
        total.tokens_in += s.tokens_in
        total.tokens_out += s.tokens_out
        total.cost += s.cost
        total.cache_hits += s.cache_hits
        total.cache_lookups += s.cache_lookups
        total.latencies_ms += s.latencies_ms
        total.ttfbs_ms += s.ttfbs_ms
    total.latencies_ms.sort()
    total.ttfbs_ms.sort()
    return total
