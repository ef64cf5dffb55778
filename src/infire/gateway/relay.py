"""The relay: a call's answer, from the cache or from upstream, on its way to the client.

A cacheable call first looks its key up (concurrent misses of one key collapse in
cache.Cache); a hit is replayed byte for byte. Otherwise the steps are sent upstream
(upstream.send: retries, timeouts, fallbacks, the circuit breaker) and the answer goes on
as it comes: a small JSON answer in one piece, anything else (server-sent events first)
chunk by chunk, through a UsageTap that finds its usage. When every step failed, the
client gets the last provider's error answer as it came, else 502 / 504. After the answer,
a task of its own fills or releases the cache and logs the row, so that neither is lost
when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from infire.gateway.cache import KEPT_HEADERS, Cache, Entry
from infire.gateway.calls import Call, CallLog
from infire.gateway.http1 import Pool, UpstreamError
from infire.gateway.http1 import Response as UpstreamResponse
from infire.gateway.upstream import CircuitBreaker, Outcome, Step, send
from infire.gateway.usage import Usage, UsageTap
from infire.http_errors import APIError

WHOLE_MAX_BYTES = 1 << 20  # answers up to this size (not streams) are read whole
_RESPONSE_DROPPED = {"content-length", "transfer-encoding", "connection", "keep-alive",
                     "content-encoding"}  # fmt: skip


@dataclass(slots=True)
class Relayed:
    """An upstream answer being relayed for a call."""

    call: Call
    outcome: Outcome
    response: UpstreamResponse
    headers: dict[str, str]  # the upstream's, less the hop-by-hop ones
    tap: UsageTap


class Relay:
    """Sends calls upstream over one connection pool and relays the answers."""

    def __init__(self, pool: Pool, breaker: CircuitBreaker, cache: Cache, log: CallLog) -> None:
        self._pool = pool
        self._breaker = breaker
        self._cache = cache
        self._log = log
        self._pending: set[asyncio.Task] = set()  # wrap-ups running after their answers

    async def answer(self, call: Call, steps: list[Step], strip_usage: bool) -> Response:
        """The client's answer: from the cache when the call may use it, else upstream's
        (strip_usage: remove the usage the gateway asked for from a stream)."""
        if call.cache_key is None:
            return await self._forward(call, steps, strip_usage)
        entry, _ = await self._cache.lookup(call.cache_key)
        if entry is not None:
            return await self._replay(call, entry)
        call.cache_status = "MISS"
        try:
            return await self._forward(call, steps, strip_usage)
        except BaseException:
            await self._release(call)
            raise

    async def drain(self) -> None:
        """Wait for the wrap-ups of answers already sent (rows to log, cache to fill)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, call: Call) -> None:
        """No answer for the cache: wake the identical requests waiting on this one."""
        if call.cache_key is not None:
            await self._cache.done(call.cache_key, None, call.cache_ttl_s)

    async def _replay(self, call: Call, entry: Entry) -> Response:
        """A cached answer, the same bytes as the first time."""
        call.cache_status = "HIT"
        call.provider = entry.provider or call.provider
        tap = UsageTap(entry.headers.get("content-type", ""), False, call.collect)
        tap.feed(entry.body)
        tap.finish()
        await self._log.finish(call, entry.status, None, tap.usage, None, tap.kept)
        headers = {**entry.headers, "cf-aig-log-id": call.log_id, "cf-aig-step": str(entry.step),
                   "cf-aig-cache-status": "HIT"}  # fmt: skip
        return Response(entry.body, status_code=entry.status, headers=headers)

    async def _forward(self, call: Call, steps: list[Step], strip_usage: bool) -> Response:
        outcome = await send(self._pool, steps, self._breaker)
        gateway_headers = {"cf-aig-log-id": call.log_id}
        if call.cache_status:
            gateway_headers["cf-aig-cache-status"] = call.cache_status
        if outcome.response is None:
            await self._release(call)
            return await self._failed(call, outcome, gateway_headers)
        response = outcome.response
        call.provider = steps[outcome.step].provider.name
        gateway_headers["cf-aig-step"] = str(outcome.step)
        headers = {k: v for k, v in response.headers.items() if k not in _RESPONSE_DROPPED}
        record = call.cache_key is not None and 200 <= response.status_code < 300
        tap = UsageTap(response.headers.get("content-type", ""), strip_usage, call.collect, record)
        relayed = Relayed(call, outcome, response, headers, tap)
        if _whole(response.headers):
            return await self._whole_answer(relayed, {**headers, **gateway_headers})
        return StreamedResponse(self._chunks(relayed), response.status_code,
                                {**headers, **gateway_headers})  # fmt: skip

    async def _whole_answer(self, relayed: Relayed, headers: dict[str, str]) -> Response:
        """A small answer that is not a stream: read whole, then sent in one piece. The
        client gets no byte of it sooner either way; one that breaks off is a 502."""
        response = relayed.response
        try:
            data = await response.aread()
        except UpstreamError as e:
            await response.aclose()
            await self._release(relayed.call)
            raise APIError(502, f"the upstream answer broke off: {type(e).__name__}",
                           type="server_error", code="upstream_unavailable") from None  # fmt: skip
        data = relayed.tap.feed(data) + relayed.tap.finish()
        self._later(self._wrap_up(relayed, None))
        return Response(data, status_code=response.status_code, headers=headers)

    async def _chunks(self, relayed: Relayed) -> AsyncIterator[bytes]:
        """The answer's body as it comes, through the tap."""
        tap, error, complete = relayed.tap, None, False
        try:
            async for chunk in relayed.response.aiter_raw():
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
            self._later(self._wrap_up(relayed, error))

    async def _wrap_up(self, relayed: Relayed, error: str | None) -> None:
        """After the answer: close it, fill or release the cache, log the row."""
        call, response, tap = relayed.call, relayed.response, relayed.tap
        await response.aclose()
        if call.cache_key is not None:
            entry = None
            if tap.record and error is None:
                kept = {k: v for k, v in relayed.headers.items() if k in KEPT_HEADERS}
                entry = Entry(response.status_code, kept, b"".join(tap.recorded), call.provider,
                              relayed.outcome.step)  # fmt: skip
            await self._cache.done(call.cache_key, entry, call.cache_ttl_s)
        await self._log.finish(call, response.status_code, relayed.outcome, tap.usage, error,
                               tap.kept)  # fmt: skip

    async def _failed(self, call: Call, outcome: Outcome, headers: dict[str, str]) -> Response:
        """Every step failed: the last provider error answer as it came, else 502 / 504."""
        last = outcome.failures[-1] if outcome.failures else None
        reasons = "; ".join(f"step {f.step} ({f.provider}): {f.reason}" for f in outcome.failures)
        if last is not None:
            call.provider = last.provider
        if last is not None and last.status is not None:
            kept = {k: v for k, v in last.headers.items() if k not in _RESPONSE_DROPPED}
            await self._log.finish(call, last.status, outcome, Usage(), reasons, last.body)
            return Response(last.body, status_code=last.status, headers={**kept, **headers})
        timeout = last is not None and last.reason.startswith("timeout")
        status, code = (504, "upstream_timeout") if timeout else (502, "upstream_unavailable")
        error = APIError(status, f"no provider answered: {reasons or 'no step to try'}",
                         type="server_error", code=code)  # fmt: skip
        body = json.dumps(error.body()).encode()
        await self._log.finish(call, status, outcome, Usage(), reasons, body)
        return Response(body, status_code=status, media_type="application/json", headers=headers)


def _whole(headers: dict[str, str]) -> bool:
    """Whether an answer is small, of known length and not a stream of events."""
    length = headers.get("content-length", "")
    return (length.isdigit() and int(length) <= WHOLE_MAX_BYTES
            and not headers.get("content-type", "").startswith("text/event-stream"))  # fmt: skip


class StreamedResponse(Response):
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
