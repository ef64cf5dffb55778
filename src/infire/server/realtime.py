"""Realtime transcription over a WebSocket, wire-compatible with OpenAI's
(`/v1/realtime?intent=transcription`).

The client sends JSON events:
- `session.update` (or `transcription_session.update`): {session: {input_audio_format:
  "pcm16" (24 kHz, OpenAI's default) or {"type": "audio/pcm", "rate": R},
  input_audio_transcription: {model, language, prompt}, turn_detection: {type:
  "server_vad", silence_duration_ms, prefix_padding_ms} or null}};
- `input_audio_buffer.append` {audio: base64 little-endian PCM16, mono};
- `input_audio_buffer.commit` (the buffer so far is a turn, with or without the VAD);
- `input_audio_buffer.clear`.

The server answers `session.created` on connect and `session.updated`; with server VAD
(webrtcvad, 30 ms frames at 16 kHz) `input_audio_buffer.speech_started` and
`.speech_stopped`; then for each turn (an item) `input_audio_buffer.committed`
{previous_item_id, item_id}, `conversation.item.input_audio_transcription.delta`
{item_id, content_index, delta} and `.completed` {item_id, content_index, transcript}.
While a turn goes on, its audio so far is transcribed about every second and the words
two such passes agree on (but the newest pass's last word, which its audio may cut) are
sent as deltas, so text arrives before the turn ends; the completed transcript (of the
whole turn, decoded once more) is the authoritative one, and the turn's last delta carries
its text beyond what was sent.

Bad input never ends a session by itself: a frame that is not JSON, an unknown event, bad
base64 or a commit of an empty buffer answer an `error` event ({type: "error", error:
{type, code, message, param, event_id}}) and the session goes on. A client that leaves
mid-turn ends its session: its transcriptions in flight are cancelled (they leave the
speech engine's batch) and its model lease is released.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from infire.audio import SAMPLE_RATE, pcm16_to_float
from infire.catalog.manager import request_leases
from infire.errors import InfireError
from infire.server.errors import to_api_error
from infire.speech import TranscribeOptions, Transcription
from infire.vad import FRAME, FrameVad

logger = logging.getLogger("infire.server.realtime")

# seconds of new audio between two partial transcriptions; a pass starts on a voiced frame
# only (one begun in the silence that ends a turn would hold up the turn's final pass)
PARTIAL_EVERY = 1.0


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """Samples at `rate` to 16 kHz: a windowed-sinc low-pass at the lower Nyquist rate,
    then linear interpolation onto the new grid (enough for speech into Whisper)."""
    if rate == SAMPLE_RATE or samples.size == 0:
        return samples.astype(np.float32)
    if rate > SAMPLE_RATE:
        cutoff = SAMPLE_RATE / 2 / rate
        taps = np.arange(-32, 33)
        kernel = 2 * cutoff * np.sinc(2 * cutoff * taps) * np.hamming(taps.size)
        samples = np.convolve(samples, kernel / kernel.sum(), mode="same")
    times = np.arange(int(samples.size * SAMPLE_RATE / rate)) * rate / SAMPLE_RATE
    return np.interp(times, np.arange(samples.size), samples).astype(np.float32)


class _Turn:
    """The audio of one item (a turn), and what of its text has been sent."""

    def __init__(self, item_id: str, start_ms: int) -> None:
        self.item_id, self.start_ms = item_id, start_ms
        self.audio: list[np.ndarray] = []
        self.sent = ""  # the text sent as deltas so far
        self.previous_partial: list[str] = []
        self.since_partial = 0  # samples since the last partial pass began

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


def stable_delta(sent: str, previous: list[str], words: list[str]) -> str:
    """The delta a partial pass adds: the words it and the pass before (`previous`) agree
    on, beyond `sent` (the text sent so far). The newest pass's last word is held back: its
    audio may end inside it (two passes cut mid-word can agree on a wrong word)."""
    agreed = []
    for a, b in zip(previous, words[:-1], strict=False):
        if a != b:
            break
        agreed.append(a)
    stable, done = " ".join(agreed), sent.strip()
    if not stable.startswith(done) or len(stable) <= len(done):
        return ""
    delta = stable[len(done) :] if sent else stable
    return delta if delta.startswith(" ") or not sent else " " + delta.lstrip()


def final_delta(sent: str, transcript: str) -> str:
    """The last delta of a turn: the transcript beyond the text sent. Deltas cannot be taken
    back, so where the final pass changed words already sent, the rest follows from the
    sent text's word count on (the completed transcript is the authoritative one)."""
    done = sent.strip()
    if transcript.startswith(done):
        return transcript[len(done) :]
    rest = transcript.split()[len(done.split()) :]
    return " " + " ".join(rest) if rest else ""


class RealtimeSession:
    def __init__(self, socket: WebSocket, speech: Callable[[str], Awaitable[Any]]) -> None:
        self.socket, self.speech = socket, speech
        self.id = f"sess_{uuid.uuid4().hex[:24]}"
        self.model = "whisper-1"
        self.language: str | None = None
        self.prompt: str | None = None
        self.rate = 24000  # OpenAI's pcm16
        self.vad: dict | None = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                 "silence_duration_ms": 500}  # fmt: skip
        self.buffer: list[np.ndarray] = []  # audio not yet in a turn (16 kHz)
        self.pending = np.zeros(0, np.float32)  # samples short of a VAD frame
        self.heard_ms = 0  # audio received so far
        self.turn: _Turn | None = None
        self.silent_frames = 0
        self.voiced_frames = 0
        self.previous_item: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self.send_lock = asyncio.Lock()
        self.engine: Any = None
        self.detector = FrameVad(2)

    # -- the wire ------------------------------------------------------------------------

    def session_object(self) -> dict:
        return {"id": self.id, "object": "realtime.transcription_session",
                "input_audio_format": "pcm16" if self.rate == 24000 else {"type": "audio/pcm", "rate": self.rate},
                "input_audio_transcription": {"model": self.model, "language": self.language,
                                              "prompt": self.prompt},
                "turn_detection": self.vad}  # fmt: skip

    async def send(self, event: dict) -> None:
        event = {"event_id": f"event_{uuid.uuid4().hex[:20]}", **event}
        async with self.send_lock:
            with contextlib.suppress(Exception):  # a closed socket: the reader will see it
                await self.socket.send_text(json.dumps(event))

    async def error(self, message: str, code: str, param: str | None = None,
                    event_id: str | None = None, kind: str = "invalid_request_error") -> None:  # fmt: skip
        await self.send({"type": "error", "error": {"type": kind, "code": code, "message": message,
                                                    "param": param, "event_id": event_id}})  # fmt: skip

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": self.session_object()})
        try:
            while True:
                message = await self.socket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    await self.error("send JSON events as text frames", "invalid_frame")
                    continue
                try:
                    event = json.loads(text)
                    if not isinstance(event, dict):
                        raise ValueError("an event is a JSON object")
                except ValueError as e:
                    await self.error(f"the frame is not a JSON event: {e}", "invalid_json")
                    continue
                await self.handle(event)
        except WebSocketDisconnect:
            return
        finally:
            for task in self.tasks:
                task.cancel()

    async def handle(self, event: dict) -> None:
        kind, event_id = event.get("type"), event.get("event_id")
        if kind in ("session.update", "transcription_session.update"):
            await self.update(event.get("session"), event_id)
        elif kind == "input_audio_buffer.append":
            audio = event.get("audio")
            try:
                data = base64.b64decode(audio, validate=True) if isinstance(audio, str) else None
                samples = pcm16_to_float(data) if data is not None else None
            except (binascii.Error, ValueError, InfireError):
                samples = None
            if samples is None:
                await self.error("audio must be base64 PCM16", "invalid_value", "audio", event_id)
                return
            await self.append(resample(samples, self.rate))
        elif kind == "input_audio_buffer.commit":
            audio = (
                self.turn.samples
                if self.turn
                else np.concatenate(self.buffer or [np.zeros(0, np.float32)])
            )
            if audio.size < SAMPLE_RATE // 10:
                await self.error("the buffer holds less than 100 ms of audio",
                                 "input_audio_buffer_commit_empty", None, event_id)  # fmt: skip
                return
            if self.turn is None:
                self.turn = _Turn(f"item_{uuid.uuid4().hex[:24]}", self.heard_ms)
                self.turn.audio = list(self.buffer)
            self.buffer = []
            await self.end_turn()
        elif kind == "input_audio_buffer.clear":
            self.buffer, self.turn, self.pending = [], None, np.zeros(0, np.float32)
            await self.send({"type": "input_audio_buffer.cleared"})
        else:
            await self.error(f"unknown event type {kind!r}", "unknown_event", "type", event_id)

    async def update(self, session: Any, event_id: str | None) -> None:
        if not isinstance(session, dict):
            await self.error("session must be an object", "invalid_value", "session", event_id)
            return
        fmt = session.get("input_audio_format")
        if fmt is not None:
            rate = 24000 if fmt == "pcm16" else fmt.get("rate") if isinstance(fmt, dict) else None
            if not isinstance(rate, int) or not 8000 <= rate <= 48000:
                await self.error("input_audio_format: pcm16, or {type: audio/pcm, rate}", "invalid_value",
                                 "session.input_audio_format", event_id)  # fmt: skip
                return
            self.rate = rate
        transcription = session.get("input_audio_transcription")
        if isinstance(transcription, dict):
            self.model = transcription.get("model") or self.model
            self.language = transcription.get("language") or None
            self.prompt = transcription.get("prompt") or None
        if "turn_detection" in session:
            vad = session["turn_detection"]
            self.vad = None if vad is None else {**(self.vad or {}), **vad}
        try:
            self.engine = await self.speech(self.model)
        except Exception as e:  # noqa: BLE001 - told to the client, the session goes on
            api = to_api_error(e)
            await self.error(api.message, api.code or "invalid_model", "session.input_audio_transcription.model",
                             event_id)  # fmt: skip
            return
        await self.send({"type": "session.updated", "session": self.session_object()})

    # -- audio and turns -----------------------------------------------------------------

    async def append(self, samples: np.ndarray) -> None:
        self.heard_ms += round(samples.size * 1000 / SAMPLE_RATE)
        if self.vad is None:
            self.buffer.append(samples)
            return
        audio = np.concatenate([self.pending, samples])
        usable = audio.size // FRAME * FRAME
        self.pending = audio[usable:]
        for start in range(0, usable, FRAME):
            await self.frame(audio[start : start + FRAME])

    async def frame(self, frame: np.ndarray) -> None:
        voiced = self.detector.is_speech(frame)
        if self.turn is None:
            self.buffer.append(frame)
            keep = int(self.vad.get("prefix_padding_ms", 300) * SAMPLE_RATE / 1000) // FRAME + 3
            self.buffer = self.buffer[-keep:]
            self.voiced_frames = self.voiced_frames + 1 if voiced else 0
            if self.voiced_frames >= 3:  # 90 ms of speech: a turn starts
                start_ms = max(0, self.heard_ms - len(self.buffer) * 30)
                self.turn = _Turn(f"item_{uuid.uuid4().hex[:24]}", start_ms)
                self.turn.audio, self.buffer, self.silent_frames = list(self.buffer), [], 0
                await self.send({"type": "input_audio_buffer.speech_started",
                                 "audio_start_ms": start_ms, "item_id": self.turn.item_id})  # fmt: skip
            return
        turn = self.turn
        turn.audio.append(frame)
        turn.since_partial += FRAME
        self.silent_frames = 0 if voiced else self.silent_frames + 1
        if self.silent_frames * 30 >= self.vad.get("silence_duration_ms", 500):
            await self.send({"type": "input_audio_buffer.speech_stopped",
                             "audio_end_ms": self.heard_ms, "item_id": turn.item_id})  # fmt: skip
            await self.end_turn()
        elif (
            voiced
            and turn.since_partial >= PARTIAL_EVERY * SAMPLE_RATE
            and not any(t.get_name() == f"partial-{turn.item_id}" for t in self.tasks)
        ):
            turn.since_partial = 0
            self.start(self.partial(turn), f"partial-{turn.item_id}")

    async def end_turn(self) -> None:
        turn, self.turn = self.turn, None
        assert turn is not None
        self.voiced_frames = self.silent_frames = 0
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": self.previous_item,
                         "item_id": turn.item_id})  # fmt: skip
        self.previous_item = turn.item_id
        for task in list(self.tasks):  # its partial pass is moot now
            if task.get_name() == f"partial-{turn.item_id}":
                task.cancel()
        self.start(self.complete(turn), f"complete-{turn.item_id}")

    def start(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def transcribe(self, samples: np.ndarray) -> Transcription:
        if self.engine is None:
            self.engine = await self.speech(self.model)
        options = TranscribeOptions(language=self.language, initial_prompt=self.prompt)
        job = await asyncio.to_thread(self.engine.job, samples, options)
        return await self.engine.transcribe(job)

    async def partial(self, turn: _Turn) -> None:
        """Send the words two partial passes agree on (beyond what was sent)."""
        try:
            result = await self.transcribe(turn.samples)
        except Exception:  # noqa: BLE001 - the completed pass reports errors
            return
        words = result.text.split()
        delta = stable_delta(turn.sent, turn.previous_partial, words)
        turn.previous_partial = words
        if delta:
            turn.sent += delta
            await self.send({"type": "conversation.item.input_audio_transcription.delta",
                             "item_id": turn.item_id, "content_index": 0, "delta": delta})  # fmt: skip

    async def complete(self, turn: _Turn) -> None:
        try:
            result = await self.transcribe(turn.samples)
        except Exception as e:  # noqa: BLE001 - the client hears of it, the session goes on
            api = to_api_error(e)
            await self.send({"type": "conversation.item.input_audio_transcription.failed",
                             "item_id": turn.item_id, "content_index": 0,
                             "error": {"type": api.type, "code": api.code, "message": api.message,
                                       "param": api.param}})  # fmt: skip
            return
        transcript = result.text.strip()
        rest = final_delta(turn.sent, transcript)
        if rest:
            await self.send({"type": "conversation.item.input_audio_transcription.delta",
                             "item_id": turn.item_id, "content_index": 0, "delta": rest})  # fmt: skip
        await self.send({"type": "conversation.item.input_audio_transcription.completed",
                         "item_id": turn.item_id, "content_index": 0, "transcript": transcript})  # fmt: skip


def build_router(speech: Callable[[str], Awaitable[Any]]) -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/realtime")
    async def realtime(socket: WebSocket) -> None:
        await socket.accept()
        with request_leases():  # the session's model stays loaded while it runs
            session = RealtimeSession(socket, speech)
            model = socket.query_params.get("model")
            if model:
                session.model = model
            await session.run()
        with contextlib.suppress(Exception):
            await socket.close()

    return router
