"""`infire balance`: one OpenAI / Workers AI front over prefill and decode workers.

Each generation request is split in two legs:
1. the prefill leg goes to a prefill worker (`infire serve --role prefill`) as the same
   request with `stream: false` and `kv_transfer_params: {"do_remote_decode": true}`;
   the worker runs the prompt, samples the first token, leases the KV blocks and answers
   with a handle in `kv_transfer_params`;
2. the decode leg goes to a decode worker (`--role decode`) as the client's own request
   plus that handle (and the prefill worker's URL, to release the lease at). The decode
   worker streams the first token at once, pulls the KV it lacks, decodes, and its answer
   (SSE or whole) goes to the client unchanged.

Picking workers: every worker reports its load on GET /load (polled every 200 ms): the
prefill worker with the fewest prompt tokens still to compute (its report plus the legs
this balancer sent since, estimated at 4 characters a token) wins; the decode worker with
the fewest sequences (running, queued, pulling and legs sent since), then the most free KV
blocks. A session (`x-session-affinity`, else a hash of the prompt's first 512
characters) goes back to the workers it used last, which hold its prefix, unless one of
them is down or has 4x the least-loaded worker's load.

Faults: a worker that does not answer its poll or a leg is marked down and polled again
after a backoff (0.5 s doubling to 8 s). A leg that fails before anything was streamed is
retried on another worker of its kind, then on a colocated (`--both`) worker; after that
the client gets a 502 in the API's error shape. Once the decode stream has started, a
broken stream ends with an error event. A client that leaves between the legs gets its
lease released at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger("infire.balance")
T = TypeVar("T")

POLL_SECONDS = 0.2
BACKOFF = (0.5, 8.0)
AFFINITY_ENTRIES = 10_000
AFFINITY_SLACK = 4.0  # a session leaves its workers when they carry 4x the least load
AFFINITY_TOKENS, AFFINITY_SEQS = 2048, 4  # ... plus this much
CHARS_PER_TOKEN = 4  # estimate for legs sent since the last load report
_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 30.0)  # fmt: skip


async def release_lease(prefill_url: str, lease_id: str) -> bool:
    """POST a lease release to a prefill worker; False if it could not be reached (the
    lease then expires there)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            reply = await client.post(f"{prefill_url}/kv/release", json={"lease": lease_id})
        return reply.status_code == 200
    except httpx.HTTPError as e:
        logger.warning("could not release lease %s at %s: %r", lease_id, prefill_url, e)
        return False


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    """The workers behind the balancer, and the key it sends them."""

    prefill: list[str]
    decode: list[str]
    both: list[str] = field(default_factory=list)
    api_key: str | None = None


@dataclass(slots=True)
class Worker:
    """One worker as the balancer sees it."""

    url: str
    role: str
    up: bool = False
    load: dict = field(default_factory=dict)  # its last /load report
    sent_tokens: int = 0  # prompt tokens of prefill legs sent since that report
    sent_seqs: int = 0  # decode legs sent since that report
    in_flight: int = 0  # legs open through this balancer now
    failures: int = 0
    retry_at: float = 0.0

    def prefill_load(self) -> float:
        """Prompt tokens it still has to compute."""
        return self.load.get("num_prompt_tokens_to_compute", 0) + self.sent_tokens

    def decode_load(self) -> tuple[float, float]:
        """Sequences it carries, then the share of its KV pool in use."""
        seqs = self.load.get("num_running", 0) + self.load.get("num_waiting", 0) + self.sent_seqs
        blocks = self.load.get("num_blocks") or 1
        return seqs, 1.0 - self.load.get("num_free_blocks", blocks) / blocks

    def mark_down(self, why: str) -> None:
        """Stop sending it work; poll it again after a growing backoff."""
        if self.up:
            logger.warning("worker %s is down: %s", self.url, why)
        self.up = False
        self.failures += 1
        self.retry_at = time.monotonic() + min(BACKOFF[1], BACKOFF[0] * 2 ** (self.failures - 1))


class LegFailed(Exception):
    """A worker failed a leg before anything reached the client: try another one."""


class Balancer:
    """Worker state, the picking rules and the two legs of a request."""

    def __init__(self, config: BalancerConfig) -> None:
        self.config = config
        self.workers = [Worker(u.rstrip("/"), r) for r, urls in
                        (("prefill", config.prefill), ("decode", config.decode),
                         ("both", config.both)) for u in urls]  # fmt: skip
        self.affinity: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.http: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(self))
        self.ttft = Histogram("infire_balance:time_to_first_token_seconds",
                              "Time to the first token through the balancer",
                              registry=self.registry, buckets=_BUCKETS)  # fmt: skip
        self.tpot = Histogram("infire_balance:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              registry=self.registry, buckets=_BUCKETS)  # fmt: skip
        self.requests = Counter("infire_balance:requests", "Requests by path taken and outcome",
                                ["path", "outcome"], registry=self.registry)  # fmt: skip
        self.affinity_hits = Counter("infire_balance:affinity_hits",
                                     "Requests sent to their session's workers again",
                                     registry=self.registry)  # fmt: skip

    # -- lifecycle and load reports ----------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP client and start polling the workers."""
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0), limits=limits)
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop polling and close the client."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.http is not None:
            await self.http.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Read every due worker's /load (down ones after their backoff)."""
        now = time.monotonic()
        due = [w for w in self.workers if w.up or now >= w.retry_at]
        await asyncio.gather(*(self._poll(w) for w in due))

    async def _poll(self, worker: Worker) -> None:
        try:
            reply = await self.http.get(f"{worker.url}/load", timeout=1.0)
            if reply.status_code != 200:
                raise LegFailed(f"/load answered {reply.status_code}")
            load = reply.json()
        except (httpx.HTTPError, LegFailed, ValueError) as e:
            worker.mark_down(repr(e))
            return
        if load.get("role") != worker.role:
            worker.mark_down(f"it serves --role {load.get('role')}, not {worker.role}")
            return
        if not worker.up:
            logger.info("worker %s (%s) is up", worker.url, worker.role)
        worker.up, worker.failures, worker.load = True, 0, load
        worker.sent_tokens = worker.sent_seqs = 0

    def ready(self) -> bool:
        """A prefill and a decode worker are up, or a colocated one."""
        up = {w.role for w in self.workers if w.up}
        return {"prefill", "decode"} <= up or "both" in up

    # -- picking -----------------------------------------------------------------------

    def _up(self, role: str, exclude: set[str]) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.up and w.url not in exclude]

    def pick(self, role: str, session: str | None, exclude: set[str]) -> Worker | None:
        """The worker of `role` for this request (None: none is up)."""
        candidates = self._up(role, exclude)
        if not candidates:
            return None
        best = min(candidates, key=Worker.prefill_load if role == "prefill" else Worker.decode_load)

        def load(worker: Worker) -> float:  # what affinity weighs: tokens, or sequences
            return worker.prefill_load() if role == "prefill" else worker.decode_load()[0]

        sticky = self.affinity.get(session) if session else None
        if sticky is not None:
            url = sticky[0] if role == "prefill" else sticky[1]
            mine = next((w for w in candidates if w.url == url), None)
            slack = AFFINITY_TOKENS if role == "prefill" else AFFINITY_SEQS
            if mine is not None and load(mine) <= AFFINITY_SLACK * load(best) + slack:
                if role == "prefill":  # counted once a request
                    self.affinity_hits.inc()
                return mine
        return best

    def remember(self, session: str | None, prefill: str, decode: str) -> None:
        """The workers a session used last (most recent kept, bounded)."""
        if session is None:
            return
        self.affinity[session] = (prefill, decode)
        self.affinity.move_to_end(session)
        while len(self.affinity) > AFFINITY_ENTRIES:
            self.affinity.popitem(last=False)

    # -- a request -----------------------------------------------------------------------

    def headers(self, request: Request) -> dict[str, str]:
        """What goes to a worker: the key, and the client's affinity header."""
        out = {"content-type": "application/json"}
        auth = f"Bearer {self.config.api_key}" if self.config.api_key else None
        auth = auth or request.headers.get("authorization")
        if auth:
            out["authorization"] = auth
        if "x-session-affinity" in request.headers:
            out["x-session-affinity"] = request.headers["x-session-affinity"]
        return out

    async def handle(self, request: Request) -> Response:
        """Split a generation request into its legs, falling back to colocated workers."""
        start = time.monotonic()
        path = request.url.path
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return _error(path, 400, "request body is not valid JSON", "invalid_json")
        body.pop("kv_transfer_params", None)  # a client never sets the legs' handles
        headers = self.headers(request)
        session = request.headers.get("x-session-affinity") or _prompt_key(body)
        if body.get("n", 1) != 1 and not any(w.role == "both" for w in self.workers):
            return _error(path, 400, "n > 1 is not disaggregated, and this balancer has no "
                          "colocated (--both) worker to send it to", "invalid_n", param="n")  # fmt: skip
        whole = body.get("n", 1) != 1 or not {"prefill", "decode"} <= {
            w.role for w in self.workers if w.up}  # fmt: skip
        if not whole:
            answer = await self._split(request, path, body, headers, session, start)
            if answer is not None:
                return answer
        return await self._colocated(path, body, headers, start)

    async def _split(self, request: Request, path: str, body: dict, headers: dict,
                     session: str | None, start: float) -> Response | None:  # fmt: skip
        """Both legs; None when no prefill worker could take the first."""
        taken = await self._first_taker(
            "prefill", session, lambda w: self._prefill_leg(w, path, body, headers)
        )
        if taken is None:
            return None
        prefill, first = taken
        if isinstance(first, Response):  # the worker refused the request: the client's fault
            self.requests.labels("split", "refused").inc()
            return first
        handle = first | {"prefill_url": prefill.url}
        if await request.is_disconnected():  # gone between the legs
            await self._release(prefill.url, handle)
            self.requests.labels("split", "client_gone").inc()
            return Response(status_code=499)
        return await self._decode_leg(path, body, headers, handle, session, prefill, start)

    @staticmethod
    async def _release(prefill_url: str, handle: dict) -> None:
        if handle.get("lease"):
            await release_lease(prefill_url, handle["lease"])

    async def _first_taker(
        self, role: str, session: str | None, leg: Callable[[Worker], Awaitable[T]]
    ) -> tuple[Worker, T] | None:
        """Try `leg` on the workers of `role`, best pick first, marking down each that fails
        it, until one takes it; None if none did."""
        tried: set[str] = set()
        while (worker := self.pick(role, session, tried)) is not None:
            tried.add(worker.url)
            try:
                return worker, await leg(worker)
            except LegFailed as e:
                worker.mark_down(str(e))
        return None

    async def _prefill_leg(self, worker: Worker, path: str, body: dict,
                           headers: dict) -> dict | Response:  # fmt: skip
        """The handle (the prefill worker's kv_transfer_params), or the worker's own 4xx."""
        leg = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        leg.pop("stream_options", None)
        estimate = (
            len(json.dumps(body.get("messages") or body.get("prompt") or "")) // CHARS_PER_TOKEN
        )
        worker.sent_tokens += estimate
        worker.in_flight += 1
        try:
            reply = await self.http.post(f"{worker.url}{path}", json=leg, headers=headers)
        except httpx.HTTPError as e:
            raise LegFailed(f"prefill leg: {e!r}") from None
        finally:
            worker.in_flight -= 1
        if reply.status_code == 503:  # loading, or its engine died
            raise LegFailed("prefill leg answered 503")
        if reply.status_code != 200:  # the request's own error: the client gets it
            return Response(reply.content, reply.status_code, media_type="application/json")
        try:
            answer = reply.json()
        except ValueError:
            raise LegFailed("prefill leg answered something other than JSON") from None
        handle = (answer.get("result") or {}).get("kv_transfer_params") if path.startswith(
            "/ai/") else answer.get("kv_transfer_params")  # fmt: skip
        if not isinstance(handle, dict):  # it ended the request itself (a prompt that never
            return Response(reply.content, 200, media_type="application/json")  # fit its pool)
        return handle

    async def _decode_leg(self, path: str, body: dict, headers: dict, handle: dict,
                          session: str | None, prefill: Worker, start: float) -> Response:  # fmt: skip
        """Stream the decode worker's answer through; try the next decode worker while
        nothing reached the client; release the lease if no decode worker took it."""
        leg = {**body, "kv_transfer_params": handle}

        async def open_leg(worker: Worker) -> httpx.Response:
            worker.sent_seqs += 1
            return await self._open(worker, path, leg, headers)

        taken = await self._first_taker("decode", session, open_leg)
        if taken is None:
            await self._release(prefill.url, handle)
            self.requests.labels("split", "no_decode_worker").inc()
            return await self._colocated(path, body, headers, start)
        worker, reply = taken
        self.remember(session, prefill.url, worker.url)
        if reply.status_code != 200:
            await reply.aread()
            await reply.aclose()
            await self._release(prefill.url, handle)
            self.requests.labels("split", "refused").inc()
            return Response(reply.content, reply.status_code, media_type="application/json")
        self.requests.labels("split", "ok").inc()
        return self._relay(reply, worker, path, bool(body.get("stream")), start)

    async def _open(self, worker: Worker, path: str, leg: dict, headers: dict) -> httpx.Response:
        request = self.http.build_request("POST", f"{worker.url}{path}", json=leg, headers=headers)
        try:
            reply = await self.http.send(request, stream=True)
        except httpx.HTTPError as e:
            raise LegFailed(f"{worker.role} leg: {e!r}") from None
        if reply.status_code == 503:  # loading, or its engine died: try another worker
            await reply.aclose()
            raise LegFailed(f"{worker.role} leg answered 503")
        return reply  # any other error is the request's own (a failed KV pull included)

    async def _colocated(self, path: str, body: dict, headers: dict, start: float) -> Response:
        """The whole request on a colocated worker (n > 1, or no prefill/decode pair)."""
        taken = await self._first_taker("both", None, lambda w: self._open(w, path, body, headers))
        if taken is None:
            self.requests.labels("none", "no_worker").inc()
            return _error(path, 502, "no worker is up to take the request", "no_worker")
        worker, reply = taken
        self.requests.labels("colocated", "ok" if reply.status_code == 200 else "refused").inc()
        return self._relay(reply, worker, path, bool(body.get("stream")), start)

    def _relay(self, reply: httpx.Response, worker: Worker, path: str, stream: bool,
               start: float) -> Response:  # fmt: skip
        """The worker's answer, unchanged, timed as it passes; the upstream reply is closed
        even when the client leaves before the body starts."""
        clock = _TokenClock(start)

        async def body() -> AsyncIterator[bytes]:
            worker.in_flight += 1
            try:
                async for chunk in reply.aiter_raw():
                    if stream:
                        clock.feed(chunk)
                    yield chunk
            except httpx.HTTPError as e:  # the worker died mid-answer
                worker.mark_down(repr(e))
                self.requests.labels("relay", "broken").inc()
                error = _error_body(path, 502, f"the worker stopped mid-answer: {e!r}",
                                    "worker_failed")  # fmt: skip
                if stream:
                    yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                worker.in_flight -= 1
                await reply.aclose()
                clock.observe(self.ttft, self.tpot)

        if not stream:  # read it whole first, so that a worker dying mid-way is a clean 502
            return _WholeRelay(body(), reply.status_code, path)
        media = reply.headers.get("content-type", "text/event-stream")
        return StreamingResponse(body(), status_code=reply.status_code, media_type=media,
                                 headers={"cache-control": "no-cache"},
                                 background=BackgroundTask(reply.aclose))  # fmt: skip


class _WholeRelay(Response):
    """A non-streamed answer: the worker's body once it is complete, or a 502."""

    def __init__(self, chunks: AsyncIterator[bytes], status: int, path: str) -> None:
        super().__init__(status_code=status, media_type="application/json")
        self.chunks, self.path = chunks, path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        parts = [chunk async for chunk in self.chunks]
        data = b"".join(parts)
        try:
            json.loads(data)
        except ValueError:
            self.status_code = 502
            data = json.dumps(_error_body(self.path, 502, "the worker stopped mid-answer",
                                          "worker_failed")).encode()  # fmt: skip
        self.body = data
        self.init_headers()
        await super().__call__(scope, receive, send)


class _TokenClock:
    """TTFT and time per output token of one streamed answer, from its SSE events."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        self.pending += chunk
        *events, self.pending = self.pending.split(b"\n\n")
        now = time.monotonic()
        for event in events:
            if _carries_text(event):
                self.first = self.first or now
                self.last = now
                self.tokens += 1

    def observe(self, ttft: Histogram, tpot: Histogram) -> None:
        if self.first is None:
            return
        ttft.observe(self.first - self.start)
        if self.tokens > 1:
            tpot.observe((self.last - self.first) / (self.tokens - 1))


_EMPTY = (b'"text": ""', b'"content": ""', b'"response": ""')
_TEXT = (b'"text": "', b'"content": "', b'"response": "')


def _carries_text(event: bytes) -> bool:
    """Whether an SSE event is a chunk with generated text (chat, completion, Workers AI),
    judged on its bytes: workers write `"key": "value"` with json.dumps' spacing, and
    this runs for every token of every stream."""
    if not event.startswith(b"data: {"):
        return False
    return any(key in event for key in _TEXT) and not any(key in event for key in _EMPTY)


def _prompt_key(body: dict) -> str | None:
    """A session key from the prompt's beginning (what a shared prefix cache keys on)."""
    prompt = body.get("messages") or body.get("prompt")
    if not prompt:
        return None
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)[:512]
    return "prompt:" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _error_body(path: str, status: int, message: str, code: str, param: str | None = None) -> dict:
    if path.startswith("/ai/"):
        return {"result": None, "success": False, "errors": [{"code": status, "message": message}],
                "messages": []}  # fmt: skip
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(path: str, status: int, message: str, code: str, param: str | None = None
           ) -> JSONResponse:  # fmt: skip
    return JSONResponse(_error_body(path, status, message, code, param), status_code=status)


class _WorkerCollector:
    """Per-worker gauges and counters from the workers' last load reports."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def collect(self) -> Any:
        gauges = {
            "up": ("Worker answers its load polls (1) or is down (0)", lambda w: float(w.up)),
            "prompt_tokens_in_flight": ("Prompt tokens the worker still has to compute",
                                        Worker.prefill_load),
            "sequences": ("Sequences the worker runs, queues or pulls", lambda w: w.decode_load()[0]),
            "kv_cache_usage": ("Share of the worker's KV blocks in use",
                               lambda w: w.decode_load()[1]),
            "kv_leased_blocks": ("KV blocks held for decode workers",
                                 lambda w: w.load.get("num_leased_blocks", 0)),
            "legs_open": ("Legs open through this balancer", lambda w: w.in_flight),
        }  # fmt: skip
        counters = {
            "prefix_cache_queries": "Prompt tokens looked up in the worker's prefix cache",
            "prefix_cache_hits": "Prompt tokens found in the worker's prefix cache",
            "kv_bytes_pulled": "Bytes of KV the worker pulled",
            "kv_pull_seconds": "Seconds the worker spent pulling KV",
            "kv_blocks_pulled": "KV blocks the worker pulled",
            "kv_blocks_reused": "Prompt blocks the worker's prefix cache held, not pulled",
            "kv_leases_expired": "Leases that expired on the worker",
            "kv_pulls_failed": "KV pulls that failed on the worker",
        }
        labels = ["worker", "role"]
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"infire_balance:worker_{name}", doc, labels=labels)
            for w in self.balancer.workers:
                family.add_metric([w.url, w.role], value(w))
            yield family
        for name, doc in counters.items():
            family = CounterMetricFamily(f"infire_balance:worker_{name}", doc, labels=labels)
            for w in self.balancer.workers:
                family.add_metric([w.url, w.role], w.load.get(name, 0))
            yield family


def create_app(config: BalancerConfig) -> Starlette:
    """The balancer's ASGI app: the generation routes, /health, /metrics, /v1/models."""
    balancer = Balancer(config)

    async def health(request: Request) -> Response:
        if balancer.ready():
            return JSONResponse({"status": "ok"})
        return _error("/health", 503, "no prefill and decode pair (or colocated worker) is up",
                      "no_worker")  # fmt: skip

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(balancer.registry), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        for worker in [w for w in balancer.workers if w.up]:
            with contextlib.suppress(httpx.HTTPError):
                reply = await balancer.http.get(f"{worker.url}/v1/models",
                                                headers=balancer.headers(request))  # fmt: skip
                return Response(reply.content, reply.status_code, media_type="application/json")
        return _error("/v1/models", 502, "no worker is up", "no_worker")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await balancer.start()
        yield
        await balancer.stop()

    routes = [
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", balancer.handle, methods=["POST"]),
        Route("/v1/completions", balancer.handle, methods=["POST"]),
        Route("/ai/run/{model:path}", balancer.handle, methods=["POST"]),
    ]  # fmt: skip
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.balancer = balancer
    return app
