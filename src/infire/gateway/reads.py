"""The read routes: health, Prometheus metrics, the dashboard and its data, analytics and
the request log. Every query runs in a thread, off the event loop that relays answers.

`/health` and `/dashboard` (the page alone) hold no data and are open; the others need
the admin token when the config sets one (the app wraps them in Access.require_admin).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from infire.gateway.analytics import GROUPINGS, analytics, render_metrics, timeseries
from infire.gateway.cache import Cache
from infire.gateway.config import GatewayConfig
from infire.gateway.routes import gateway_of
from infire.gateway.store import LogStore
from infire.gateway.upstream import CircuitBreaker
from infire.http_errors import APIError

DASHBOARD = Path(__file__).with_name("dashboard.html")
_LOG_FILTERS = ("provider", "model", "status", "cache", "search")


class Reads:
    """The read routes over the log store, the circuit breaker and the cache's counts."""

    def __init__(self, config: GatewayConfig, store: LogStore, breaker: CircuitBreaker,
                 cache: Cache) -> None:  # fmt: skip
        self._config = config
        self._store = store
        self._breaker = breaker
        self._cache = cache

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        text = await asyncio.to_thread(render_metrics, self._store, self._breaker.opened,
                                       self._cache.hits, self._cache.misses)  # fmt: skip
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD.read_text())

    async def gateways(self, request: Request) -> Response:
        return JSONResponse({"gateways": list(self._config.gateways)})

    async def analytics(self, request: Request) -> Response:
        name = self._gateway(request)
        start, end = _time_range(request)
        group_by = request.query_params.get("group_by", "provider,model")
        if group_by not in GROUPINGS:
            raise APIError(400, f"group_by must be one of {', '.join(map(repr, GROUPINGS))}",
                           param="group_by")  # fmt: skip
        result = await asyncio.to_thread(analytics, self._store, name, start, end, group_by)
        return JSONResponse(result)

    async def timeseries(self, request: Request) -> Response:
        name = self._gateway(request)
        start, end = _time_range(request)
        bucket = _query_number(request, "bucket_s", 60, 1)
        buckets = await asyncio.to_thread(timeseries, self._store, name, start, end, int(bucket))
        return JSONResponse({"buckets": buckets})

    async def logs(self, request: Request) -> Response:
        name = self._gateway(request)
        q = request.query_params
        start, end = _time_range(request)
        limit = int(_query_number(request, "limit", 20, 1, 500))
        offset = int(_query_number(request, "offset", 0, 0))
        filters = {k: q[k] for k in _LOG_FILTERS if q.get(k)}
        total, rows = await asyncio.to_thread(self._store.page, name, limit, offset, start, end,
                                              filters)  # fmt: skip
        return JSONResponse({"total": total, "rows": rows})

    async def log_entry(self, request: Request) -> Response:
        name = self._gateway(request)
        log_id = request.path_params["log_id"]
        row = await asyncio.to_thread(self._store.get, name, log_id)
        if row is None:
            raise APIError(404, f"no log entry {log_id!r} in gateway {name!r}", code="not_found")
        return JSONResponse(row)

    def _gateway(self, request: Request) -> str:
        return gateway_of(self._config, request.path_params["gateway"]).name


def _query_number(request: Request, name: str, default: float, low: float,
                  high: float | None = None) -> float:  # fmt: skip
    value = request.query_params.get(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise APIError(400, f"{name} must be a number", param=name) from None
    if number < low or (high is not None and number > high):
        raise APIError(400, f"{name} must be between {low:g} and {high or 'any'}", param=name)
    return number


def _time_range(request: Request) -> tuple[float | None, float | None]:
    """start and end (unix seconds) from the query; either may be absent."""
    q = request.query_params
    start = _query_number(request, "start", -1, 0) if q.get("start") else None
    end = _query_number(request, "end", -1, 0) if q.get("end") else None
    return start, end
