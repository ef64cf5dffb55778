"""SpeechEngine: a Whisper model behind one thread that batches windows across requests.

Each request is a `TranscriptionJob` (speech.py): its recording's windows, one after the
other, each after the previous one's text. The engine thread runs rounds: every running
job's next window is encoded in one batch, and decoded in one batch (greedy at the first
temperature, each sequence after its own prompt; a finished sequence leaves the batch).
A job whose text fails openai-whisper's checks decodes that window again at the next
temperatures alone, and a job whose language is to be detected has it detected on its
first window. New requests join at the next round, so a short clip does not wait for a
long one to end. Each finished window's segments go to the request at once (streaming),
and the last window's with the transcription.

The decoder's cross-attention KV is computed per window and dropped after it. Torch
releases the GIL inside the forward, so the event loop keeps serving. A request that
fails (its own error) or is cancelled (its client gone) leaves the batch; the others go
on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
    decode_greedy,
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
    windows: int = field(default=0)

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
        self.windows_batched = 0  # windows decoded in a batch of two or more (tests read it)
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
        running: list[_Request] = []
        while True:
            try:
                while True:  # take what arrived; wait only when nothing runs
                    request = self._inbox.get(block=not running)
                    if request is None:
                        self._stop(running, "the speech engine was shut down")
                        return
                    running.append(request)
            except queue.Empty:
                pass
            self._finish(running)  # a job with no speech to decode (the VAD filter) is done
            running = [r for r in running if not r.cancelled]
            batch = running[: self.max_batch]
            if not batch:
                continue
            try:
                self._round(batch)
            except Exception as e:  # a failed round fails its requests, not the engine
                logger.exception("speech batch failed")
                for request in batch:
                    request.send("error", e)
                    request.cancelled = True
            self._finish(batch)
            # the batch's requests go to the back: a long recording does not starve others
            running = running[len(batch) :] + [r for r in batch if not r.cancelled]

    @staticmethod
    def _finish(requests: list[_Request]) -> None:
        for request in requests:
            if request.job.done and not request.cancelled:
                request.send("done", request.job.result())
                request.cancelled = True

    @torch.inference_mode()
    def _round(self, batch: list[_Request]) -> None:
        whisper, tokenizer = self.whisper, self.tokenizer
        encoded = whisper.model.encode(torch.stack([r.job.window() for r in batch]))
        for i, request in enumerate(batch):
            if request.job.language is None:
                request.job.language, request.job.language_probs = detect_language(
                    whisper, tokenizer, encoded[i : i + 1]
                )
        # the first temperature's greedy windows together, one group per decoding shape
        firsts: dict[int, object] = {}
        groups: dict[tuple[bool, int], list[int]] = {}
        for i, request in enumerate(batch):
            options = request.job.first_options()
            if options.temperature == 0 and options.beam_size <= 1:
                groups.setdefault((options.timestamps, options.max_new_tokens), []).append(i)
            else:
                firsts[i] = decode_window(whisper, tokenizer, encoded[i : i + 1],
                                          request.job.prompt(), options)  # fmt: skip
        for (timestamps, max_new), rows in groups.items():
            prompts = [batch[i].job.prompt() for i in rows]
            results = decode_greedy(whisper, tokenizer, None, prompts, max_new, timestamps,
                                    encoded[rows])  # fmt: skip
            if len(rows) > 1:
                self.windows_batched += len(rows)
            firsts.update(zip(rows, results, strict=True))
        for i, request in enumerate(batch):
            try:
                segments = request.job.finish_window(encoded[i : i + 1], firsts[i])  # type: ignore[arg-type]
            except Exception as e:  # this request's own failure
                logger.exception("speech request failed")
                request.send("error", e)
                request.cancelled = True
                continue
            request.windows += 1
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
