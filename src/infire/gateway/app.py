"""The gateway's ASGI app: its state, its routes, its error answers (`GatewayApp`).

Routes (every {gateway} must be configured, every {provider} too):

- `POST|GET /{gateway}/{provider}/{path}`: passed through to the provider's base URL +
  path, with the query string and the body as they are, the provider's key added;
- `POST /{gateway}/compat/chat/completions`: OpenAI chat completions with
  `model: "{provider}/{model}"`, sent to that provider's chat completions endpoint;
- `POST /{gateway}`: the universal route, a JSON array of steps `{provider, endpoint,
  headers, query, config: {requestTimeout, maxAttempts, retryDelay, backoff}}` tried in
  order (`query` is the JSON body sent to `endpoint`); the answering step's index comes
  back in `cf-aig-step`.

Request headers `cf-aig-request-timeout` (ms to the first byte), `cf-aig-max-attempts`
(1-5), `cf-aig-retry-delay` (ms) and `cf-aig-backoff` override the gateway's defaults.
Answers stream through as the upstream sends them (server-sent events are relayed event
by event); every request is logged with its status, latency, time to first byte, token
usage (from the answer; for streamed chat completions the gateway asks upstream for
`include_usage` when the client did not, and removes it from what the client gets), cost,
`cf-aig-metadata`, and, unless `cf-aig-collect-log-payload: false`, the bodies. Its id
comes back in `cf-aig-log-id`. Errors are OpenAI-shaped JSON; a provider's own error
answer (after its retries) is passed through as it came.

The read routes (`/{gateway}/analytics`, `/{gateway}/logs`, `/metrics`, the dashboard's
data) need the admin token (`Authorization: Bearer ...`) when `[server] admin_sha256` is
set; `/dashboard` itself and `/health` hold no data and are open.

The parts: routes.Router (requests into calls and steps), relay.Relay (the answer, from
the cache or upstream), access.Access (tokens and rate limits), calls.CallLog (the log
row), reads.Reads (the read routes), backends (SQLite or Redis for cache and limits).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infire.gateway.access import Access, RateLimited
from infire.gateway.backends import open_backends
from infire.gateway.cache import Cache
from infire.gateway.calls import CallLog
from infire.gateway.config import GatewayConfig
from infire.gateway.http1 import Pool
from infire.gateway.reads import Reads
from infire.gateway.relay import Relay
from infire.gateway.routes import Router
from infire.gateway.store import LogStore
from infire.gateway.upstream import CircuitBreaker
from infire.gateway.usage import Usage
from infire.http_errors import APIError, json_error, to_api_error

Endpoint = Callable[[Request], Awaitable[Response]]


class GatewayApp:
    """The gateway over a checked config: the log store, the cache and limit backends, the
    circuit breaker and the upstream connections (opened here, closed at shutdown), and the
    Starlette app (`app`) that routes to them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.store = LogStore(config.store)
        self.backends = open_backends(config.redis_url, config.store)
        self.cache = Cache(self.backends.cache)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.pool = Pool()  # connections to every upstream, kept alive
        self.access = Access(config, self.backends.counters)
        self.log = CallLog(self.store, config.prices, self.access)
        self.relay = Relay(self.pool, self.breaker, self.cache, self.log)
        self.router = Router(config, self.access, self.log, self.relay)
        self.reads = Reads(config, self.store, self.breaker, self.cache)
        self.app = self._starlette()

    def _routes(self) -> list[tuple[str, Endpoint, tuple[str, ...], bool]]:
        """(path, endpoint, methods, admin only), in the order Starlette tries them."""
        reads, router = self.reads, self.router
        return [
            ("/health", reads.health, ("GET",), False),
            ("/metrics", reads.metrics, ("GET",), True),
            ("/dashboard", reads.dashboard, ("GET",), False),
            ("/dashboard/api/gateways", reads.gateways, ("GET",), True),
            ("/{gateway}/analytics", reads.analytics, ("GET",), True),
            ("/{gateway}/analytics/timeseries", reads.timeseries, ("GET",), True),
            ("/{gateway}/logs", reads.logs, ("GET",), True),
            ("/{gateway}/logs/{log_id}", reads.log_entry, ("GET",), True),
            ("/{gateway}/compat/chat/completions", router.compat, ("POST",), False),
            ("/{gateway}", router.universal, ("POST",), False),
            ("/{gateway}/{provider}/{path:path}", router.passthrough, ("GET", "POST"), False),
        ]

    def _starlette(self) -> Starlette:
        # Starlette, not FastAPI: the routes read their own input, and the hot ones skip
        # FastAPI's per-request dependency solving.
        app = Starlette(lifespan=self._lifespan)
        app.state.store, app.state.breaker, app.state.cache = self.store, self.breaker, self.cache
        for path, endpoint, methods, admin_only in self._routes():
            app.add_route(path, self._admin_only(endpoint) if admin_only else endpoint,
                          methods=list(methods))  # fmt: skip
        for exc_type in (HTTPException, Exception):
            app.add_exception_handler(exc_type, _unexpected)
        app.add_exception_handler(APIError, self._refused)
        return app

    def _admin_only(self, endpoint: Endpoint) -> Endpoint:
        async def guarded(request: Request) -> Response:
            self.access.require_admin(request)
            return await endpoint(request)

        return guarded

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.relay.drain()  # answers finished but not yet logged
        await self.pool.close()
        await self.backends.close()
        self.store.close()

    async def _refused(self, request: Request, exc: APIError) -> Response:
        """The error answer, logged when it ends a call that was not logged yet."""
        call = getattr(request.state, "call", None)
        if call is not None and not call.logged:
            await self.log.finish(call, exc.status, None, Usage(), exc.message)
        if isinstance(exc, RateLimited):
            response: Response = JSONResponse(exc.body(), status_code=429, headers={
                "retry-after": str(max(1, math.ceil(exc.retry_after)))})  # fmt: skip
        else:
            response = json_error(exc)
        if call is not None:
            response.headers["cf-aig-log-id"] = call.log_id
        return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (404, 405) by their status; anything else 500, logged."""
    return json_error(to_api_error(exc))


def create_app(config: GatewayConfig) -> Starlette:
    """The gateway app over a checked config (the log store opens here)."""
    return GatewayApp(config).app
