"""The ASGI app of `infire serve`: OpenAI and Workers AI routes, the catalog, health, metrics.

The server serves a catalog of models (server/catalog.py, catalog/manager.py): `--model`
is a catalog of one, no arguments the default catalog. The socket opens at once; pinned
and preloaded models load in the background (`/health` answers 503 until they are
ready), the others on their first request, within the memory budget. Around the routes:
an optional API key (Bearer), a request body size limit (413), a structured access log
line per request (JSON on the `infire.access` logger, with the `x-session-affinity`
header), the release of the request's model leases when its response ends, and the
error mapping of errors.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infire.catalog.config import Catalog
from infire.catalog.manager import request_leases
from infire.config import EngineConfig
from infire.errors import InfireError
from infire.server import catalog as catalog_routes
from infire.server import encoders, openai, realtime, speech, workers_ai
from infire.server.catalog import ServedModels
from infire.server.errors import APIError, error_response, json_object
from infire.server.metrics import CONTENT_TYPE
from infire.server.serving import ClientDisconnected

access_log = logging.getLogger("infire.access")
logger = logging.getLogger("infire.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings of `infire serve`, and the catalog it serves."""

    catalog: Catalog
    memory_budget: int  # bytes for every loaded model's processes: weights, KV, runtime
    api_key: str | None = None
    max_waiting: int = 256  # waiting sequences beyond which new requests get 429
    max_body_bytes: int = 4 * 1024**2
    max_audio_bytes: int = 25 * 1024**2  # bodies of the audio routes and /ai/run
    max_audio_seconds: float = 3600.0  # longest audio of a speech request
    engine_in_process: bool = False  # engine cores in threads instead of their own processes
    evict_hold_s: float = 0.5  # a model loaded this recently is not evicted


def default_memory_budget(fraction: float = 0.8) -> int:
    """`fraction` of the memory available now (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available * fraction)


def create_app(
    engine_config: EngineConfig,
    config: ServerConfig,
    on_engine_dead: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app; pinned and preloaded models load when the app starts (lifespan), in the
    background.

    When a pinned model's engine dies, its open requests end with `engine_dead`, /health
    answers 503 and `on_engine_dead(reason)` is called (`infire serve` then exits
    non-zero). An on-demand model whose engine died is loaded again by its next request."""
    models = ServedModels(
        config.catalog, engine_config, config.memory_budget, config.max_waiting,
        in_process=config.engine_in_process, hold_s=config.evict_hold_s,
        on_engine_dead=on_engine_dead,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 (FastAPI's lifespan protocol)
        startup = asyncio.ensure_future(models.start())
        yield
        startup.cancel()
        await models.close()

    app = build_app(models, config, lifespan)
    app.state.infire = models
    return app


def build_app(models: ServedModels, config: ServerConfig, lifespan: Any = None) -> FastAPI:
    """Routes, middleware and error handlers over the server's models."""
    app = FastAPI(title="infire", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai.build_router(models.generative, models.listing))
    app.include_router(encoders.build_router(models.encoder))
    app.include_router(speech.build_router(models.speech, config.max_audio_seconds))
    app.include_router(realtime.build_router(models.speech))
    app.include_router(workers_ai.build_router(models.any, config.max_audio_seconds))
    app.include_router(catalog_routes.build_router(models))

    @app.get("/health")
    async def health() -> Response:
        models.health()  # 503 until the pinned models are loaded, and once one died
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(models.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/load")
    async def load() -> Response:
        """What a balancer picks workers by (disagg/balancer.py): queues, prompt tokens
        still to compute, free KV blocks, leases and transfer counters."""
        serving = models.sole_generative()
        info, stats = serving.client.model_info, serving.client.stats()
        return JSONResponse({"role": info.kv_role, "model": serving.model_name,
                             "block_size": info.block_size, **dataclasses.asdict(stats)})  # fmt: skip

    @app.post("/kv/release")
    async def release(request: Request) -> Response:
        """A decode worker is done with a lease (prefill role). Outside /v1 and the API
        key: a lease id is a 128-bit random name only its holders know."""
        body = json_object(await request.body())
        lease = body.get("lease")
        if not isinstance(lease, str):
            raise APIError(400, 'send {"lease": "<id>"}', param="lease")
        models.sole_generative().client.release_kv(lease)
        return JSONResponse({"status": "ok"})

    expected = (InfireError, APIError, HTTPException, RequestValidationError, ValidationError)
    for exc_type in (*expected, Exception):  # Exception: logged with its traceback, 500
        app.add_exception_handler(exc_type, error_response)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    app.add_middleware(_Guard, config=config)
    return app


class _Guard:
    """API key, body size limit and access log, as plain ASGI middleware."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # realtime: the API key, then the session
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            key = self.config.api_key
            if key and headers.get("authorization") != f"Bearer {key}":
                await send(
                    {
                        "type": "websocket.close",
                        "code": 1008,
                        "reason": "invalid or missing API key",
                    }
                )
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        status = [0]

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(path, headers)
            replay = None if refusal else await self._read_body(receive, self._limit(path))
            if replay is None:
                limit = self._limit(path)
                error = refusal or APIError(413, f"request body is larger than {limit} bytes")
                await self._answer(scope, error, send_logged)
                return
            with request_leases():  # the models this request uses, held until it ends
                await self.app(scope, replay, send_logged)
        finally:
            access_log.info(json.dumps({
                "method": scope["method"], "path": path, "status": status[0],
                "duration_ms": round((time.monotonic() - start) * 1000, 1),
                "client": (scope.get("client") or ("", 0))[0],
                "session_affinity": headers.get("x-session-affinity"),
            }))  # fmt: skip

    def _limit(self, path: str) -> int:
        """The largest body of a path: audio uploads have their own limit."""
        if path.startswith(("/v1/audio/", "/ai/run/")):
            return max(self.config.max_body_bytes, self.config.max_audio_bytes)
        return self.config.max_body_bytes

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._limit(path):
            return APIError(413, f"request body is larger than {self._limit(path)} bytes")
        key = self.config.api_key
        protected = path.startswith(("/v1/", "/ai/"))
        if key and protected and headers.get("authorization") != f"Bearer {key}":
            return APIError(401, "invalid or missing API key", code="invalid_api_key")
        return None

    async def _read_body(self, receive: Receive, limit: int) -> Receive | None:
        """Read the whole body (None if over the limit); a receive that replays it."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)  # a disconnect: hand it on
                break
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return None
            chunks.append(body)
            more = message.get("more_body", False)
        buffered = [c for c in chunks if isinstance(c, bytes)]
        pending: list[Message] = [{"type": "http.request", "body": b"".join(buffered),
                                   "more_body": False}]  # fmt: skip
        pending += [c for c in chunks if isinstance(c, dict)]

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        return replay

    async def _answer(self, scope: Scope, error: APIError, send: Send) -> None:
        body = json.dumps(error.body(scope["path"].startswith("/ai/"))).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
