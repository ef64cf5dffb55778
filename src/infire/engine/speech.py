"""SpeechEngine: a Whisper model behind one thread that batches windows across requests.

Each request is a `TranscriptionJob` (speech.py): its recording's windows, one after the
other, each after the previous one's text. The engine thread loops:
- requests that have no window in flight (new ones, and those whose last window just
  finished) have their next windows encoded together, in one batch; a job whose language is
  to be detected has it detected on its first window;
- a window decoded greedily at the first temperature joins the WindowBatcher (below):
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
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infire.config import SchedulerConfig
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.scheduler import Scheduler
from infire.errors import EngineDeadError
from infire.models.whisper import CrossKV, LoadedWhisper, PagedBatch, PagedKV, load_whisper
from infire.models.whisper_tokenizer import WhisperTokenizer
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams
from infire.speech import (
    LogitRules,
    Segment,
    TranscribeOptions,
    Transcription,
    TranscriptionJob,
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


@dataclass(eq=False, slots=True)
class _Window:
    """A greedy window in a WindowBatcher: its sequence, its cross-attention KV, and what
    its result keeps."""

    key: object
    seq: Sequence
    cross: CrossKV
    sot_at: int  # the prompt's <|startoftranscript|>: the no-speech probability is read there
    max_new_tokens: int
    rules: LogitRules
    no_speech: float | None = None
    logprob: float = 0.0

    @property
    def sampled(self) -> list[int]:
        return self.seq.output_token_ids


class WindowBatcher:
    """Greedy windows decoded by continuous batching, as the LLM engine decodes text: the
    engine's Scheduler takes a token budget each step (a window's prompt is a prefill,
    chunked where it is long, then one token a step), its BlockManager hands out the
    blocks of the decoder's paged self-attention KV (`PagedKV`; the newest window is
    preempted and recomputed when they run out), and each window's cross-attention KV is
    computed once when it is added and dropped when it finishes. A window may join or
    leave at any step. The prefix cache is off: a decoder's KV depends on its audio."""

    def __init__(self, whisper: LoadedWhisper, tokenizer: WhisperTokenizer, max_seqs: int = 16,
                 kv_tokens: int | None = None, max_batched_tokens: int = 1024,
                 block_size: int = 16) -> None:  # fmt: skip
        self.whisper, self.tokenizer = whisper, tokenizer
        self.max_positions = whisper.config.max_target_positions
        # every window fits (a longer one is refused by add), 256 tokens each by default
        kv_tokens = max(kv_tokens or 256 * max_seqs, self.max_positions)
        num_blocks = -(-kv_tokens // block_size)
        self.kv = PagedKV(whisper.config, num_blocks, block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(max(max_batched_tokens, self.max_positions), max_seqs),
            BlockManager(num_blocks, block_size, enable_prefix_caching=False),
        )
        self.windows: dict[int, _Window] = {}
        self._rules: dict[bool, LogitRules] = {}
        self._ids = itertools.count()
        self.most_windows = 0  # the most windows one step has run (tests read these two)
        self.preemptions = 0

    @property
    def busy(self) -> bool:
        return bool(self.windows)

    def add(self, key: object, encoded: torch.Tensor, prompt: list[int], max_new_tokens: int,
            timestamps: bool) -> None:  # fmt: skip
        """Decode a window (its encoding [1, frames, d_model]) after `prompt`; `step`
        returns its result under `key`."""
        if len(prompt) >= self.max_positions:
            raise ValueError(f"the decoder holds {self.max_positions} tokens")
        if timestamps not in self._rules:
            self._rules[timestamps] = LogitRules(self.tokenizer, self.whisper.generation,
                                                 self.whisper.config.vocab_size, timestamps)  # fmt: skip
        seq_id = next(self._ids)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        seq = Sequence(seq_id, str(key), 0, list(prompt), params, None,  # type: ignore[arg-type]
                       RequestMetrics(time.monotonic()))  # fmt: skip
        cross = self.whisper.model.cross_kv(encoded)
        self.windows[seq_id] = _Window(key, seq, cross, prompt.index(self.tokenizer.sot),
                                       max_new_tokens, self._rules[timestamps])  # fmt: skip
        self.scheduler.add(seq)

    def abort(self, key: object) -> None:
        """Drop the windows added under `key`: their blocks and cross-attention KV go."""
        for seq_id, window in list(self.windows.items()):
            if window.key == key:
                self.scheduler.finish(window.seq)
                del self.windows[seq_id]

    @torch.inference_mode()
    def step(self) -> list[tuple[object, WindowResult]]:
        """One decoder step over what the scheduler picks; the windows that finished in it."""
        out = self.scheduler.schedule()
        # a window the pool could never hold (not one: add refuses what the pool cannot hold)
        ended = [self._end(self.windows[seq.seq_id]) for seq in out.finished]
        if not out.scheduled:
            return ended
        self.most_windows = max(self.most_windows, len(out.scheduled))
        self.preemptions += len(out.preempted)
        bs = self.kv.block_size
        tokens, positions, slots, seq, want, sot_rows = [], [], [], [], [], []
        ends: list[_Window] = []
        width = max(len(s.seq.block_table) for s in out.scheduled)
        tables = torch.zeros(len(out.scheduled), width, dtype=torch.int32)
        for row, scheduled in enumerate(out.scheduled):
            s, n = scheduled.seq, scheduled.num_new_tokens
            window, first = self.windows[s.seq_id], s.num_computed_tokens
            tables[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
            if window.no_speech is None and first <= window.sot_at < first + n:
                sot_rows.append((window, len(tokens) + window.sot_at - first))
            for p in range(first, first + n):
                positions.append(p)
                slots.append(s.block_table[p // bs] * bs + p % bs)
            tokens += s.token_ids[first : first + n]
            seq += [row] * n
            if first + n == len(s.token_ids):  # its last token: the next is sampled
                ends.append(window)
                want.append(len(tokens) - 1)
            s.num_computed_tokens += n
        rows = [row for _, row in sot_rows] + want
        batch = PagedBatch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
                           torch.tensor(seq, dtype=torch.int32), tables)  # fmt: skip
        crosses = [self.windows[s.seq.seq_id].cross for s in out.scheduled]
        logits = self.whisper.model.decode_paged(batch, self.kv, crosses, torch.tensor(rows))
        no_speech = self.tokenizer.no_speech
        for i, (window, _) in enumerate(sot_rows):
            window.no_speech = float(torch.softmax(logits[i].float(), dim=-1)[no_speech])
        return ended + self._sample(ends, logits[len(sot_rows) :])

    def _sample(
        self, ends: list[_Window], logits: torch.Tensor
    ) -> list[tuple[object, WindowResult]]:
        finished = []
        chosen = torch.empty(len(ends), dtype=torch.long)
        logprobs = torch.empty(len(ends))
        for rules in self._rules.values():  # the windows of each set of rules together
            rows = [i for i, window in enumerate(ends) if window.rules is rules]
            if rows:
                masked = rules.apply(logits[rows].clone(), [ends[i].sampled for i in rows])
                chosen[rows] = masked.argmax(dim=-1)
                logprobs[rows] = torch.log_softmax(masked.float(), dim=-1).gather(
                    1, chosen[rows][:, None])[:, 0]  # fmt: skip
        for window, token, logprob in zip(ends, chosen.tolist(), logprobs.tolist(), strict=True):
            window.logprob += logprob
            seq = window.seq
            if token != self.tokenizer.eot:
                seq.token_ids.append(token)
            full = len(seq.token_ids) >= self.max_positions
            if token == self.tokenizer.eot or len(window.sampled) >= window.max_new_tokens or full:
                finished.append(self._end(window))
        return finished

    def _end(self, window: _Window) -> tuple[object, WindowResult]:
        """A window's result; its blocks and cross-attention KV go."""
        self.scheduler.finish(window.seq)
        del self.windows[window.seq.seq_id]
        return window.key, WindowResult(
            list(window.sampled), window.logprob, window.no_speech or 0.0
        )


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
