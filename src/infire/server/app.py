"""The ASGI app of `infire serve`: OpenAI and Workers AI routes, health, metrics.

The socket opens at once and the model loads in a background thread: `/health` answers
503 until it is ready, and so do generation routes. Around the routes: an optional API
key (Bearer), a request body size limit (413), a structured access log line per request
(JSON on the `infire.access` logger, with the `x-session-affinity` header), and the error
mapping of errors.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
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

from infire.config import EngineConfig, resolve_dtype
from infire.engine import EngineClient, EngineStats, InprocEngineClient, MPEngineClient
from infire.engine.encoder import EncoderEngine, encoder_task
from infire.errors import EngineDeadError, InfireError, InvalidRequestError, ModelNotFoundError
from infire.server import encoders, openai, workers_ai
from infire.server.errors import APIError, error_response, json_object
from infire.server.metrics import CONTENT_TYPE, ServerMetrics
from infire.server.serving import ClientDisconnected, Serving, names_model

access_log = logging.getLogger("infire.access")
logger = logging.getLogger("infire.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings of `infire serve`."""

    api_key: str | None = None
    max_waiting: int = 256  # waiting sequences beyond which new requests get 429
    max_body_bytes: int = 4 * 1024**2
    served_model_name: str | None = None
    engine_in_process: bool = False  # the engine core in a thread instead of its own process


class _State:
    """The Serving (a generative model) or the EncoderEngine (an embedding, reranking or
    classification model) once loaded, or why neither is there."""

    def __init__(self) -> None:
        self.serving: Serving | None = None
        self.encoder: EncoderEngine | None = None
        self.encoder_name = ""
        self.encoder_metrics: ServerMetrics | None = None
        self.error: str | None = None

    def ready(self) -> None:
        """Raise the 503 of a model that is loading, failed or whose engine died."""
        if self.serving is not None:
            reason = self.serving.client.dead_reason
            if reason is not None:
                raise EngineDeadError(f"engine died: {reason}")
            return
        if self.encoder is not None:
            return
        if self.error is not None:
            raise APIError(503, f"model failed to load: {self.error}", type="server_error")
        raise APIError(503, "model is loading", type="server_error", code="model_loading")

    def current(self) -> Serving:
        """The generative model; a 400 when this server serves an encoder."""
        self.ready()
        if self.serving is None:
            raise InvalidRequestError(
                f"model {self.encoder_name!r} does {self.encoder.task}, not text generation",
                param="model",
            )
        return self.serving

    def encoder_for(self, model: str) -> EncoderEngine:
        """The encoder model `model` names; 404 for another name, 400 for the generative
        model of this server."""
        self.ready()
        if self.encoder is None:
            self.serving.check_model(model)  # 404 for an unknown name
            raise InvalidRequestError(
                f"model {self.serving.model_name!r} generates text; it has no embeddings, "
                "reranking or classification",
                param="model",
            )
        if not names_model(model, self.encoder_name):
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {self.encoder_name!r}",
                param="model",
            )
        return self.encoder

    def workers_ai_encoder(self, model: str) -> EncoderEngine | None:
        """The encoder for /ai/run/{model}, or None where that route generates text."""
        self.ready()
        return None if self.encoder is None else self.encoder_for(model)

    def models(self) -> list[dict]:
        """/v1/models: the served model as an OpenAI model object."""
        self.ready()
        if self.serving is not None:
            name, length = self.serving.model_name, self.serving.client.model_info.max_model_len
        else:
            name, length = self.encoder_name, self.encoder.max_input_tokens
        return [{"id": name, "object": "model", "created": 0, "owned_by": "infire",
                 "max_model_len": length}]  # fmt: skip

    def metrics(self) -> ServerMetrics:
        self.ready()
        return self.serving.metrics if self.serving is not None else self.encoder_metrics


def create_app(
    engine_config: EngineConfig,
    config: ServerConfig,
    on_engine_dead: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app; the engine loads when the app starts (lifespan), in a background thread.

    When the engine core dies, open requests end with `engine_dead`, /health answers 503
    and `on_engine_dead(reason)` is called (`infire serve` then exits non-zero)."""
    state = _State()
    clients: list[EngineClient] = []
    encoders_loaded: list[EncoderEngine] = []
    stopping = threading.Event()

    def load() -> None:
        try:
            if encoder_task(engine_config.model) is not None:
                load_encoder()
                return
            if config.engine_in_process:
                client: EngineClient = InprocEngineClient.from_config(engine_config)
            else:
                client = MPEngineClient.start(engine_config)
            clients.append(client)
            if stopping.is_set():  # the server stopped while the model loaded
                client.shutdown()
                return
            if on_engine_dead is not None:
                client.on_dead(on_engine_dead)
            info = client.model_info
            name = config.served_model_name or info.name
            metrics = ServerMetrics(client.stats, name)
            state.serving = Serving(client, name, config.max_waiting, metrics)
            logger.info(
                "ready: %s (%s, %d KV tokens of %d bytes, CPU kernels %s)", name,
                info.architecture, info.num_kv_tokens, info.kv_bytes_per_token, info.fused_status,
            )  # fmt: skip
        except Exception as e:  # reported on /health and every route
            state.error = str(e)
            logger.error("model failed to load: %s", e)

    def load_encoder() -> None:
        if engine_config.parallel.threads_per_rank:
            import torch

            torch.set_num_threads(engine_config.parallel.threads_per_rank)
        # auto: bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX), else float32
        encoder = EncoderEngine(engine_config.model, resolve_dtype(engine_config.dtype, "cpu"))
        encoders_loaded.append(encoder)
        if stopping.is_set():
            encoder.shutdown()
            return
        state.encoder_name = config.served_model_name or encoder.name
        state.encoder_metrics = ServerMetrics(EngineStats, state.encoder_name)
        state.encoder = encoder
        logger.info("ready: %s (%s, %d dimensions, %d tokens a text, %s)", state.encoder_name,
                    encoder.task, encoder.dim, encoder.max_input_tokens,
                    str(encoder.dtype).removeprefix("torch."))  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 (FastAPI's lifespan protocol)
        loader = threading.Thread(target=load, name="infire-load", daemon=True)
        loader.start()
        yield
        stopping.set()
        for client in clients:
            client.shutdown()
        for encoder in encoders_loaded:
            encoder.shutdown()

    app = build_app(state, config, lifespan)
    app.state.infire = state
    return app


def build_app(state: _State, config: ServerConfig, lifespan: Any = None) -> FastAPI:
    """Routes, middleware and error handlers over the server's state."""
    current = state.current
    app = FastAPI(title="infire", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai.build_router(current, state.models))
    app.include_router(encoders.build_router(state.encoder_for))
    app.include_router(workers_ai.build_router(current, state.workers_ai_encoder))

    @app.get("/health")
    async def health() -> Response:
        state.ready()  # 503 until the model is loaded, and once the engine died
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics().render(), media_type=CONTENT_TYPE)

    @app.get("/load")
    async def load() -> Response:
        """What a balancer picks workers by (disagg/balancer.py): queues, prompt tokens
        still to compute, free KV blocks, leases and transfer counters."""
        serving = current()
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
        current().client.release_kv(lease)
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
            replay = None if refusal else await self._read_body(receive)
            if replay is None:
                limit = self.config.max_body_bytes
                error = refusal or APIError(413, f"request body is larger than {limit} bytes")
                await self._answer(scope, error, send_logged)
                return
            await self.app(scope, replay, send_logged)
        finally:
            access_log.info(json.dumps({
                "method": scope["method"], "path": path, "status": status[0],
                "duration_ms": round((time.monotonic() - start) * 1000, 1),
                "client": (scope.get("client") or ("", 0))[0],
                "session_affinity": headers.get("x-session-affinity"),
            }))  # fmt: skip

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return APIError(413, f"request body is larger than {self.config.max_body_bytes} bytes")
        key = self.config.api_key
        protected = path.startswith(("/v1/", "/ai/"))
        if key and protected and headers.get("authorization") != f"Bearer {key}":
            return APIError(401, "invalid or missing API key", code="invalid_api_key")
        return None

    async def _read_body(self, receive: Receive) -> Receive | None:
        """Read the whole body (None if over the limit); a receive that replays it."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)  # a disconnect: hand it on
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.config.max_body_bytes:
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
