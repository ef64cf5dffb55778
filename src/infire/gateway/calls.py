"""One client request through the gateway (`Call`) and its row in the request log (`CallLog`).

A row has the call's status, latency, time to first byte, token usage, cost (the client's
`cf-aig-custom-cost`, else the configured price of provider/model), cache status, step and
attempts, `cf-aig-metadata` and, unless `cf-aig-collect-log-payload: false`, the bodies.
It goes to the SQLite store's writer thread and, as one JSON line, to the access log.
Finishing a call also settles its token reservations against the rate limits.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from infire.gateway.config import Gateway, Price, Token
from infire.gateway.limits import Admission
from infire.gateway.store import LogStore
from infire.gateway.upstream import Outcome
from infire.gateway.usage import Usage, payload_text

if TYPE_CHECKING:
    from infire.gateway.access import Access

access_logger = logging.getLogger("infire.gateway.access")  # a JSON line per request
_ACCESS_FIELDS = ("id", "gateway", "provider", "model", "status", "latency_ms", "error")


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


class CallLog:
    """Writes each call's row once it is answered (or refused)."""

    def __init__(self, store: LogStore, prices: dict[str, Price], access: Access) -> None:
        self._store = store
        self._prices = prices
        self._access = access

    async def finish(self, call: Call, status: int, outcome: Outcome | None, usage: Usage,
                     error: str | None = None, response_body: bytes = b"") -> None:  # fmt: skip
        """The call is over: settle its reservations, log its row."""
        call.logged = True
        await self._access.settle(call, usage)
        row = self._row(call, status, outcome, usage, error, response_body)
        self._store.write(row)  # inserted by the store's writer thread
        if access_logger.isEnabledFor(logging.INFO):
            access_logger.info(json.dumps({k: row[k] for k in _ACCESS_FIELDS}))

    def _cost(self, call: Call, usage: Usage) -> float | None:
        """USD: the client's custom cost, else the configured price, else unknown."""
        tokens_in, tokens_out = usage.prompt or 0, usage.completion or 0
        if call.custom_cost is not None:
            return tokens_in * call.custom_cost[0] + tokens_out * call.custom_cost[1]
        price = self._prices.get(f"{call.provider}/{call.model}")
        if price is None:
            return None
        return (tokens_in * price.input + tokens_out * price.output) / 1e6

    def _row(self, call: Call, status: int, outcome: Outcome | None, usage: Usage,
             error: str | None, response_body: bytes) -> dict[str, Any]:  # fmt: skip
        answered = outcome is not None and outcome.response is not None
        return {
            "id": call.log_id, "created": call.created, "gateway": call.gateway.name,
            "provider": call.provider, "model": call.model, "endpoint": call.endpoint,
            "status": status, "latency_ms": (time.monotonic() - call.started) * 1000,
            "ttfb_ms": outcome.first_byte_s * 1000 if outcome and outcome.first_byte_s else None,
            "tokens_in": usage.prompt, "tokens_out": usage.completion,
            "cost": self._cost(call, usage), "cache_status": call.cache_status,
            "step": outcome.step if answered else None,
            "attempts": outcome.attempts if outcome else 0, "stream": int(call.stream),
            "error": error, "metadata": call.metadata,
            "request_body": payload_text(call.request_body) if call.collect else None,
            "response_body": payload_text(response_body) if call.collect else None,
        }  # fmt: skip
