"""The server's models: the catalog behind the routes, and Workers AI's catalog API.

ServedModels builds each entry's engine when the ModelManager loads it (a generative
model's engine core, or an encoder process; both in this process with
`--engine-in-process`) and answers the routes' questions: which Serving or encoder a
request's `model` names (under a lease: catalog/manager.py), what /v1/models lists,
whether /health is ready. Routes: `GET /ai/models/search` (task, search, author, page,
per_page) and `GET /ai/models/schema?model=`, in Cloudflare's envelope and shapes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from infire.catalog.config import TASKS, Catalog, CatalogEntry
from infire.catalog.loading import GENERATIVE, SPEECH, engine_config_for, inspect_entry
from infire.catalog.manager import ModelManager, ModelSlot
from infire.config import EngineConfig
from infire.engine import InprocEngineClient, MPEngineClient
from infire.engine.encoder import EncoderEngine, MPEncoderClient, encoder_task
from infire.engine.link import SparePool
from infire.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from infire.server.errors import APIError
from infire.server.metrics import ServerMetrics
from infire.server.serving import Serving

logger = logging.getLogger("infire.server")

ENCODER_TASKS = {"embed": "text-embeddings", "rerank": "text-reranking",
                 "classify": "text-classification"}  # fmt: skip
TASK_DESCRIPTIONS = {
    "text-generation": "Family of generative text models, such as large language models "
    "(LLM), that can be adapted for a variety of natural language tasks.",
    "text-embeddings": "Feature extraction models transform raw data into numerical "
    "features that can be processed while preserving the information in the original dataset.",
    "text-classification": "Sentiment analysis or text classification is a common NLP task "
    "that classifies a text input into labels or classes.",
    "text-reranking": "Rerankers score a list of passages by their relevance to a query.",
    "automatic-speech-recognition": "Automatic speech recognition (ASR) models convert a "
    "speech signal, typically an audio input, to text.",
}
_NAMESPACE = uuid.UUID("6f1c2b0e-5a7d-4c1e-9a51-8e0d2f3b7c44")  # infire's catalog ids


class ServedModels:
    """The catalog's slots, how each entry's engine is built, and lookups for the routes."""

    def __init__(
        self,
        catalog: Catalog,
        engine_config: EngineConfig,
        budget: int,
        max_waiting: int,
        in_process: bool = False,
        hold_s: float = 0.5,
        on_engine_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.max_waiting = max_waiting
        self.in_process = in_process
        self.on_engine_dead = on_engine_dead
        self.metrics = ServerMetrics(self._engine_stats)
        self.manager = ModelManager(
            catalog, budget, self._load, lambda entry: inspect_entry(entry, engine_config), hold_s
        )
        self.metrics.registry.register(self.manager)
        self.startup_error: str | None = None
        self.started = False
        # A spare engine process, so that on-demand loads skip the imports; a catalog
        # whose models all load at startup has no use for one.
        on_demand = any(not (e.pin or e.preload) for e in catalog.entries)
        self.spares = SparePool() if on_demand and not in_process else None

    # -- building an entry's engine (in a loader thread) -----------------------------------

    def _load(self, entry: CatalogEntry) -> Any:
        try:
            return self._build(entry)
        finally:
            if self.spares is not None and not self.manager.closed:
                self.spares.refill()  # after the load, not competing with it for the cores

    def _build(self, entry: CatalogEntry) -> Any:
        config = engine_config_for(entry, self.engine_config)
        if entry.task == GENERATIVE:
            if encoder_task(config.model) is not None:
                raise ModelLoadError(f"{entry.name}: {config.model} is an encoder, not a "
                                     "text-generation model")  # fmt: skip
            if self.in_process:
                client: Any = InprocEngineClient.from_config(config)
            else:
                client = MPEngineClient.start(config, spares=self.spares)
            if entry.pin and self.on_engine_dead is not None:
                client.on_dead(self.on_engine_dead)  # a pinned model's death stops the server
            info = client.model_info
            logger.info(
                "ready: %s (%s, %d KV tokens of %d bytes, CPU kernels %s)", entry.name,
                info.architecture, info.num_kv_tokens, info.kv_bytes_per_token, info.fused_status,
            )  # fmt: skip
            metrics = self.metrics.for_model(entry.name)
            return Serving(client, entry.name, self.max_waiting, metrics, entry.params)
        if entry.task == SPEECH:
            return self._speech(entry, config)
        task = encoder_task(config.model)
        if ENCODER_TASKS.get(task or "") != entry.task:
            raise ModelLoadError(f"{entry.name}: the catalog says {entry.task}, but "
                                 f"{config.model} does {task or 'text generation'}")  # fmt: skip
        threads = config.parallel.threads_per_rank
        if self.in_process:
            import torch

            from infire.config import resolve_dtype

            if threads:
                torch.set_num_threads(threads)
            encoder: Any = EncoderEngine(config.model, resolve_dtype(config.dtype, "cpu"))
        else:
            encoder = MPEncoderClient.start(config.model, config.dtype, threads,
                                            spares=self.spares)  # fmt: skip
        encoder.name = entry.name
        logger.info("ready: %s (%s, %d dimensions, %d tokens a text, %s)", entry.name,
                    encoder.task, encoder.dim, encoder.max_input_tokens,
                    str(encoder.dtype).removeprefix("torch."))  # fmt: skip
        return encoder

    def _speech(self, entry: CatalogEntry, config: EngineConfig) -> Any:
        """A Whisper model's engine: a batching thread in this process (speech engines do
        not run in a process of their own yet)."""
        from pathlib import Path

        from infire.engine.speech import SpeechEngine
        from infire.models.whisper import is_whisper_folder

        if not is_whisper_folder(Path(config.model)):
            raise ModelLoadError(f"{entry.name}: {config.model} is not a Whisper model (a Hugging "
                                 "Face or CTranslate2 folder)")  # fmt: skip
        engine = SpeechEngine(
            config.model, dtype="float32" if config.dtype == "float32" else "auto"
        )
        engine.name = entry.name
        logger.info("ready: %s (whisper, %d mel bins, %d+%d layers, decoder in %s)", entry.name,
                    engine.whisper.config.num_mel_bins, engine.whisper.config.encoder_layers,
                    engine.whisper.config.decoder_layers,
                    engine.whisper.model.decoder_dtype)  # fmt: skip
        return engine

    def _engine_stats(self) -> list:
        return [(name, model.client.stats()) for name, model in self.manager.ready_models()
                if isinstance(model, Serving)]  # fmt: skip

    # -- startup and health ----------------------------------------------------------------

    async def start(self) -> None:
        """Read every entry's size, then load the pinned models and the preloaded ones."""
        if self.spares is not None:
            self.spares.refill()
        await self.manager.inspect_all()
        for slot in sorted(self.manager.slots.values(), key=lambda s: not s.entry.pin):
            if slot.entry.pin or slot.entry.preload:
                try:
                    await self.manager.ensure(slot)
                except Exception as e:  # shown on /health
                    self.startup_error = f"{slot.entry.name}: {e}"
                    logger.error("model failed to load: %s", self.startup_error)
                    return
        self.started = True

    async def close(self) -> None:
        """Stop every engine process, the spare included."""
        await self.manager.close()
        if self.spares is not None:
            self.spares.close()

    def health(self) -> None:
        """Raise the 503 of a server whose pinned or preloaded models are not all ready."""
        for slot in self.manager.slots.values():
            model = slot.model
            if slot.entry.pin and model is not None and model.dead_reason is not None:
                raise EngineDeadError(f"engine died: {model.dead_reason}")
        if self.startup_error is not None:
            raise APIError(503, f"model failed to load: {self.startup_error}", type="server_error")
        if not self.started:
            raise APIError(503, "model is loading", type="server_error", code="model_loading")

    # -- what the routes use ---------------------------------------------------------------

    async def generative(self, model: str) -> Serving:
        """The generative model `model` names, loaded, under the request's lease."""
        return await self._of_task(model, (GENERATIVE,), "not text generation")

    async def encoder(self, model: str) -> Any:
        """The encoder model `model` names (embeddings, reranking, classification)."""
        tasks = tuple(task for task in TASKS if task not in (GENERATIVE, SPEECH))
        return await self._of_task(
            model, tasks, "and has no embeddings, reranking or classification"
        )

    async def speech(self, model: str) -> Any:
        """The speech model `model` names (a SpeechEngine)."""
        return await self._of_task(model, (SPEECH,), "not speech recognition")

    async def _of_task(self, model: str, tasks: tuple[str, ...], refusal: str) -> Any:
        """The model `model` names if its task is one of `tasks` (else a 400 that says what
        it does), loaded, under the request's lease."""
        slot = self.manager.find(model)
        task = slot.entry.task
        if task not in tasks:
            does = "generates text" if task == GENERATIVE else f"does {TASKS[task].lower()}"
            raise InvalidRequestError(f"model {slot.entry.name!r} {does}, {refusal}", param="model")
        return await self.manager.acquire(slot)

    async def any(self, model: str) -> Any:
        """Whichever model `model` names: a Serving or an encoder (/ai/run)."""
        return await self.manager.acquire(self.manager.find(model))

    def sole_generative(self) -> Serving:
        """The loaded generative model of a one-model server (/load, /kv/release)."""
        self.health()
        servings = [m for _, m in self.manager.ready_models() if isinstance(m, Serving)]
        if not servings:
            raise APIError(503, "no text-generation model is loaded", type="server_error",
                           code="model_loading")  # fmt: skip
        return servings[0]

    def listing(self) -> list[dict]:
        """/v1/models: every catalog entry as an OpenAI model object, with its load state."""
        out = []
        for slot in self.manager.slots.values():
            entry, model = slot.entry, slot.model
            properties = slot.properties or {}
            length = properties.get("context_window") or properties.get("max_input_tokens")
            if isinstance(model, Serving):
                length = model.client.model_info.max_model_len
            out.append({"id": entry.name, "object": "model", "created": 0, "owned_by": "infire",
                        "max_model_len": length, "task": entry.task,
                        "aliases": list(entry.aliases), "load": self.manager.status(slot)})  # fmt: skip
        return out

    # -- Workers AI's catalog --------------------------------------------------------------

    def search_item(self, slot: ModelSlot) -> dict:
        """A catalog entry as Cloudflare's model search shows it (plus its load state)."""
        entry = slot.entry
        cf = next((a for a in entry.aliases if a.startswith("@cf/")), entry.name)
        properties = [{"property_id": key, "value": str(value)}
                      for key, value in (slot.properties or {}).items()]  # fmt: skip
        return {
            "id": str(uuid.uuid5(_NAMESPACE, entry.name)), "source": 1, "name": cf,
            "description": entry.description, "task": task_object(entry.task),
            "tags": [], "properties": properties, "load": self.manager.status(slot),
        }  # fmt: skip


def task_object(task: str) -> dict:
    """Cloudflare's task object: a stable id, the name and a description."""
    return {"id": str(uuid.uuid5(_NAMESPACE, f"task:{task}")), "name": TASKS[task],
            "description": TASK_DESCRIPTIONS[task]}  # fmt: skip


def _author(entry: CatalogEntry) -> str | None:
    cf = next((a for a in entry.aliases if a.startswith("@cf/")), None)
    return cf.split("/")[1] if cf and cf.count("/") >= 2 else None


def _matches_task(entry: CatalogEntry, wanted: str) -> bool:
    wanted = wanted.strip().lower()
    task = task_object(entry.task)
    return wanted in (entry.task, TASKS[entry.task].lower(), task["id"])


def _matches_search(entry: CatalogEntry, wanted: str) -> bool:
    wanted = wanted.lower()
    return any(wanted in text.lower() for text in (entry.name, *entry.aliases, entry.description))


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise APIError(400, f"{name} must be an integer from {low} to {high}", param=name)
    return int(raw)


def build_router(models: ServedModels) -> APIRouter:
    """GET /ai/models/search and /ai/models/schema."""
    router = APIRouter(prefix="/ai/models")

    @router.get("/search")
    async def search(request: Request) -> dict:
        query = request.query_params
        page = _int_param(request, "page", 1, 1, 1_000_000)
        per_page = _int_param(request, "per_page", 50, 1, 1000)
        slots = list(models.manager.slots.values())
        if query.get("task"):
            slots = [s for s in slots if _matches_task(s.entry, query["task"])]
        if query.get("search"):
            slots = [s for s in slots if _matches_search(s.entry, query["search"])]
        if query.get("author"):
            slots = [s for s in slots if _author(s.entry) == query["author"].lower()]
        shown = slots[(page - 1) * per_page : page * per_page]
        info = {"page": page, "per_page": per_page, "count": len(shown), "total_count": len(slots)}
        return {"result": [models.search_item(s) for s in shown], "result_info": info,
                "success": True, "errors": [], "messages": []}  # fmt: skip

    @router.get("/schema")
    async def schema(request: Request) -> dict:
        model = request.query_params.get("model")
        if not model:
            raise APIError(400, "the model query parameter is required", param="model")
        slot = models.manager.find(model)
        return {"result": TASK_SCHEMAS[slot.entry.task], "success": True, "errors": [],
                "messages": []}  # fmt: skip

    return router


# --- the input and output JSON Schema of each task's /ai/run ------------------------------

_MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
        "required": ["role", "content"],
    },
}
_SAMPLING = {
    "max_tokens": {"type": "integer", "default": 256},
    "temperature": {"type": "number", "minimum": 0, "maximum": 5},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "seed": {"type": "integer"},
    "repetition_penalty": {"type": "number"},
    "frequency_penalty": {"type": "number"},
    "presence_penalty": {"type": "number"},
    "stream": {"type": "boolean", "default": False},
}
_TEXTS = {"oneOf": [{"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}}]}  # fmt: skip
_USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "number"},
          "completion_tokens": {"type": "number"}, "total_tokens": {"type": "number"}}}  # fmt: skip
TASK_SCHEMAS: dict[str, dict[str, Any]] = {
    "text-generation": {
        "input": {
            "type": "object",
            "oneOf": [
                {"title": "Prompt", "properties": {"prompt": {"type": "string", "minLength": 1},
                 "raw": {"type": "boolean", "default": False}, **_SAMPLING}, "required": ["prompt"]},
                {"title": "Messages", "properties": {"messages": _MESSAGES, **_SAMPLING},
                 "required": ["messages"]},
            ],
        },
        "output": {
            "oneOf": [
                {"type": "object", "properties": {"response": {"type": "string"}, "usage": _USAGE}},
                {"type": "string", "format": "binary", "description": "server-sent events"},
            ],
        },
    },
    "text-embeddings": {
        "input": {"type": "object", "properties": {"text": _TEXTS,
                  "pooling": {"type": "string", "enum": ["mean", "cls"], "default": "mean"}},
                  "required": ["text"]},
        "output": {"type": "object", "properties": {
            "shape": {"type": "array", "items": {"type": "number"}},
            "data": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "pooling": {"type": "string", "enum": ["mean", "cls"]}}},
    },
    "text-reranking": {
        "input": {"type": "object", "properties": {
            "query": {"type": "string", "minLength": 1},
            "contexts": {"type": "array", "items": {"type": "object", "properties": {
                "text": {"type": "string", "minLength": 1}}}},
            "top_k": {"type": "integer", "minimum": 1}}, "required": ["query", "contexts"]},
        "output": {"type": "object", "properties": {"response": {"type": "array", "items": {
            "type": "object", "properties": {"id": {"type": "integer"},
                                             "score": {"type": "number"}}}}}},
    },
    "text-classification": {
        "input": {"type": "object", "properties": {"text": {"type": "string", "minLength": 1}},
                  "required": ["text"]},
        "output": {"type": "array", "items": {"type": "object", "properties": {
            "score": {"type": "number"}, "label": {"type": "string"}}}},
    },
}  # fmt: skip
