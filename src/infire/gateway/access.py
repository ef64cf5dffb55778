"""Who may use the gateway, and how much: gateway tokens, the admin token, rate limits.

A gateway token comes in `cf-aig-authorization` (or `Authorization`) as a bearer token and
is known by its SHA-256 only; a gateway with `authentication = true` refuses requests
without a valid one (401). The read routes need the admin token when the config sets
`[server] admin_sha256`. Admission charges a request against its gateway's limits and its
token's (a request limit 1, a token limit the request's max_tokens); when one is full
nothing is charged and the answer is 429 with Retry-After. When the call is logged, its
token reservations are settled to the tokens the answer really used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from starlette.requests import Request

from infire.gateway.calls import Call
from infire.gateway.config import Gateway, GatewayConfig, Token
from infire.gateway.limits import Admission, Counters, Limit
from infire.gateway.usage import Usage
from infire.http_errors import APIError


@dataclass
class RateLimited(APIError):
    """429 with the seconds after which the limit admits the request."""

    retry_after: float = 1.0


class Access:
    """The tokens and limits of a config, counted in `counters` (SQLite or Redis)."""

    def __init__(self, config: GatewayConfig, counters: Counters) -> None:
        self._tokens = config.tokens
        self._admin_sha256 = config.admin_sha256
        self._counters = counters

    def authenticate(self, request: Request, gateway: Gateway) -> Token | None:
        """The gateway token in cf-aig-authorization (or Authorization); 401 when the
        gateway needs one and there is none that is valid for it."""
        token = None
        digest = bearer_sha256(request)
        if digest is not None:
            token = self._tokens.get(digest)
            if token is not None and token.gateways and gateway.name not in token.gateways:
                token = None
        if gateway.authentication and token is None:
            raise APIError(401, "this gateway needs a valid gateway token "
                           "(cf-aig-authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip
        return token

    def require_admin(self, request: Request) -> None:
        """401 on a read route without the admin token, when the config sets one."""
        if self._admin_sha256 is None:
            return
        digest = bearer_sha256(request)
        if digest is None or not hmac.compare_digest(digest, self._admin_sha256):
            raise APIError(401, "this route needs the gateway's admin token "
                           "(Authorization: Bearer ...)", code="invalid_api_key")  # fmt: skip

    async def admit(self, call: Call) -> None:
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
                reservation = reserved_tokens(call.request_body)
            cost = 1 if limit.kind == "requests" else reservation
            key = f"{subject}:{limit.kind}:{limit.technique}:{limit.window_s:g}"
            result = await self._counters.admit(key, limit, cost)
            if isinstance(result, Admission):
                admitted.append(result)
                continue
            for taken in admitted:
                await self._counters.adjust(taken, -taken.cost)
            raise _refusal(subject, limit, result)
        call.reserved = [a for a in admitted if a.limit.kind == "tokens"]

    async def settle(self, call: Call, usage: Usage) -> None:
        """The tokens reserved against token limits become the tokens the answer used
        (kept as reserved when the answer had no usage)."""
        if usage.prompt is not None or usage.completion is not None:
            used = (usage.prompt or 0) + (usage.completion or 0)
            for reserved in call.reserved:
                await self._counters.adjust(reserved, used - reserved.cost)
        call.reserved = []


def _refusal(subject: str, limit: Limit, retry_after: float) -> RateLimited:
    who = subject.replace(":", " ", 1)
    return RateLimited(429, f"rate limit of {who}: {limit.limit} {limit.kind} per "
                       f"{limit.window_s:g} s ({limit.technique} window)",
                       type="rate_limit_error", code="rate_limit_exceeded",
                       retry_after=retry_after)  # fmt: skip


def bearer_sha256(request: Request) -> str | None:
    """The SHA-256 (hex) of the bearer token in cf-aig-authorization, else Authorization."""
    headers = request.headers
    value = headers.get("cf-aig-authorization") or headers.get("authorization", "")
    if value[:7].lower() != "bearer ":
        return None
    return hashlib.sha256(value[7:].strip().encode()).hexdigest()


def reserved_tokens(body: bytes) -> int:
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
