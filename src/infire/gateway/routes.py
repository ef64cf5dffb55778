"""The proxy routes: each turns a client request into a `Call` and the steps to try.

- `POST|GET /{gateway}/{provider}/{path}` (`passthrough`): the provider's base URL + path,
  with the query string and the body as they are, the provider's key added;
- `POST /{gateway}/compat/chat/completions` (`compat`): OpenAI chat completions with
  `model: "{provider}/{model}"`, sent to that provider's chat completions endpoint;
- `POST /{gateway}` (`universal`): a JSON array of steps `{provider, endpoint, headers,
  query, config: {requestTimeout, maxAttempts, retryDelay, backoff}}` tried in order.

Every call starts the same way: the body read (413 past the limit), the `cf-aig-*` headers
checked, the gateway token authenticated and the rate limits charged; a refusal is logged
too. Then the call's timeout, retries and cache key are planned and the relay answers it.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from infire.gateway.access import Access
from infire.gateway.cache import cache_key, credentials_hash
from infire.gateway.calls import Call, CallLog
from infire.gateway.config import BACKOFFS, MAX_ATTEMPTS, Gateway, GatewayConfig, Provider, Retry
from infire.gateway.http1 import check_headers
from infire.gateway.relay import Relay
from infire.gateway.upstream import Step, outgoing_headers
from infire.gateway.usage import Usage, ask_usage
from infire.http_errors import APIError, json_object

# Where each kind of provider has OpenAI's chat completions, below its base URL.
_CHAT_PATH = {"openai": "chat/completions", "infire": "v1/chat/completions",
              "workers-ai": "v1/chat/completions"}  # fmt: skip


class Router:
    """The routes that send requests upstream, over a config's gateways and providers."""

    def __init__(self, config: GatewayConfig, access: Access, log: CallLog, relay: Relay) -> None:
        self._config = config
        self._access = access
        self._log = log
        self._relay = relay

    async def passthrough(self, request: Request) -> Response:
        gateway, provider, path = (request.path_params[k] for k in ("gateway", "provider", "path"))
        call = await self._start(request, gateway, path)
        target = self._provider(provider)
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
                if target.kind in ("openai", "infire") and ask_usage(data):
                    body, strip = json.dumps(data).encode(), True
        timeout, retry = _options(request, call.gateway)
        step = Step(target, request.method, path, request.url.query, body,
                    outgoing_headers(dict(request.headers)), timeout, retry)  # fmt: skip
        _plan_cache(request, call)
        return await self._relay.answer(call, [step], strip)

    async def compat(self, request: Request) -> Response:
        call = await self._start(request, request.path_params["gateway"], "compat/chat/completions")
        body = json_object(call.request_body)
        model = body.get("model")
        if not isinstance(model, str) or "/" not in model:
            raise APIError(400, "model must be 'provider/model'", param="model")
        provider_name, call.model = model.split("/", 1)
        provider = self._provider(provider_name, "model")
        call.provider = provider.name
        body["model"] = call.model
        strip = ask_usage(body)
        call.stream = bool(body.get("stream"))
        timeout, retry = _options(request, call.gateway)
        step = Step(provider, "POST", _CHAT_PATH[provider.kind], "", json.dumps(body).encode(),
                    _json_headers(request.headers), timeout, retry)  # fmt: skip
        _plan_cache(request, call)
        return await self._relay.answer(call, [step], strip)

    async def universal(self, request: Request) -> Response:
        call = await self._start(request, request.path_params["gateway"], "universal")
        try:
            steps_in = json.loads(call.request_body)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        if not isinstance(steps_in, list) or not steps_in:
            raise APIError(400, "the universal route takes a JSON array of steps "
                           "{provider, endpoint, headers, query, config}")  # fmt: skip
        steps, strips = [], []
        for i, raw in enumerate(steps_in):
            step, strip = self._universal_step(request, call.gateway, i, raw)
            steps.append(step)
            strips.append(strip)
        first = steps_in[0]
        call.model = first["query"].get("model") if isinstance(first.get("query"), dict) else None
        call.stream = bool(first.get("query", {}).get("stream"))
        _plan_cache(request, call)
        return await self._relay.answer(call, steps, strip_usage=all(strips))

    def _universal_step(self, request: Request, gateway: Gateway, i: int,
                        raw: Any) -> tuple[Step, bool]:  # fmt: skip
        """Step i of the universal route, and whether the usage it asks for is to be
        stripped from the answer."""
        if not isinstance(raw, dict):
            raise APIError(400, f"step {i} is not an object", param=f"{i}")
        provider = self._provider(raw.get("provider"), f"{i}.provider")
        endpoint, query = raw.get("endpoint"), raw.get("query", {})
        if not isinstance(endpoint, str) or not isinstance(query, dict):
            raise APIError(400, f"step {i}: endpoint must be a string and query a JSON "
                           "object (the body sent upstream)", param=f"{i}")  # fmt: skip
        extra = raw.get("headers", {})
        config_in = raw.get("config", {})
        if not isinstance(extra, dict) or not isinstance(config_in, dict):
            raise APIError(400, f"step {i}: headers and config must be objects", param=f"{i}")
        strip = ask_usage(query)
        extra = outgoing_headers({str(k).lower(): str(v) for k, v in extra.items()})
        if (problem := check_headers(extra)) is not None:
            raise APIError(400, f"step {i}: {problem}", param=f"{i}.headers")
        headers = {**_json_headers(request.headers), **extra}
        timeout, retry = _options(request, gateway, config_in)
        path = f"run/{endpoint}" if endpoint.startswith("@") else endpoint.lstrip("/")
        step = Step(provider, "POST", path, "", json.dumps(query).encode(), headers, timeout,
                    retry)  # fmt: skip
        return step, strip

    async def _start(self, request: Request, gateway: str, endpoint: str) -> Call:
        """The call's log record, with the body read (413 past the limit), the headers
        checked, the token authenticated and the limits charged."""
        call = Call(gateway_of(self._config, gateway), endpoint)
        request.state.call = call  # so that an error answer is logged too
        headers = request.headers
        call.collect = headers.get("cf-aig-collect-log-payload", "true").lower() != "false"
        call.metadata = _json_header(headers, "cf-aig-metadata", dict)
        call.custom_cost = _custom_cost(headers)
        try:
            call.request_body = await _read_body(request, self._config.max_body_bytes)
            call.token = self._access.authenticate(request, call.gateway)
            await self._access.admit(call)
        except APIError as e:
            await self._log.finish(call, e.status, None, Usage(), e.message)
            raise
        return call

    def _provider(self, name: Any, param: str | None = None) -> Provider:
        if not isinstance(name, str) or name not in self._config.providers:
            raise APIError(
                404, f"unknown provider {name!r}", code="provider_not_found", param=param
            )
        return self._config.providers[name]


def gateway_of(config: GatewayConfig, name: str) -> Gateway:
    """The configured gateway of a route's {gateway}; 404 when there is none."""
    if name not in config.gateways:
        raise APIError(404, f"unknown gateway {name!r}", code="gateway_not_found")
    return config.gateways[name]


def _plan_cache(request: Request, call: Call) -> None:
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


def _options(request: Request, gateway: Gateway,
             step_config: dict | None = None) -> tuple[float, Retry]:  # fmt: skip
    """Timeout (s) and retries: the universal step's config, else the request's cf-aig-*
    headers, else the gateway's defaults."""
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


def _custom_cost(headers: Any) -> tuple[float, float] | None:
    """cf-aig-custom-cost: USD per input and per output token."""
    cost = _json_header(headers, "cf-aig-custom-cost", dict)
    if cost is None:
        return None
    try:
        return float(cost.get("per_token_in", 0)), float(cost.get("per_token_out", 0))
    except (TypeError, ValueError):
        raise APIError(400, "cf-aig-custom-cost: per_token_in and per_token_out must "
                       "be numbers", param="cf-aig-custom-cost") from None  # fmt: skip


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
