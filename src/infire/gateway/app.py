"""The gateway's ASGI app: routes, the relay of upstream answers, and the request log.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import Receive, Scope, Send

from infire.gateway.analytics import GROUPINGS, analytics, render_metrics, timeseries
from infire.gateway.cache import (
    KEPT_HEADERS,
    Cache,
    Entry,
    cache_key,
    credentials_hash,
    open_backend,
)
from infire.gateway.config import (
    BACKOFFS,
    MAX_ATTEMPTS,
    Gateway,
    GatewayConfig,
    Provider,
    Retry,
    Token,
)
from infire.gateway.http1 import Pool, check_headers
from infire.gateway.limits import Admission, open_counters
from infire.gateway.store import LogStore
from infire.gateway.upstream import (
    CircuitBreaker,
    Outcome,
    Step,
    UpstreamError,
    outgoing_headers,
    send,
)
from infire.server.errors import APIError, error_response, json_object

logger = logging.getLogger("infire.gateway")
access_logger = logging.getLogger("infire.gateway.access")  # a JSON line per request
DASHBOARD = Path(__file__).with_name("dashboard.html")
PAYLOAD_LIMIT = 64 * 1024  # bytes of a body kept in the log
USAGE_SCAN_LIMIT = 4 * 1024**2  # bytes of a JSON answer read for its usage
_RESPONSE_DROPPED = {"content-length", "transfer-encoding", "connection", "keep-alive",
                     "content-encoding"}  # fmt: skip
# Where each kind of provider has OpenAI's chat completions, below its base URL.
_CHAT_PATH = {"openai": "chat/completions", "infire": "v1/chat/completions",
              "workers-ai": "v1/chat/completions"}  # fmt: skip


@dataclass(slots=True)
class Call:
    """One client request through the gateway, as the log will record it."""

    gateway: Gateway
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
    log_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    provider: str | None = None
    model: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    collect: bool = True
    request_body: bytes = b""
    custom_cost: tuple[float, float] | None = None  # USD per input, per output token
    cache_key: str | None = None  # set when the answer may come from or go to the cache
    cache_ttl_s: int = 0
    cache_status: str | None = None  # HIT | MISS
    token: Token | None = None  # the gateway token the client showed
    reserved: list[Admission] = field(default_factory=list)  # against token limits
    logged: bool = False


def create_app(config: GatewayConfig) -> Starlette:
    """The gateway app over a checked config (the log store opens here)."""
    store = LogStore(config.store)
    cache = Cache(open_backend(config.redis_url, config.store))
    counters = open_counters(config.redis_url, config.store)
    breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
    client = Pool()  # connections to every upstream, kept alive

    pending: set[asyncio.Task] = set()  # wrap-ups running after their answers

    def later(work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        pending.add(task)
        task.add_done_callback(pending.discard)

    @asynccontextmanager
    async def lifespan(app: Starlette):  # noqa: ANN202 (Starlette's lifespan protocol)
        yield
        if pending:  # answers finished but not yet logged
            await asyncio.gather(*pending, return_exceptions=True)
        await client.close()
        await cache.backend.close()
        await counters.close()
        store.close()

    # Starlette, not FastAPI: the routes read their own input, and the hot ones skip
    # FastAPI's per-request dependency solving.
    app = Starlette(lifespan=lifespan)

    def route(path: str, methods: tuple[str, ...] = ("GET",), admin_only: bool = False) -> Any:
        """Register an endpoint taking the request (path parameters in request.path_params);
        admin_only: the read routes behind the admin token."""

        def register(endpoint: Any) -> Any:
            async def guarded(request: Request) -> Response:
                admin(request)
                return await endpoint(request)

            app.add_route(path, guarded if admin_only else endpoint, methods=list(methods))
            return endpoint

        return register

    app.state.store, app.state.breaker, app.state.cache = store, breaker, cache

    def gateway_of(name: str) -> Gateway:
        if name not in config.gateways:
            raise APIError(404, f"unknown gateway {name!r}", code="gateway_not_found")
        return config.gateways[name]

    def provider_of(name: Any, param: str | None = None) -> Provider:
        if not isinstance(name, str) or name not in config.providers:
            raise APIError(
                404, f"unknown provider {name!r}", code="provider_not_found", param=param
            )
        return config.providers[name]

    async def start(request: Request, gateway: str, endpoint: str) -> Call:
        """The call's log record, with the body read (413 past the limit) and the headers
        checked."""
        call = Call(gateway_of(gateway), endpoint)
        request.state.call = call  # so that an error answer is logged too
        headers = request.headers
        call.collect = headers.get("cf-aig-collect-log-payload", "true").lower() != "false"
        call.metadata = _json_header(headers, "cf-aig-metadata", dict)
        cost = _json_header(headers, "cf-aig-custom-cost", dict)
        if cost is not None:
            try:
                call.custom_cost = (float(cost.get("per_token_in", 0)),
                                    float(cost.get("per_token_out", 0)))  # fmt: skip
            except (TypeError, ValueError):
                raise APIError(400, "cf-aig-custom-cost: per_token_in and per_token_out must "
                               "be numbers", param="cf-aig-custom-cost") from None  # fmt: skip
        try:
            call.request_body = await _read_body(request, config.max_body_bytes)
            call.token = authenticate(request, call.gateway)
            await admit(call)
        except APIError as e:
            await finish(call, e.status, None, Usage(), e.message)
            raise
        return call

    def authenticate(request: Request, gateway: Gateway) -> Token | None:
        """The gateway token in cf-aig-authorization (or Authorization); 401 when the
        gateway needs one and there is none that is valid for it."""
        token = None
        digest = _bearer_sha256(request)
        if digest is not None:
            token = config.tokens.get(digest)
            if token is not None and token.gateways and gateway.name not in token.gateways:
                token = None
        if gateway.authentication and token is None:
            raise APIError(401, "this gateway needs a valid gateway token "
                           "(cf-aig-authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip
        return token

    async def admit(call: Call) -> None:
        """Count the request against the gateway's and its token's limits; 429 with
        Retry-After when one is full (nothing is then charged)."""
        subjects = [(f"gateway:{call.gateway.name}", limit) for limit in call.gateway.limits]
        if call.token is not None:
            subjects += [(f"token:{call.token.name}", limit) for limit in call.token.limits]
        if not subjects:
            return
        reservation = None  # max_tokens, read only when a token limit needs it
        admitted: list[Admission] = []
        for subject, limit in subjects:
            if limit.kind == "tokens" and reservation is None:
                reservation = _reservation(call.request_body)
            cost = 1 if limit.kind == "requests" else reservation
            key = f"{subject}:{limit.kind}:{limit.technique}:{limit.window_s:g}"
            result = await counters.admit(key, limit, cost)
            if isinstance(result, Admission):
                admitted.append(result)
                continue
            for taken in admitted:
                await counters.adjust(taken, -taken.cost)
            who = subject.replace(":", " ", 1)
            raise RateLimited(429, f"rate limit of {who}: {limit.limit} {limit.kind} per "
                              f"{limit.window_s:g} s ({limit.technique} window)",
                              type="rate_limit_error", code="rate_limit_exceeded",
                              retry_after=result)  # fmt: skip
        call.reserved = [a for a in admitted if a.limit.kind == "tokens"]

    async def finish(call: Call, status: int, outcome: Outcome | None, usage: Usage,
                     error: str | None = None, response_body: bytes = b"") -> None:  # fmt: skip
        call.logged = True
        tokens_in, tokens_out = usage.prompt, usage.completion
        if tokens_in is not None or tokens_out is not None:
            used = (tokens_in or 0) + (tokens_out or 0)
            for reserved in call.reserved:  # the reservation becomes the tokens really used
                await counters.adjust(reserved, used - reserved.cost)
        call.reserved = []
        cost = None
        if call.custom_cost is not None:
            cost = (tokens_in or 0) * call.custom_cost[0] + (tokens_out or 0) * call.custom_cost[1]
        elif (price := config.prices.get(f"{call.provider}/{call.model}")) is not None:
            cost = ((tokens_in or 0) * price.input + (tokens_out or 0) * price.output) / 1e6
        row = {
            "id": call.log_id, "created": call.created, "gateway": call.gateway.name,
            "provider": call.provider, "model": call.model, "endpoint": call.endpoint,
            "status": status, "latency_ms": (time.monotonic() - call.started) * 1000,
            "ttfb_ms": outcome.first_byte_s * 1000 if outcome and outcome.first_byte_s else None,
            "tokens_in": tokens_in, "tokens_out": tokens_out, "cost": cost,
            "cache_status": call.cache_status,
            "step": outcome.step if outcome and outcome.response is not None else None,
            "attempts": outcome.attempts if outcome else 0, "stream": int(call.stream),
            "error": error, "metadata": call.metadata,
            "request_body": _text(call.request_body) if call.collect else None,
            "response_body": _text(response_body) if call.collect else None,
        }  # fmt: skip
        store.write(row)  # inserted by the store's writer thread
        if access_logger.isEnabledFor(logging.INFO):
            access_logger.info(json.dumps({k: row[k] for k in ("id", "gateway", "provider", "model",
                                                               "status", "latency_ms", "error")}))  # fmt: skip

    async def relay(call: Call, steps: list[Step], strip_usage: bool) -> Response:
        if call.cache_key is None:
            return await forward(call, steps, strip_usage)
        entry, _ = await cache.lookup(call.cache_key)
        if entry is not None:
            return await replay(call, entry)
        call.cache_status = "MISS"
        try:
            return await forward(call, steps, strip_usage)
        except BaseException:
            await cache.done(call.cache_key, None, call.cache_ttl_s)
            raise

    async def replay(call: Call, entry: Entry) -> Response:
        """A cached answer, the same bytes as the first time."""
        call.cache_status = "HIT"
        call.provider = entry.provider or call.provider
        tap = UsageTap(entry.headers.get("content-type", ""), False, call.collect)
        tap.feed(entry.body)
        tap.finish()
        await finish(call, entry.status, None, tap.usage, None, tap.kept)
        headers = {**entry.headers, "cf-aig-log-id": call.log_id, "cf-aig-step": str(entry.step),
                   "cf-aig-cache-status": "HIT"}  # fmt: skip
        return Response(entry.body, status_code=entry.status, headers=headers)

    async def forward(call: Call, steps: list[Step], strip_usage: bool) -> Response:
        outcome = await send(client, steps, breaker)
        gateway_headers = {"cf-aig-log-id": call.log_id}
        if call.cache_status:
            gateway_headers["cf-aig-cache-status"] = call.cache_status
        if outcome.response is None:
            if call.cache_key:
                await cache.done(call.cache_key, None, call.cache_ttl_s)
            return await failed(call, outcome, gateway_headers)
        response = outcome.response
        step = steps[outcome.step]
        call.provider = step.provider.name
        gateway_headers["cf-aig-step"] = str(outcome.step)
        headers = {k: v for k, v in response.headers.items() if k not in _RESPONSE_DROPPED}
        record = call.cache_key is not None and 200 <= response.status_code < 300
        tap = UsageTap(response.headers.get("content-type", ""), strip_usage, call.collect, record)

        async def wrap_up(error: str | None) -> None:
            """After the answer: close it, fill or release the cache, log the row."""
            await response.aclose()
            if call.cache_key is not None:
                entry = None
                if record and error is None:
                    kept = {k: v for k, v in headers.items() if k in KEPT_HEADERS}
                    entry = Entry(response.status_code, kept, b"".join(tap.recorded),
                                  call.provider, outcome.step)  # fmt: skip
                await cache.done(call.cache_key, entry, call.cache_ttl_s)
            await finish(call, response.status_code, outcome, tap.usage, error, tap.kept)

        if _whole(response.headers):
            # A small answer that is not a stream: read whole, then sent in one piece. The
            # client gets no byte of it sooner either way; one that breaks off is a 502.
            try:
                data = await response.aread()
            except UpstreamError as e:
                await response.aclose()
                if call.cache_key is not None:
                    await cache.done(call.cache_key, None, call.cache_ttl_s)
                raise APIError(502, f"the upstream answer broke off: {type(e).__name__}",
                               type="server_error", code="upstream_unavailable") from None  # fmt: skip
            data = tap.feed(data) + tap.finish()
            later(wrap_up(None))
            return Response(data, status_code=response.status_code,
                            headers={**headers, **gateway_headers})  # fmt: skip

        async def body() -> AsyncIterator[bytes]:
            error, complete = None, False
            try:
                async for chunk in response.aiter_raw():
                    out = tap.feed(chunk)
                    if out:
                        yield out
                rest = tap.finish()
                if rest:
                    yield rest
                complete = True
            except UpstreamError as e:
                error = f"the upstream answer broke off: {type(e).__name__}"
                raise
            finally:
                if not complete and error is None and not tap.ended:
                    error = "the client went away before the answer was complete"
                # A task of its own: when the client goes away this generator is cancelled,
                # and the log row and the cache waiters must not go with it.
                later(wrap_up(error))

        return Relay(body(), response.status_code, {**headers, **gateway_headers})

    def plan_cache(request: Request, call: Call) -> None:
        """Whether this answer may come from the cache, and under which key."""
        headers = request.headers
        ttl = _int_option({}, "", headers, "cf-aig-cache-ttl", 0, None)
        ttl = call.gateway.cache_ttl_s if ttl is None else ttl
        if not ttl or headers.get("cf-aig-skip-cache", "").lower() == "true":
            return
        custom = headers.get("cf-aig-cache-key")
        parts = {"gateway": call.gateway.name, "custom": custom}
        if custom is None:
            parts |= {"route": call.endpoint, "provider": call.provider, "model": call.model,
                      "method": request.method, "query": request.url.query,
                      "credentials": credentials_hash(headers)}  # fmt: skip
        call.cache_key = cache_key(parts, b"" if custom is not None else call.request_body)
        call.cache_ttl_s = ttl

    async def failed(call: Call, outcome: Outcome, headers: dict[str, str]) -> Response:
        """Every step failed: the last provider error answer as it came, else 502 / 504."""
        last = outcome.failures[-1] if outcome.failures else None
        reasons = "; ".join(f"step {f.step} ({f.provider}): {f.reason}" for f in outcome.failures)
        if last is not None:
            call.provider = last.provider
        if last is not None and last.status is not None:
            kept = {k: v for k, v in last.headers.items() if k not in _RESPONSE_DROPPED}
            await finish(call, last.status, outcome, Usage(), reasons, last.body)
            return Response(last.body, status_code=last.status, headers={**kept, **headers})
        timeout = last is not None and last.reason.startswith("timeout")
        status, code = (504, "upstream_timeout") if timeout else (502, "upstream_unavailable")
        error = APIError(status, f"no provider answered: {reasons or 'no step to try'}",
                         type="server_error", code=code)  # fmt: skip
        body = json.dumps(error.body()).encode()
        await finish(call, status, outcome, Usage(), reasons, body)
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    def options(request: Request, gateway: Gateway, step_config: dict | None = None) -> tuple[float, Retry]:  # fmt: skip
        """Timeout (s) and retries: the universal step's config, else the request's
        cf-aig-* headers, else the gateway's defaults."""
        h, c = request.headers, step_config or {}
        timeout = _int_option(c, "requestTimeout", h, "cf-aig-request-timeout", 1, None)
        attempts = _int_option(c, "maxAttempts", h, "cf-aig-max-attempts", 1, MAX_ATTEMPTS)
        delay = _int_option(c, "retryDelay", h, "cf-aig-retry-delay", 0, None)
        backoff = c.get("backoff", h.get("cf-aig-backoff"))
        if backoff is not None and backoff not in BACKOFFS:
            raise APIError(400, f"backoff {backoff!r} is not one of {', '.join(BACKOFFS)}",
                           param="cf-aig-backoff")  # fmt: skip
        default = gateway.retry
        retry = Retry(attempts or default.max_attempts,
                      default.retry_delay_ms if delay is None else delay,
                      backoff or default.backoff)  # fmt: skip
        return (timeout or gateway.request_timeout_ms) / 1000, retry

    def admin(request: Request) -> None:
        """401 on a read route without the admin token, when the config sets one."""
        if config.admin_sha256 is None:
            return
        digest = _bearer_sha256(request)
        if digest is None or not hmac.compare_digest(digest, config.admin_sha256):
            raise APIError(401, "this route needs the gateway's admin token "
                           "(Authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip

    @route("/health")
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @route("/metrics", admin_only=True)
    async def metrics(request: Request) -> Response:
        text = await asyncio.to_thread(render_metrics, store, breaker.opened, cache.hits,
                                       cache.misses)  # fmt: skip
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @route("/dashboard")
    async def dashboard(request: Request) -> Response:
        return HTMLResponse(DASHBOARD.read_text())

    @route("/dashboard/api/gateways", admin_only=True)
    async def gateways(request: Request) -> Response:
        return JSONResponse({"gateways": list(config.gateways)})

    @route("/{gateway}/analytics", admin_only=True)
    async def analytics_route(request: Request) -> Response:
        name = gateway_of(request.path_params["gateway"]).name
        start, end = _time_range(request)
        group_by = request.query_params.get("group_by", "provider,model")
        if group_by not in GROUPINGS:
            raise APIError(400, f"group_by must be one of {', '.join(map(repr, GROUPINGS))}",
                           param="group_by")  # fmt: skip
        result = await asyncio.to_thread(analytics, store, name, start, end, group_by)
        return JSONResponse(result)

    @route("/{gateway}/analytics/timeseries", admin_only=True)
    async def timeseries_route(request: Request) -> Response:
        name = gateway_of(request.path_params["gateway"]).name
        start, end = _time_range(request)
        bucket = _query_number(request, "bucket_s", 60, 1)
        buckets = await asyncio.to_thread(timeseries, store, name, start, end, int(bucket))
        return JSONResponse({"buckets": buckets})

    @route("/{gateway}/logs", admin_only=True)
    async def logs(request: Request) -> Response:
        name = gateway_of(request.path_params["gateway"]).name
        q = request.query_params
        start, end = _time_range(request)
        limit = int(_query_number(request, "limit", 20, 1, 500))
        offset = int(_query_number(request, "offset", 0, 0))
        filters = {k: q[k] for k in ("provider", "model", "status", "cache", "search") if q.get(k)}
        total, rows = await asyncio.to_thread(store.page, name, limit, offset, start, end,
                                              filters)  # fmt: skip
        return JSONResponse({"total": total, "rows": rows})

    @route("/{gateway}/logs/{log_id}", admin_only=True)
    async def log_entry(request: Request) -> Response:
        name = gateway_of(request.path_params["gateway"]).name
        log_id = request.path_params["log_id"]
        row = await asyncio.to_thread(store.get, name, log_id)
        if row is None:
            raise APIError(404, f"no log entry {log_id!r} in gateway {name!r}", code="not_found")
        return JSONResponse(row)

    @route("/{gateway}/compat/chat/completions", ("POST",))
    async def compat(request: Request) -> Response:
        call = await start(request, request.path_params["gateway"], "compat/chat/completions")
        body = json_object(call.request_body)
        model = body.get("model")
        if not isinstance(model, str) or "/" not in model:
            raise APIError(400, "model must be 'provider/model'", param="model")
        provider_name, call.model = model.split("/", 1)
        provider = provider_of(provider_name, "model")
        call.provider = provider.name
        body["model"] = call.model
        strip = _ask_usage(body)
        call.stream = bool(body.get("stream"))
        timeout, retry = options(request, call.gateway)
        step = Step(provider, "POST", _CHAT_PATH[provider.kind], "", json.dumps(body).encode(),
                    _json_headers(request.headers), timeout, retry)  # fmt: skip
        plan_cache(request, call)
        return await relay(call, [step], strip)

    @route("/{gateway}", ("POST",))
    async def universal(request: Request) -> Response:
        call = await start(request, request.path_params["gateway"], "universal")
        try:
            steps_in = json.loads(call.request_body)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        if not isinstance(steps_in, list) or not steps_in:
            raise APIError(400, "the universal route takes a JSON array of steps "
                           "{provider, endpoint, headers, query, config}")  # fmt: skip
        steps, strips = [], []
        for i, raw in enumerate(steps_in):
            if not isinstance(raw, dict):
                raise APIError(400, f"step {i} is not an object", param=f"{i}")
            provider = provider_of(raw.get("provider"), f"{i}.provider")
            endpoint, query = raw.get("endpoint"), raw.get("query", {})
            if not isinstance(endpoint, str) or not isinstance(query, dict):
                raise APIError(400, f"step {i}: endpoint must be a string and query a JSON "
                               "object (the body sent upstream)", param=f"{i}")  # fmt: skip
            extra = raw.get("headers", {})
            config_in = raw.get("config", {})
            if not isinstance(extra, dict) or not isinstance(config_in, dict):
                raise APIError(400, f"step {i}: headers and config must be objects", param=f"{i}")
            strips.append(_ask_usage(query))
            extra = outgoing_headers({str(k).lower(): str(v) for k, v in extra.items()})
            if (problem := check_headers(extra)) is not None:
                raise APIError(400, f"step {i}: {problem}", param=f"{i}.headers")
            headers = {**_json_headers(request.headers), **extra}
            timeout, retry = options(request, call.gateway, config_in)
            path = f"run/{endpoint}" if endpoint.startswith("@") else endpoint.lstrip("/")
            steps.append(Step(provider, "POST", path, "", json.dumps(query).encode(), headers,
                              timeout, retry))  # fmt: skip
        first = steps_in[0]
        call.model = first["query"].get("model") if isinstance(first.get("query"), dict) else None
        call.stream = bool(first.get("query", {}).get("stream"))
        plan_cache(request, call)
        return await relay(call, steps, strip_usage=all(strips))

    @route("/{gateway}/{provider}/{path:path}", ("GET", "POST"))
    async def passthrough(request: Request) -> Response:
        gateway, provider, path = (request.path_params[k] for k in ("gateway", "provider", "path"))
        call = await start(request, gateway, path)
        target = provider_of(provider)
        call.provider = target.name
        body = call.request_body
        strip = False
        if body and path.endswith("completions"):
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                data = None  # passed through as it is; the provider judges it
            if isinstance(data, dict):
                call.model = data.get("model") if isinstance(data.get("model"), str) else None
                call.stream = bool(data.get("stream"))
                if target.kind in ("openai", "infire") and _ask_usage(data):
                    body, strip = json.dumps(data).encode(), True
        timeout, retry = options(request, call.gateway)
        step = Step(target, request.method, path, request.url.query, body,
                    outgoing_headers(dict(request.headers)), timeout, retry)  # fmt: skip
        plan_cache(request, call)
        return await relay(call, [step], strip)

    for exc_type in (HTTPException, Exception):
        app.add_exception_handler(exc_type, error_response)

    async def refused(request: Request, exc: APIError) -> Response:
        """The error answer, logged when it ends a call that was not logged yet."""
        call = getattr(request.state, "call", None)
        if call is not None and not call.logged:
            await finish(call, exc.status, None, Usage(), exc.message)
        if isinstance(exc, RateLimited):
            response = JSONResponse(exc.body(), status_code=429, headers={
                "retry-after": str(max(1, math.ceil(exc.retry_after)))})  # fmt: skip
        else:
            response = error_response(request, exc)
        if call is not None:
            response.headers["cf-aig-log-id"] = call.log_id
        return response

    app.add_exception_handler(APIError, refused)
    return app


@dataclass
class RateLimited(APIError):
    """429 with the seconds after which the limit admits the request."""

    retry_after: float = 1.0


def _bearer_sha256(request: Request) -> str | None:
    """The SHA-256 (hex) of the bearer token in cf-aig-authorization, else Authorization."""
    headers = request.headers
    value = headers.get("cf-aig-authorization") or headers.get("authorization", "")
    if value[:7].lower() != "bearer ":
        return None
    return hashlib.sha256(value[7:].strip().encode()).hexdigest()


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


def _reservation(body: bytes) -> int:
    """Tokens a request reserves against token limits: its max_tokens, at least 1."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return 1
    if isinstance(data, list) and data and isinstance(data[0], dict):  # universal steps
        data = data[0].get("query")
    if not isinstance(data, dict):
        return 1
    value = data.get("max_tokens", data.get("max_completion_tokens"))
    return value if isinstance(value, int) and value > 0 else 1


class Usage:
    """Token counts found in an answer (None when it had none)."""

    __slots__ = ("prompt", "completion")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None

    def take(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            self.prompt = prompt if isinstance(prompt, int) else self.prompt
            self.completion = completion if isinstance(completion, int) else self.completion


WHOLE_MAX_BYTES = 1 << 20  # answers up to this size (not streams) are read whole


def _whole(headers: dict[str, str]) -> bool:
    """Whether an answer is small, of known length and not a stream of events."""
    length = headers.get("content-length", "")
    return (length.isdigit() and int(length) <= WHOLE_MAX_BYTES
            and not headers.get("content-type", "").startswith("text/event-stream"))  # fmt: skip


class Relay(Response):
    """An answer sent on chunk by chunk as it comes. When the client goes away, the sending
    stops (and with it the reading upstream): one asyncio task waits for that, where
    Starlette's StreamingResponse spends an anyio task group per answer."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int,
                 headers: dict[str, str]) -> None:  # fmt: skip
        self.chunks = chunks
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.current_task()
        assert sending is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            sending.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            if hasattr(sending, "uncancel"):  # Python 3.11+: the cancel was ours, undo it
                sending.uncancel()
        finally:
            watcher.cancel()
            await self.chunks.aclose()  # type: ignore[attr-defined]


class UsageTap:
    """Watches an answer as it is relayed: finds its token usage, keeps the start of it
    for the log, and (strip) removes from a server-sent event stream the usage that the
    gateway asked for on the client's behalf. Events go on as soon as they are whole."""

    def __init__(self, content_type: str, strip: bool, keep: bool, record: bool = False) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.strip = strip and self.sse
        self.keep = keep
        self.record = record
        self.recorded: list[bytes] = []  # with record: every byte the client got
        self.usage = Usage()
        self.ended = False  # a server-sent event stream's closing `data: [DONE]` went by
        self.kept = b""
        self._pending = b""  # SSE: the unfinished event; JSON: the body so far

    def feed(self, chunk: bytes) -> bytes:
        out = self._feed(chunk)
        if self.record and out:
            self.recorded.append(out)
        return out

    def finish(self) -> bytes:
        out = self._finish()
        if self.record and out:
            self.recorded.append(out)
        return out

    def _feed(self, chunk: bytes) -> bytes:
        if self.keep and len(self.kept) < PAYLOAD_LIMIT:
            self.kept += chunk[: PAYLOAD_LIMIT - len(self.kept)]
        if not self.sse:
            if len(self._pending) < USAGE_SCAN_LIMIT:
                self._pending += chunk
            return chunk
        self._pending += chunk
        whole, separator, rest = self._pending.rpartition(b"\n\n")
        if not separator:
            return b"" if self.strip else chunk
        self._pending = rest
        out = [self._event(e) for e in whole.split(b"\n\n")]
        if not self.strip:
            return chunk
        return b"".join(e + b"\n\n" for e in out if e is not None)

    def _finish(self) -> bytes:
        if self.sse:
            rest, self._pending = self._pending, b""
            if rest.strip():
                out = self._event(rest)
                return (out or b"") if self.strip else b""
            return rest if self.strip else b""
        try:
            data = json.loads(self._pending)
        except (ValueError, UnicodeDecodeError):
            return b""
        if isinstance(data, dict):
            self.usage.take(data.get("usage"))
            if isinstance(data.get("result"), dict):  # Workers AI's envelope
                self.usage.take(data["result"].get("usage"))
        return b""

    def _event(self, event: bytes) -> bytes | None:
        """The event to send on (None: dropped), its usage noted."""
        text = event.strip(b"\r\n")
        if text == b"data: [DONE]":
            self.ended = True
        if not text.startswith(b"data:") or b'"usage"' not in text:
            return event
        try:
            data = json.loads(text[5:])
        except (ValueError, UnicodeDecodeError):
            return event
        if not isinstance(data, dict):
            return event
        self.usage.take(data.get("usage"))
        if not self.strip:
            return event
        if not data.get("choices") and data.get("usage"):
            return None  # the usage-only chunk the client did not ask for
        data.pop("usage", None)
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()


def _ask_usage(body: dict[str, Any]) -> bool:
    """For a streamed request without include_usage: ask for it (True: strip it later)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                              "include_usage": True}  # fmt: skip
    return True


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json_headers(headers: Any) -> dict[str, str]:
    """The client's headers for a body the gateway rewrote as JSON."""
    kept = outgoing_headers(dict(headers))
    kept.pop("content-type", None)
    return {**kept, "content-type": "application/json"}


def _json_header(headers: Any, name: str, kind: type) -> Any:
    value = headers.get(name)
    if value is None:
        return None
    try:
        data = json.loads(value)
    except ValueError:
        raise APIError(400, f"header {name} is not valid JSON", param=name) from None
    if not isinstance(data, kind):
        raise APIError(400, f"header {name} must be a JSON {kind.__name__}", param=name)
    return data


def _int_option(config: dict, key: str, headers: Any, header: str, low: int,
                high: int | None) -> int | None:  # fmt: skip
    value = config.get(key, headers.get(header))
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise APIError(400, f"{header} must be an integer", param=header) from None
    if number < low or (high is not None and number > high):
        raise APIError(400, f"{header} must be between {low} and {high or 'any'}", param=header)
    return number


def _text(data: bytes) -> str | None:
    if not data:
        return None
    return data[:PAYLOAD_LIMIT].decode("utf-8", errors="replace")
