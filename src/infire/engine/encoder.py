"""EncoderEngine: an encoder model (embeddings, reranking, classification) behind one
batching thread.

Encoders run one forward per batch and keep no state between requests, so they need no
scheduler or KV cache. Requests from the event loop are queued. The engine thread takes
the oldest one and, for embeddings, every other queued embedding request while their
texts fit `max_batch_tokens`. It encodes them as one padded batch and hands each request
its own rows. Torch releases the GIL inside the forward, so the event loop keeps serving
while a batch runs. Results do not depend on the batch a text lands in beyond float
rounding (padding is masked; tests/models/test_bert.py checks batched against alone).

`infire serve` runs each encoder in its own process (`python -m infire.engine.encoder`,
started by MPEncoderClient, which has the same async methods), with its own torch
threads, so that its forward never shares the HTTP server's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import queue
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infire.engine.link import CoreLink, SparePool, child_sockets, exit_now
from infire.engine.messages import (
    EncodeRequest,
    EncodeResult,
    EncoderReady,
    EngineFailed,
    Shutdown,
    decode,
    encode,
)
from infire.errors import EngineDeadError, InvalidRequestError, ModelLoadError

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
    def dead_reason(self) -> str | None:
        """Why the engine stopped, or None while it runs."""
        return self._dead

    def footprint(self) -> None:
        """In this process its bytes cannot be told apart from the server's: None."""
        return None

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


class MPEncoderClient:
    """An EncoderEngine in its own process, with EncoderEngine's async methods."""

    def __init__(self, link: CoreLink, ready: EncoderReady) -> None:
        self.link = link
        self.name, self.task, self.dim = ready.name, ready.task, ready.dim
        self.max_input_tokens, self.dtype = ready.max_input_tokens, ready.dtype
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="infire-encoder-io", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, folder: str | Path, dtype: str, threads: int | None = None,
        max_batch_tokens: int = 16384, timeout: float | None = None,
        spares: SparePool | None = None,
    ) -> MPEncoderClient:  # fmt: skip
        """Start the encoder process and wait until its model is loaded (ModelLoadError
        with the process's own message when it cannot)."""
        args = ["--model", str(folder), "--dtype", dtype, "--max-batch-tokens",
                str(max_batch_tokens), *(["--threads", str(threads)] if threads else [])]  # fmt: skip
        module = "infire.engine.encoder"
        link = spares.start(module, args) if spares is not None else CoreLink(module, args)
        try:
            message = decode(link.first(timeout))
            if isinstance(message, EngineFailed):
                raise ModelLoadError(message.message)
            if not isinstance(message, EncoderReady):
                raise ModelLoadError(f"the encoder process said {type(message).__name__} first")
        except BaseException:
            link.close()
            raise
        return cls(link, message)

    @property
    def dead_reason(self) -> str | None:
        """Why the encoder process stopped, or None while it runs."""
        return self._dead

    def footprint(self) -> int:
        """Resident bytes of the encoder process."""
        return self.link.footprint()

    async def embed(self, inputs: list[str] | list[list[int]], pooling: str | None = None
                    ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """[n, dim] float32 embeddings of texts (or token id lists), and their tokens."""
        result = await self._call("embed", inputs, pooling=pooling)
        data = torch.frombuffer(bytearray(result.data), dtype=torch.float32)
        return data.reshape(result.shape), result.tokens

    async def rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """A relevance score per document for the query, and the tokens it took."""
        result = await self._call("rerank", documents, query=query)
        return result.scores, result.tokens

    async def classify(self, texts: list[str]) -> tuple[list[list[tuple[str, float]]], int]:
        """(label, score) pairs per text, best first, and the tokens it took."""
        result = await self._call("classify", texts)
        return [[(label, score) for label, score in row] for row in result.labels], result.tokens

    def shutdown(self) -> None:
        """Stop the process (requests in flight fail with EngineDeadError)."""
        if self._stopping:
            return
        self._stopping = True
        goodbye = encode(Shutdown()) if self._dead is None else None
        self._die("the encoder was shut down")
        self.link.close(goodbye)
        self._thread.join(timeout=5)

    async def _call(self, kind: str, inputs: list, **options: Any) -> EncodeResult:
        if self.task != kind:
            raise InvalidRequestError(
                f"model {self.name!r} does {self.task}, not {kind}", param="model"
            )
        if self._dead is not None:
            raise EngineDeadError(f"encoder stopped: {self._dead}")
        request_id = f"enc-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._futures[request_id] = (loop, future)
        try:
            self.link.send(encode(EncodeRequest(request_id, kind, inputs, **options)), self._die)
            result: EncodeResult = await future
        finally:
            with self._lock:
                self._futures.pop(request_id, None)
        if result.error is not None:
            cls = InvalidRequestError if result.invalid else EngineDeadError
            raise cls(result.error)
        return result

    def _run(self) -> None:
        def deliver(data: bytes) -> None:
            result = decode(data)
            with self._lock:
                target = self._futures.get(getattr(result, "request_id", ""))
            if target is not None:
                target[0].call_soon_threadsafe(_settle, target[1], result)

        try:
            self.link.receive_loop(deliver, lambda: self._stopping, self._die)
        except Exception as e:  # a broken message fails the requests, not strands them
            if not self._stopping:
                self._die(f"encoder messages failed: {e!r}")
                self.link.process.kill()

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        if not self._stopping:
            logger.error("encoder process died: %s", reason)
        with self._lock:
            waiting = list(self._futures.values())
        for loop, future in waiting:
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_settle, future, EngineDeadError(reason))


async def _answer(engine: EncoderEngine, request: EncodeRequest) -> EncodeResult:
    """Run one request in the encoder process."""
    rid = request.request_id
    try:
        if request.kind == "embed":
            vectors, tokens = await engine.embed(request.inputs, pooling=request.pooling)
            vectors = vectors.float().contiguous()
            return EncodeResult(rid, tokens, vectors.numpy().tobytes(), list(vectors.shape))
        if request.kind == "rerank":
            scores, tokens = await engine.rerank(request.query or "", request.inputs)
            return EncodeResult(rid, tokens, scores=[float(x) for x in scores])
        labels, tokens = await engine.classify(request.inputs)
        rows = [[[label, float(score)] for label, score in row] for row in labels]
        return EncodeResult(rid, tokens, labels=rows)
    except InvalidRequestError as e:
        return EncodeResult(rid, error=str(e), invalid=True)
    except Exception as e:  # the request fails; the process keeps serving
        logger.exception("encoder request failed")
        return EncodeResult(rid, error=f"encoder failed: {e!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the encoder process (started by MPEncoderClient)."""
    from infire.config import resolve_dtype
    from infire.engine.core import die_with_parent

    parser = argparse.ArgumentParser(prog="infire-encoder")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _, inbox, outbox = child_sockets(args.input, args.output)
    send_lock = threading.Lock()

    def send(message: EncodeResult | EncoderReady | EngineFailed) -> None:
        with send_lock:
            outbox.send(encode(message))

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        # auto: bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX), else float32
        engine = EncoderEngine(args.model, resolve_dtype(args.dtype, "cpu"), args.max_batch_tokens)
    except Exception as e:  # reported to the front
        send(EngineFailed(str(e) or repr(e)))
        outbox.close(linger=2000)
        return 1
    send(EncoderReady(engine.name, engine.task, engine.dim, engine.max_input_tokens,
                      str(engine.dtype).removeprefix("torch.")))  # fmt: skip
    loop = asyncio.new_event_loop()
    running: set[asyncio.Task] = set()

    async def handle(request: EncodeRequest) -> None:
        send(await _answer(engine, request))

    def start(request: EncodeRequest) -> None:
        task = loop.create_task(handle(request))
        running.add(task)
        task.add_done_callback(running.discard)

    def read() -> None:
        while True:
            message = decode(inbox.recv())
            if isinstance(message, Shutdown):
                loop.call_soon_threadsafe(loop.stop)
                return
            if isinstance(message, EncodeRequest):
                loop.call_soon_threadsafe(start, message)

    threading.Thread(target=read, name="infire-encoder-read", daemon=True).start()
    try:
        loop.run_forever()
    finally:
        engine.shutdown()
    outbox.close(linger=1000)
    return 0


if __name__ == "__main__":
    exit_now(main())
