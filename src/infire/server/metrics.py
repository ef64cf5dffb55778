"""Prometheus metrics under `infire:` with vLLM's names.

One registry per server, every sample labelled with its `model_name`. Engine state
(running / waiting requests, KV cache usage, token and prefix-cache counters) is each
loaded generative model's latest stats snapshot at scrape time; latencies are histograms
observed by the routes as requests stream and finish. The catalog adds its own collector
(catalog/manager.py: load state, bytes, loads and evictions per model, the budget). Each
app owns its registry (no global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infire.engine import EngineStats
from infire.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class _EngineCollector:
    """Gauges and counters taken from the engines when Prometheus scrapes."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, EngineStats]]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model_name, stats in self.engines():
            for family, value in self._samples(stats):
                families.setdefault(family.name, family).add_metric([model_name], value)
        yield from families.values()

    @staticmethod
    def _samples(
        stats: EngineStats,
    ) -> Iterator[tuple[GaugeMetricFamily | CounterMetricFamily, float]]:
        names = ["model_name"]
        for name, doc, value in (
            ("infire:num_requests_running", "Sequences running (in the batch)", stats.num_running),
            ("infire:num_requests_waiting", "Sequences waiting to be scheduled", stats.num_waiting),
            ("infire:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", stats.kv_cache_usage),
            ("infire:prompt_tokens_to_compute", "Prompt tokens of queued and running sequences not computed yet", stats.num_prompt_tokens_to_compute),
            ("infire:kv_leases", "KV leases held for decode workers (prefill role)", stats.num_leases),
            ("infire:kv_leased_blocks", "KV blocks held under leases (prefill role)", stats.num_leased_blocks),
            ("infire:kv_pulling", "Requests waiting for or in a KV pull (decode role)", stats.num_pulling),
        ):  # fmt: skip
            yield GaugeMetricFamily(name, doc, labels=names), value
        for name, doc, value in (
            ("infire:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            ("infire:prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            ("infire:prompt_tokens", "Prompt tokens of admitted requests", stats.num_prompt_tokens),
            ("infire:generation_tokens", "Generated tokens", stats.num_generation_tokens),
            ("infire:num_preemptions", "Sequences preempted", stats.num_preemptions),
            ("infire:kv_leases_expired", "KV leases that expired before a decode worker released them", stats.kv_leases_expired),
            ("infire:kv_pulls_failed", "KV pulls that failed (peer gone, checksum mismatch)", stats.kv_pulls_failed),
            ("infire:kv_blocks_pulled", "KV blocks pulled from prefill workers", stats.kv_blocks_pulled),
            ("infire:kv_blocks_reused", "Prompt blocks a decode worker's prefix cache held, not pulled", stats.kv_blocks_reused),
            ("infire:kv_bytes_pulled", "Bytes of KV pulled from prefill workers", stats.kv_bytes_pulled),
            ("infire:kv_pull_seconds", "Seconds spent in KV pulls", stats.kv_pull_seconds),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, labels=names), value


class ServerMetrics:
    """The registry of one server: the engines' samples and the routes' histograms."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, EngineStats]]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engines))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=self.registry,
                             buckets=_LATENCY_BUCKETS)  # fmt: skip

        self.ttft = histogram("infire:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("infire:inter_token_latency_seconds", "Time between tokens")
        self.e2e = histogram("infire:e2e_request_latency_seconds", "Request latency, end to end")
        self.queue = histogram("infire:request_queue_time_seconds", "Time waiting before running")
        self.success = Counter(
            "infire:request_success", "Finished requests by finish reason",
            ["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip

    def for_model(self, model_name: str) -> ModelMetrics:
        """What one model's routes observe into."""
        return ModelMetrics(self, model_name)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's histograms and finish counter (children of the server's)."""

    def __init__(self, server: ServerMetrics, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = server.ttft.labels(model_name)
        self.itl = server.itl.labels(model_name)
        self.e2e = server.e2e.labels(model_name)
        self.queue = server.queue.labels(model_name)
        self._success = server.success

    def observe_finished(self, m: RequestMetrics | None, finish_reason: str | None) -> None:
        """Record a finished request's latencies and its (first choice's) finish reason."""
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self._success.labels(self.model_name, finish_reason or "abort").inc()
