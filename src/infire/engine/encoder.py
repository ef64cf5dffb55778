"""EncoderEngine: an encoder model (embeddings, reranking, classification) behind one
batching thread.

Encoders run one forward per batch and keep no state between requests, so they need no
scheduler or KV cache. Requests from the event loop are queued. The engine thread takes
the oldest one and, for embeddings, every other queued embedding request while their
texts fit `max_batch_tokens`. It encodes them as one padded batch and hands each request
its own rows. Torch releases the GIL inside the forward, so the event loop keeps serving
while a batch runs. Results do not depend on the batch a text lands in beyond float
rounding (padding is masked; tests/models/test_bert.py checks batched against alone).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infire.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger("infire.engine.encoder")

ENCODER_ARCHITECTURES = {
    "BertModel": "embed",
    "BertForSequenceClassification": "classify",  # "rerank" when it has one label
    "XLMRobertaForSequenceClassification": "classify",
}


def encoder_task(path: str | Path | None) -> str | None:
    """The task of an encoder checkpoint folder ('embed', 'rerank' or 'classify'), or None
    for anything else (a generative model, a GGUF file, no path)."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    task = next((ENCODER_ARCHITECTURES[a] for a in config.get("architectures") or []
                 if a in ENCODER_ARCHITECTURES), None)  # fmt: skip
    if task == "classify" and len(config.get("id2label") or {"0": 0, "1": 1}) == 1:
        return "rerank"
    return task


@dataclass(slots=True)
class _Job:
    kind: str  # embed | rerank | classify
    payload: Any
    tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    options: dict = field(default_factory=dict)


class EncoderEngine:
    """One encoder model and the thread that batches requests into it."""

    def __init__(
        self, folder: str | Path, dtype: torch.dtype = torch.float32, max_batch_tokens: int = 16384
    ) -> None:
        from infire.models import bert

        self._bert = bert
        self.loaded = bert.load_bert(folder, dtype)
        self.dtype = dtype
        self.task: str = self.loaded.task
        self.name = Path(folder).name
        self.max_batch_tokens = max_batch_tokens
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="infire-encoder", daemon=True)
        self._thread.start()

    @property
    def dim(self) -> int:
        """Width of an embedding."""
        return self.loaded.config.hidden_size

    @property
    def max_input_tokens(self) -> int:
        """Tokens of a text that are read (longer texts are truncated)."""
        return self.loaded.max_length

    async def embed(self, inputs: list[str] | list[list[int]], pooling: str | None = None
                    ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """[n, dim] embeddings of texts (or token id lists), and the tokens they took."""
        self._need("embed")
        encoded = self._bert.tokenize(self.loaded, inputs)  # once: it also counts the usage
        return await self._submit("embed", encoded, sum(encoded.num_tokens), pooling=pooling)

    async def rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """A relevance score per document for the query, and the tokens it took."""
        self._need("rerank")
        encoded = self._bert.tokenize(self.loaded, documents, query)
        return await self._submit("rerank", (query, encoded), sum(encoded.num_tokens))

    async def classify(self, texts: list[str]) -> tuple[list[list[tuple[str, float]]], int]:
        """(label, score) pairs per text, best first, and the tokens it took."""
        self._need("classify")
        encoded = self._bert.tokenize(self.loaded, texts)
        return await self._submit("classify", encoded, sum(encoded.num_tokens))

    def shutdown(self) -> None:
        """Stop the thread once the batch in hand is done; queued requests fail."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _need(self, kind: str) -> None:
        if self.task != kind:
            raise InvalidRequestError(
                f"model {self.name!r} does {self.task}, not {kind}", param="model"
            )
        if self._dead is not None:
            raise EngineDeadError(f"encoder stopped: {self._dead}")

    async def _submit(self, kind: str, payload: Any, tokens: int, **options: Any) -> Any:
        loop = asyncio.get_running_loop()
        job = _Job(kind, payload, tokens, loop, loop.create_future(), options)
        self._jobs.put(job)
        return await job.future

    def _run(self) -> None:
        pending: list[_Job] = []
        while True:
            job = pending.pop(0) if pending else self._jobs.get()
            if job is None:
                self._fail_queued("the encoder was shut down")
                return
            batch = [job]
            if job.kind == "embed":
                batch, pending = self._gather(job, pending)
            try:
                results = self._compute(batch)
            except Exception as e:  # a bad batch fails its requests, not the engine
                logger.exception("encoder batch failed")
                results = [e] * len(batch)
            for item, result in zip(batch, results, strict=True):
                item.loop.call_soon_threadsafe(_settle, item.future, result)

    def _gather(self, first: _Job, pending: list[_Job]) -> tuple[list[_Job], list[_Job]]:
        """`first` and the queued embedding requests (same pooling) that fit the budget."""
        batch, rest, tokens = [first], [], first.tokens
        while True:
            try:
                job = pending.pop(0) if pending else self._jobs.get_nowait()
            except queue.Empty:
                break
            fits = tokens + (job.tokens if job else 0) <= self.max_batch_tokens
            if job is not None and job.kind == "embed" and job.options == first.options and fits:
                batch.append(job)
                tokens += job.tokens
            else:
                rest.append(job)  # type: ignore[arg-type]
                if job is None:
                    break
        return batch, rest

    def _compute(self, batch: list[_Job]) -> list[Any]:
        bert, loaded = self._bert, self.loaded
        kind = batch[0].kind
        if kind == "embed":
            parts = [job.payload for job in batch]
            merged = parts[0] if len(parts) == 1 else bert.concat(parts, loaded.config.pad_token_id)
            vectors = bert.embed(loaded, merged, pooling=batch[0].options.get("pooling"))
            out, start = [], 0
            for job in batch:
                count = len(job.payload.num_tokens)
                out.append((vectors[start : start + count], job.tokens))
                start += count
            return out
        job = batch[0]
        if kind == "rerank":
            return [(bert.rerank(loaded, *job.payload), job.tokens)]
        ranked = [sorted(row, key=lambda x: -x[1]) for row in bert.classify(loaded, job.payload)]
        return [(ranked, job.tokens)]

    def _fail_queued(self, reason: str) -> None:
        self._dead = reason
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.loop.call_soon_threadsafe(_settle, job.future, EngineDeadError(reason))


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return  # the request was cancelled (client gone)
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
