"""Sending a request upstream: steps tried in order, each with retries, a timeout to the
first byte and a circuit breaker per provider.

A step is retried on connect errors, timeouts, 429 and 5xx answers (never on other 4xx,
which are the client's to see), waiting the configured backoff, or the upstream's
Retry-After when it asks for longer (up to MAX_RETRY_AFTER_S). A step whose attempts are
spent falls back to the next one. A provider whose attempts failed `failures` times in a
row is skipped for `cooldown_s` (then one attempt is let through to probe it).

Upstream connections are one pool per gateway process (infire.gateway.http1: kept alive,
no cookies, so tenants never share any), opened on first use inside the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from infire.gateway.config import Provider, Retry
from infire.gateway.http1 import Pool, Response, UpstreamError

logger = logging.getLogger("infire.gateway")
MAX_RETRY_AFTER_S = 10.0
# Request headers never sent upstream: hop-by-hop, the client's credentials for the gateway,
# and the gateway's own controls.
_DROPPED = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
            "authorization", "accept-encoding", "upgrade", "te", "trailer", "expect"}  # fmt: skip


@dataclass(slots=True)
class Step:
    """One way to answer the request: a provider, a URL below it and what to send."""

    provider: Provider
    method: str
    path: str  # below the provider's base_url, without a leading slash
    query: str  # raw query string, may be empty
    body: bytes
    headers: dict[str, str]  # from the client or the universal step, filtered
    timeout_s: float
    retry: Retry

    @property
    def url(self) -> str:
        url = f"{self.provider.base_url}/{self.path}" if self.path else self.provider.base_url
        return f"{url}?{self.query}" if self.query else url


@dataclass(slots=True)
class Failure:
    """Why one attempt did not answer."""

    step: int
    provider: str
    reason: str  # connect error, timeout, HTTP 503, circuit open
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


Answer = Response  # an upstream answer, its body still to read


@dataclass(slots=True)
class Outcome:
    """The upstream response being relayed (its body not read yet), or the failures."""

    response: Answer | None
    step: int
    attempts: int
    failures: list[Failure]
    first_byte_s: float | None = None  # since the gateway started sending


class CircuitBreaker:
    """Consecutive failures per provider; open (skipped) for a cool-down after too many."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self.limit, self.cooldown_s = failures, cooldown_s
        self.failures: dict[str, int] = {}
        self.open_until: dict[str, float] = {}
        self.opened = 0  # times any circuit opened (for metrics)

    def allows(self, provider: str) -> bool:
        return time.monotonic() >= self.open_until.get(provider, 0.0)

    def is_open(self, provider: str) -> bool:
        return not self.allows(provider)

    def record(self, provider: str, ok: bool) -> None:
        if ok:
            self.failures[provider] = 0
            return
        count = self.failures.get(provider, 0) + 1
        self.failures[provider] = count
        if count >= self.limit:
            self.open_until[provider] = time.monotonic() + self.cooldown_s
            self.failures[provider] = self.limit - 1  # after the cool-down one failure reopens
            self.opened += 1
            logger.warning("circuit open for provider %s (%d failures in a row, %.0f s)",
                           provider, count, self.cooldown_s)  # fmt: skip


def outgoing_headers(headers: dict[str, str]) -> dict[str, str]:
    """The client's headers that go upstream (no credentials, no cf-aig-* controls)."""
    return {k: v for k, v in headers.items() if k not in _DROPPED and not k.startswith("cf-aig-")}


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _retry_after(headers: dict[str, str]) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(headers.get("retry-after", "0"))))
    except ValueError:
        return 0.0


async def send(client: Pool, steps: list[Step], breaker: CircuitBreaker) -> Outcome:
    """The first answer that is not a retryable failure, trying steps and attempts in order.

    A non-retryable answer (2xx, 3xx, 4xx other than 429) is returned with its body still
    to read; when every step fails, `response` is None and `failures` says why.
    """
    failures: list[Failure] = []
    attempts = 0
    start = time.monotonic()
    for index, step in enumerate(steps):
        name = step.provider.name
        wait = 0.0
        for attempt in range(step.retry.max_attempts):
            if attempt:
                await asyncio.sleep(max(step.retry.delay_s(attempt), wait))
            if breaker.is_open(name):
                failures.append(Failure(index, name, "circuit open"))
                break
            attempts += 1
            headers = {
                **step.headers,
                "accept-encoding": "identity",
                **step.provider.auth_headers(),
            }
            try:
                response = await asyncio.wait_for(_open(client, step, headers), step.timeout_s)
            except asyncio.TimeoutError:  # (TimeoutError itself from 3.11 on)
                failures.append(Failure(index, name, f"timeout ({step.timeout_s * 1000:.0f} ms)"))
                breaker.record(name, ok=False)
                continue
            except UpstreamError as e:
                failures.append(Failure(index, name, f"{type(e).__name__}: {e}".rstrip(": ")))
                breaker.record(name, ok=False)
                continue
            if _retryable(response.status_code):
                body = await response.aread()
                await response.aclose()
                wait = _retry_after(response.headers)
                failures.append(Failure(index, name, f"HTTP {response.status_code}",
                                        response.status_code, body, response.headers))  # fmt: skip
                breaker.record(name, ok=False)
                continue
            breaker.record(name, ok=True)
            return Outcome(response, index, attempts, failures, time.monotonic() - start)
    return Outcome(None, len(steps) - 1, attempts, failures)


async def _open(client: Pool, step: Step, headers: dict[str, str]) -> Answer:
    """Send the request; the answer once its status and headers are in."""
    return await client.request(step.method, step.url, headers, step.body)
