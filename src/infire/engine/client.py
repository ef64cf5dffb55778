"""EngineClient: the one interface through which the server (and anything async) drives
an engine: `generate` (an async iterator of RequestDeltas), `abort`, `model_info`,
`stats`, health and `shutdown`.

Two implementations share everything but the transport:
- InprocEngineClient runs the engine core loop in a thread of this process (for `LLM`,
  tests and `infire serve --engine-in-process`);
- MPEngineClient starts the engine core in its own process (the default of `infire
  serve`), so the HTTP event loop and the model never share a GIL; commands and outputs
  go over ZeroMQ as msgpack (engine/messages.py).
Requests are validated here, at the edge, before anything is queued. When the core dies,
every open stream ends with EngineDeadError at once and the client stays dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from infire.config import EngineConfig
from infire.disagg.transfer import check_kv_params
from infire.engine.link import CoreLink, SparePool
from infire.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    GenerateRequest,
    Message,
    ModelInfo,
    ReleaseKV,
    RequestDelta,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from infire.engine.structured import GrammarCache
from infire.engine.validation import check_params, check_prompt
from infire.errors import EngineDeadError, InvalidRequestError, KVTransferError, ModelLoadError
from infire.sampling_params import SamplingParams
from infire.tokenizer import Tokenizer

if TYPE_CHECKING:
    from infire.engine.engine import LLMEngine

logger = logging.getLogger("infire.engine.client")

_Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class EngineClient:
    """Streams per request over an engine core; subclasses provide the transport."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer) -> None:
        self.model_info = info
        self.tokenizer = tokenizer
        self._stats = EngineStats()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: str | None = None
        self._on_dead: list[Callable[[str], None]] = []
        self.kv_secret: str | None = None  # disaggregation: checks handles (disagg/transfer)
        # structured outputs: grammars are compiled here first, so that a bad one is a 400
        self.grammars = GrammarCache(tokenizer, info.vocab_size)

    # -- the interface -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's queues, KV use and counters, as of its last step."""
        return self._stats

    @property
    def is_healthy(self) -> bool:
        """False once the engine core died; it never comes back."""
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core stopped, or None while it runs."""
        return self._dead

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from an engine thread) when the core dies."""
        self._on_dead.append(callback)

    def validate(self, request: GenerateRequest) -> None:
        """Refuse a request that cannot run, before anything is queued."""
        info = self.model_info
        check_params(request.params, info)
        check_prompt(request.prompt_token_ids, info)
        check_kv_params(
            info.kv_role, request.kv_transfer, request.prompt_token_ids, request.params.n,
            info.kv_layout, secret=self.kv_secret, vocab_size=info.vocab_size,
            logprobs=request.params.logprobs is not None,
        )  # fmt: skip

    async def check_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if it has one, in a worker thread (the event
        loop keeps serving); InvalidRequestError when it does not compile."""
        if params.structured_output is not None:
            await asyncio.to_thread(self.grammars.check, params.structured_output)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """The request's deltas, until its finished one.

        Raises InvalidRequestError (or EngineDeadError) now, before anything is queued;
        the request is sent when iteration starts. Leaving the iteration early (break,
        cancellation, client disconnect) aborts the request.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        self.validate(request)
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            if self._dead is not None:
                raise EngineDeadError(f"engine stopped: {self._dead}")
            self._send(request)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:  # the request failed inside the engine
                    raise (InvalidRequestError if item.invalid else KVTransferError)(item.error)
                yield item
        finally:
            if not finished and self._dead is None:
                with contextlib.suppress(EngineDeadError):
                    self._send(AbortRequest(request.request_id))
            with self._lock:
                self._streams.pop(request.request_id, None)

    def release_kv(self, lease_id: str) -> None:
        """Free the KV blocks held under a lease (prefill role; unknown ids are ignored)."""
        if self._dead is None:
            self._send(ReleaseKV(lease_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with finish_reason 'abort'."""
        if self._dead is None:
            self._send(AbortRequest(request_id))

    def new_request_id(self, prefix: str = "req") -> str:
        """A request id unused by this client."""
        return f"{prefix}-{next(self._ids)}"

    def shutdown(self) -> None:
        """Stop the engine core (requests still running are dropped)."""
        raise NotImplementedError

    # -- for the transports --------------------------------------------------------------

    def _send(self, message: Message) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: StepOutputs) -> None:
        """Hand each delta to its stream (from the transport's thread)."""
        self._stats = outputs.stats
        for delta in outputs.deltas:
            with self._lock:
                target = self._streams.get(delta.request_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, delta)

    def _die(self, reason: str, died: bool = True) -> None:
        """The core is gone (or shut down): fail every open stream now, refuse new requests;
        on a death, tell the on_dead callbacks."""
        if self._dead is not None:
            return
        self._dead = reason
        if died:
            logger.error("engine core died: %s", reason)
            for callback in self._on_dead:
                callback(reason)
        with self._lock:
            streams = list(self._streams.values())
        for loop, stream in streams:
            error = EngineDeadError(f"engine {'died' if died else 'stopped'}: {reason}")
            with contextlib.suppress(RuntimeError):  # that stream's event loop is closed
                loop.call_soon_threadsafe(stream.put_nowait, error)


class InprocEngineClient(EngineClient):
    """The engine core loop in a thread of this process (torch releases the GIL as it runs)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.model_info, engine.tokenizer)
        self.engine = engine
        self.grammars = engine.grammars  # one cache for the edge and the engine
        self._commands: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infire-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> InprocEngineClient:
        """Load the model and start the engine thread."""
        from infire.engine.engine import LLMEngine

        client = cls(LLMEngine(config))
        client.kv_secret = config.disagg.secret
        return client

    def shutdown(self) -> None:
        """Stop the engine thread, then the engine's worker ranks; open streams end with
        EngineDeadError."""
        self._commands.put(Shutdown())
        self._thread.join(timeout=10)
        self._die("the engine was shut down", died=False)
        if not self._thread.is_alive():  # never under a step still running
            self.engine.shutdown()

    def _send(self, message: Message) -> None:
        self._commands.put(message)

    def _receive(self, timeout: float | None) -> list[Message]:
        commands = []
        try:
            commands.append(self._commands.get(block=timeout != 0, timeout=timeout or None))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _run(self) -> None:
        from infire.engine.core import run_core

        try:
            run_core(self.engine, self._receive, self._deliver)
        except BaseException as e:  # the loop must report, not vanish
            self._die(repr(e))


class MPEngineClient(EngineClient):
    """The engine core in its own process, over ZeroMQ; started and stopped by this client."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, link: CoreLink) -> None:
        super().__init__(info, tokenizer)
        self.link = link
        self.process = link.process
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="infire-engine-io", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, config: EngineConfig, timeout: float | None = None, spares: SparePool | None = None
    ) -> MPEngineClient:
        """Start the engine-core process (in the pool's spare, if there is one) and wait
        until its model is loaded.

        Raises ModelLoadError with the core's own message when it cannot start.
        """
        from infire.engine.core import config_to_json
        from infire.models.loader import load_tokenizer

        args = ["--config", config_to_json(config)]
        core = "infire.engine.core"
        link = spares.start(core, args) if spares is not None else CoreLink(core, args)
        try:
            tokenizer = load_tokenizer(config.model)
            message = decode(link.first(timeout))
            if isinstance(message, EngineFailed):
                raise ModelLoadError(message.message)
            if not isinstance(message, EngineReady):
                raise ModelLoadError(f"the engine core said {type(message).__name__} first")
        except BaseException:
            link.close()
            raise
        client = cls(message.info, tokenizer, link)
        client.kv_secret = config.disagg.secret
        return client

    def footprint(self) -> int:
        """Resident bytes of the core process and its worker ranks."""
        return self.link.footprint()

    def shutdown(self) -> None:
        """Ask the core to stop, then make sure it did; remove the sockets."""
        if self._stopping:
            return
        self._stopping = True
        goodbye = encode(Shutdown()) if self._dead is None else None
        self._die("the engine was shut down", died=False)
        self.link.close(goodbye)
        self._thread.join(timeout=5)

    def _send(self, message: Message) -> None:
        self.link.send(encode(message), self._die)

    def _run(self) -> None:
        """Receive outputs until shut down, or until the core process ends."""

        def deliver(data: bytes) -> None:
            message = decode(data)
            if isinstance(message, StepOutputs):
                self._deliver(message)

        try:
            self.link.receive_loop(deliver, lambda: self._stopping, self._die)
        except Exception as e:  # a broken message must fail the streams, not strand them
            if not self._stopping:
                self._die(f"engine-core messages failed: {e!r}")
                self.process.kill()
