"""SpeechEngine: a Whisper model behind one thread that batches windows across requests.

Each request is a `TranscriptionJob` (speech.py): its recording's windows, one after the
other, each after the previous one's text. The engine thread loops:
- requests that have no window in flight (new ones, and those whose last window just
  finished) have their next windows encoded together, in one batch; a job whose language is
  to be detected has it detected on its first window;
- a window decoded greedily at the first temperature joins the WindowBatcher (speech.py):
  continuous batching by the LLM engine's Scheduler and BlockManager, the decoder's
  self-attention KV paged, its cross-attention KV computed once and dropped when the
  window ends; other decodings (beam search, a first temperature above 0) run alone;
- one decoder step of the batcher; each window it finishes goes to its job's
  `finish_window` (which decodes the higher temperatures alone where the text fails
  openai-whisper's checks), whose new segments go to the request at once (streaming).
A request whose window ends goes to the back of the line, so a long recording does not
starve others. Torch releases the GIL inside the forward, so the event loop keeps serving.
A request that fails (its own error) or is cancelled (its client gone) leaves the batch,
its blocks and cross-attention KV freed; the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infire.errors import EngineDeadError
from infire.models.whisper import load_whisper
from infire.models.whisper_tokenizer import WhisperTokenizer
from infire.speech import (
    Segment,
    TranscribeOptions,
    Transcription,
    TranscriptionJob,
    WindowBatcher,
    WindowResult,
    decode_window,
    detect_language,
)

logger = logging.getLogger("infire.engine.speech")


@dataclass(slots=True)
class _Request:
    job: TranscriptionJob
    loop: asyncio.AbstractEventLoop
    events: (
        asyncio.Queue
    )  # ("segments", [Segment]) ... then ("done", Transcription) or ("error", exc)
    cancelled: bool = False

    def send(self, kind: str, value: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class SpeechEngine:
    """One Whisper model and the thread that batches requests' windows into it."""

    task = "automatic-speech-recognition"

    def __init__(self, folder: str | Path, max_batch: int = 16, dtype: str = "auto") -> None:
        self.whisper = load_whisper(Path(folder), dtype)
        self.tokenizer = WhisperTokenizer(Path(folder) / "tokenizer.json")
        self.name = Path(folder).name
        self.max_batch = max_batch
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._dead: str | None = None
        self.batcher = WindowBatcher(self.whisper, self.tokenizer, max_batch)
        # where the engine thread's time went (benchmarks read these)
        self.windows_encoded = 0
        self.encoder_seconds = 0.0  # encoding windows
        self.decoder_seconds = 0.0  # decoder steps, fallbacks, beams, word alignment
        self._thread = threading.Thread(target=self._run, name="infire-speech", daemon=True)
        self._thread.start()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def footprint(self) -> None:
        """In this process its bytes cannot be told apart from the server's: None."""
        return None

    def shutdown(self) -> None:
        """Stop the thread after the round in hand; requests not done fail."""
        self._inbox.put(None)
        self._thread.join(timeout=60)

    def job(self, samples: np.ndarray, options: TranscribeOptions) -> TranscriptionJob:
        """A request's job, checked (empty audio, task, language) before it is queued."""
        return TranscriptionJob(self.whisper, self.tokenizer, samples, options)

    async def stream(self, job: TranscriptionJob) -> AsyncIterator[list[Segment] | Transcription]:
        """The job's segments, a window's at a time, then its Transcription."""
        if self._dead is not None:
            raise EngineDeadError(f"speech engine stopped: {self._dead}")
        request = _Request(job, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(request)
        try:
            while True:
                kind, value = await request.events.get()
                if kind == "error":
                    raise value  # type: ignore[misc]
                yield value  # type: ignore[misc]
                if kind == "done":
                    return
        finally:
            request.cancelled = True  # the client left early, or the request is over

    async def transcribe(self, job: TranscriptionJob) -> Transcription:
        async for item in self.stream(job):
            if isinstance(item, Transcription):
                return item
        raise AssertionError("unreachable")

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        batcher = self.batcher
        requests: list[_Request] = []
        decoding: dict[int, torch.Tensor] = {}  # id(request) -> its window's encoding
        while True:
            try:
                while True:  # take what arrived; wait only when nothing runs
                    request = self._inbox.get(block=not requests)
                    if request is None:
                        self._stop(requests, "the speech engine was shut down")
                        return
                    requests.append(request)
            except queue.Empty:
                pass
            self._finish(requests)  # a job with no speech to decode (the VAD filter) is done
            for request in requests:
                if request.cancelled and decoding.pop(id(request), None) is not None:
                    batcher.abort(id(request))  # its blocks and cross-attention KV go
            requests = [r for r in requests if not r.cancelled]
            room = self.max_batch - len(decoding)
            idle = [r for r in requests if id(r) not in decoding][: max(room, 0)]
            if idle:
                self._admit(idle, batcher, decoding)
            if not batcher.busy:
                continue
            start = time.perf_counter()
            try:
                finished = batcher.step()
            except Exception as e:  # a failed step fails the windows in it, not the engine
                logger.exception("speech decoder step failed")
                for request in requests:
                    if decoding.pop(id(request), None) is not None:
                        batcher.abort(id(request))
                        request.send("error", e)
                        request.cancelled = True
                continue
            done = {key: result for key, result in finished}
            for request in [r for r in requests if id(r) in done]:
                self._window_done(request, decoding.pop(id(request)), done[id(request)])
                requests.remove(request)  # to the back of the line
                requests.append(request)
            self.decoder_seconds += time.perf_counter() - start
            self._finish(requests)

    @staticmethod
    def _finish(requests: list[_Request]) -> None:
        for request in requests:
            if request.job.done and not request.cancelled:
                request.send("done", request.job.result())
                request.cancelled = True

    @torch.inference_mode()
    def _admit(self, batch: list[_Request], batcher: WindowBatcher,
               decoding: dict[int, torch.Tensor]) -> None:  # fmt: skip
        """Encode the requests' next windows together; greedy ones join the batcher."""
        whisper, tokenizer = self.whisper, self.tokenizer
        start = time.perf_counter()
        try:
            encoded = whisper.model.encode(torch.stack([r.job.window() for r in batch]))
        except Exception as e:  # a failed encoding fails its requests, not the engine
            logger.exception("speech encoder failed")
            for request in batch:
                request.send("error", e)
                request.cancelled = True
            return
        self.encoder_seconds += time.perf_counter() - start
        self.windows_encoded += len(batch)
        start = time.perf_counter()
        for i, request in enumerate(batch):
            window, job = encoded[i : i + 1], request.job
            try:
                if job.language is None:
                    job.language, job.language_probs = detect_language(whisper, tokenizer, window)
                options = job.first_options()
                if options.temperature == 0 and options.beam_size <= 1:
                    batcher.add(id(request), window, job.prompt(), options.max_new_tokens,
                                options.timestamps)  # fmt: skip
                    decoding[id(request)] = window
                else:
                    result = decode_window(whisper, tokenizer, window, job.prompt(), options)
                    self._window_done(request, window, result)
            except Exception as e:  # this request's own failure
                logger.exception("speech request failed")
                request.send("error", e)
                request.cancelled = True
        self.decoder_seconds += time.perf_counter() - start  # language, cross KV, alone

    def _window_done(self, request: _Request, encoded: torch.Tensor, result: WindowResult) -> None:
        try:
            segments = request.job.finish_window(encoded, result)
        except Exception as e:  # this request's own failure
            logger.exception("speech request failed")
            request.send("error", e)
            request.cancelled = True
            return
        if segments:
            request.send("segments", segments)

    def _stop(self, running: list[_Request], reason: str) -> None:
        self._dead = reason
        for request in running:
            request.send("error", EngineDeadError(reason))
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request.send("error", EngineDeadError(reason))
