"""AsyncLLMEngine: an asyncio front for LLMEngine, for servers.

The engine's step loop runs in one background thread (torch releases the GIL while it
computes, so the event loop stays responsive). Coroutines never touch the engine: they
validate input in their own thread, then hand add/abort commands to the loop thread
through a queue, and receive RequestOutputs through a per-request asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from infire.config import EngineConfig
from infire.engine.engine import LLMEngine
from infire.errors import EngineDeadError, InvalidRequestError
from infire.outputs import RequestOutput
from infire.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Async iterator of outputs per request, with abort; one engine thread does the work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="infire-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Load the model and start the engine thread."""
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):  # noqa: ANN201 (re-exported type)
        """The model's tokenizer."""
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it, until it finishes.

        Invalid input raises InvalidRequestError before anything is queued. Leaving the
        iteration early (break, cancellation, client disconnect) aborts the request.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.engine.tokenize_prompt(prompt)
        params = params or SamplingParams()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(_Add(request_id, prompt, ids, params))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its iterator ends with finish_reason 'abort'."""
        self._commands.put(_Abort(request_id))

    def shutdown(self) -> None:
        """Stop the engine thread (pending requests are dropped)."""
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
        except BaseException as e:  # the loop must report, not vanish
            self._error = e
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, EngineDeadError(f"engine stopped: {e!r}"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; waits for one when idle. False means shut down."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                output = self.engine.abort_request(command.request_id)
                if output is not None:
                    self._deliver(command.request_id, output)
                continue
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, command.prompt_token_ids
                )
            except InvalidRequestError as e:
                self._deliver(command.request_id, e)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
