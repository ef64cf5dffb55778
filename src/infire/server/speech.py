"""Routes of speech models: OpenAI's `POST /v1/audio/transcriptions` and
`POST /v1/audio/translations` (to English).

Multipart uploads, as the `openai` client sends them: `file` (wav, flac, mp3, ogg/opus,
webm, m4a, ...: anything FFmpeg reads), `model`, `language` (transcriptions: ISO 639-1;
detected where absent), `prompt` (text the first window follows, as openai-whisper's
initial prompt), `temperature` (0: openai-whisper's fallback from 0 up to 1 where a
window's text fails its checks; above 0: that temperature alone),
`timestamp_granularities[]` (`segment`, `word`: words timed by the cross-attention
alignment, as openai-whisper's word_timestamps), `chunking_strategy` (`auto`, or a JSON
`{"type": "server_vad", "prefix_padding_ms", "silence_duration_ms", "threshold"}`: the VAD
filter, infire.vad, decodes the speech only; padding and silence as given, webrtcvad's mode
round(3 x threshold)) and `response_format`:
- `json`: {"text", "usage": {"type": "duration", "seconds"}};
- `text`: the text alone; `srt` and `vtt`: subtitles, one cue a segment;
- `verbose_json`: task, language (its English name), duration, text and the segments
  (id, seek, start, end, text, tokens, temperature, avg_logprob, compression_ratio,
  no_speech_prob) and, with `word`, the words ({word, start, end}), as OpenAI's whisper-1
  answers.

Workers AI (`/ai/run/{model}` on a speech model), by the name the request uses:
- `@cf/openai/whisper` (and any other name): the audio's raw bytes as the body (or JSON
  `{"audio": [bytes as integers]}`) -> {text, word_count, words: [{word, start, end}], vtt};
- `@cf/openai/whisper-large-v3-turbo`: JSON {audio: base64, task, language,
  initial_prompt, prefix, vad_filter} -> {transcription_info: {language,
  language_probability, duration, duration_after_vad}, text, word_count, segments: [{start,
  end, text, temperature, avg_logprob, compression_ratio, no_speech_prob, words}], vtt}.
  `vad_filter: true` decodes the speech only (infire.vad, faster-whisper's defaults).

`stream=true` answers server-sent events: `transcript.text.delta` with each window's new
text as it is decoded, then `transcript.text.done` with the whole text and the usage.

Bad input answers in OpenAI's error shape: no file, bytes that are not audio, a corrupt
file or empty audio (400), audio longer than the server's maximum (413), a model that is
not a speech model (400); the request's model is looked up under a lease as every route's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile

from infire.audio import SAMPLE_RATE, decode_audio
from infire.errors import InvalidRequestError
from infire.models.whisper_tokenizer import LANGUAGES
from infire.server.errors import APIError, json_object
from infire.server.openai import SSE_HEADERS, sse
from infire.speech import TranscribeOptions, Transcription
from infire.vad import VadOptions

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def build_router(speech: Callable[[str], Awaitable[Any]], max_audio_seconds: float) -> APIRouter:
    """The OpenAI audio routes over `await speech(model)`: a SpeechEngine (it raises for a
    model that is not a speech model of this server)."""
    router = APIRouter(prefix="/v1/audio")

    @router.post("/transcriptions")
    async def transcriptions(request: Request) -> Any:
        return await _answer(request, "transcribe", speech, max_audio_seconds)

    @router.post("/translations")
    async def translations(request: Request) -> Any:
        return await _answer(request, "translate", speech, max_audio_seconds)

    return router


async def _answer(request: Request, task: str, speech: Callable[[str], Awaitable[Any]],
                  max_audio_seconds: float) -> Any:  # fmt: skip
    try:
        form = await request.form()
    except Exception as e:  # not multipart, or a malformed one
        raise InvalidRequestError(f"send the audio as multipart/form-data: {e}") from e
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError("`file` (the audio, as a file upload) is required", param="file")
    model = _field(form, "model")
    if not model:
        raise InvalidRequestError("`model` is required", param="model")
    engine = await speech(model)
    response_format = _field(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise InvalidRequestError(f"response_format must be one of {', '.join(FORMATS)}",
                                  param="response_format")  # fmt: skip
    granularities = form.getlist("timestamp_granularities[]") or form.getlist(
        "timestamp_granularities"
    )
    for value in granularities:
        if value not in ("segment", "word"):
            raise InvalidRequestError("timestamp_granularities[] takes `segment` and `word`",
                                      param="timestamp_granularities[]")  # fmt: skip
    temperature = _number(_field(form, "temperature") or "0", "temperature")
    if not 0 <= temperature <= 1:
        raise InvalidRequestError("temperature must be between 0 and 1", param="temperature")
    language = (_field(form, "language") or None) if task == "transcribe" else None
    stream = (_field(form, "stream") or "false").lower() in ("true", "1")
    data = await upload.read()
    if not data:
        raise InvalidRequestError("the file is empty", param="file")
    samples = await _samples(data, max_audio_seconds, "file")
    nested = {key[len("chunking_strategy[") : -1]: value for key, value in form.multi_items()
              if key.startswith("chunking_strategy[") and key.endswith("]")}  # fmt: skip
    vad = _chunking(nested or _field(form, "chunking_strategy"))
    options = TranscribeOptions(
        task=task, language=language, temperatures=FALLBACK if temperature == 0 else (temperature,),
        initial_prompt=_field(form, "prompt") or None, word_timestamps="word" in granularities,
        vad_filter=vad is not None, vad_options=vad or VadOptions(),
    )  # fmt: skip
    job = await asyncio.to_thread(engine.job, samples, options)  # checks it; the features
    if stream:
        return StreamingResponse(_events(engine, job), media_type="text/event-stream",
                                 headers=SSE_HEADERS)  # fmt: skip
    result: Transcription = await engine.transcribe(job)
    return _formatted(result, task, response_format, "word" in granularities)


async def _samples(data: bytes, max_audio_seconds: float, param: str) -> Any:
    """The upload decoded to 16 kHz samples (off the event loop); 413 past the maximum."""
    samples = await asyncio.to_thread(decode_audio, data)
    if samples.size > max_audio_seconds * SAMPLE_RATE:
        raise APIError(413, f"the audio lasts {samples.size / SAMPLE_RATE:.1f} s, more than this "
                            f"server's {max_audio_seconds:g} s", param=param)  # fmt: skip
    return samples


def _chunking(value: str | dict | None) -> VadOptions | None:
    """OpenAI's `chunking_strategy` as the VAD filter's settings (None: no filter): `auto`,
    or server_vad's object as JSON or as the form fields `chunking_strategy[type]`, ... (the
    `openai` client's way of sending it)."""
    if value is None or value == "":
        return None
    if value == "auto":
        return VadOptions()
    raw: Any = None
    if isinstance(value, dict):
        raw = dict(value)
        for key in set(raw) - {"type"}:
            with contextlib.suppress(TypeError, ValueError):  # not a number: refused below
                raw[key] = float(raw[key])
    else:
        with contextlib.suppress(ValueError):
            raw = json.loads(value)
    if not isinstance(raw, dict) or raw.get("type") != "server_vad":
        raise InvalidRequestError("chunking_strategy is `auto` or a JSON object of type server_vad",
                                  param="chunking_strategy")  # fmt: skip
    numbers = {}
    for name, default, low, high in (("prefix_padding_ms", 300, 0, 10_000),
                                     ("silence_duration_ms", 200, 30, 60_000),
                                     ("threshold", 0.5, 0.0, 1.0)):  # fmt: skip
        number = raw.get(name, default)
        if (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not low <= number <= high
        ):
            raise InvalidRequestError(f"chunking_strategy.{name} must be a number from {low} to {high}",
                                      param="chunking_strategy")  # fmt: skip
        numbers[name] = number
    return VadOptions(mode=round(3 * numbers["threshold"]), speech_pad_ms=int(numbers["prefix_padding_ms"]),
                      min_silence_duration_ms=int(numbers["silence_duration_ms"]))  # fmt: skip


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, str):
        return value
    raise InvalidRequestError(f"`{name}` must be a form field, not a file", param=name)


def _number(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise InvalidRequestError(f"{name} must be a number", param=name) from None


def _usage(result: Transcription) -> dict:
    return {"type": "duration", "seconds": max(1, round(result.duration))}


def _formatted(result: Transcription, task: str, response_format: str, words: bool = False) -> Any:
    text = result.text.strip()
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(subtitles(result, response_format))
    if response_format == "json":
        return {"text": text, "usage": _usage(result)}
    segments = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                 "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                 "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
                for s in result.segments]  # fmt: skip
    out = {"task": "translate" if task == "translate" else "transcribe",
           "language": LANGUAGES.get(result.language, result.language),
           "duration": round(result.duration, 2), "text": text, "segments": segments,
           "usage": _usage(result)}  # fmt: skip
    if words:
        out["words"] = _words(result)
    return out


def _words(result: Transcription) -> list[dict]:
    return [{"word": w.word.strip(), "start": w.start, "end": w.end}
            for segment in result.segments for w in segment.words]  # fmt: skip


async def workers_ai_run(
    engine: Any, request: Request, model: str, max_audio_seconds: float
) -> dict:
    """The `result` of /ai/run/{model} for a speech model, in the shape the name asks."""
    body = await request.body()
    turbo = "large-v3-turbo" in model
    raw: dict = {}
    if body[:1] == b"{":
        raw = json_object(body)
        audio = raw.get("audio")
        if isinstance(audio, str):
            try:
                data = base64.b64decode(audio, validate=True)
            except ValueError:
                raise InvalidRequestError("audio must be base64", param="audio") from None
        elif isinstance(audio, list) and all(isinstance(b, int) and 0 <= b < 256 for b in audio):
            data = bytes(audio)
        else:
            raise InvalidRequestError("audio (base64, or a list of byte values) is required",
                                      param="audio")  # fmt: skip
    else:
        data = body
    if not data:
        raise InvalidRequestError("the audio is empty", param="audio")
    vad_filter = raw.get("vad_filter", False)
    if not isinstance(vad_filter, bool):
        raise InvalidRequestError("vad_filter must be a boolean", param="vad_filter")
    task = raw.get("task", "transcribe")
    samples = await _samples(data, max_audio_seconds, "audio")
    options = TranscribeOptions(
        task=task if isinstance(task, str) else "", language=raw.get("language") or None,
        initial_prompt=raw.get("initial_prompt") or None, prefix=raw.get("prefix") or None,
        word_timestamps=True, vad_filter=vad_filter,
    )  # fmt: skip
    job = await asyncio.to_thread(engine.job, samples, options)
    result: Transcription = await engine.transcribe(job)
    words = _words(result)
    text = result.text.strip()
    if not turbo:
        return {
            "text": text,
            "word_count": len(words),
            "words": words,
            "vtt": subtitles(result, "vtt"),
        }
    segments = [{"start": s.start, "end": s.end, "text": s.text.strip(), "temperature": s.temperature,
                 "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                 "no_speech_prob": s.no_speech_prob,
                 "words": [{"word": w.word.strip(), "start": w.start, "end": w.end} for w in s.words]}
                for s in result.segments]  # fmt: skip
    info = {"language": result.language,
            "language_probability": result.language_probs.get(result.language, 1.0),
            "duration": round(result.duration, 3),
            "duration_after_vad": round(result.duration if result.duration_after_vad is None
                                        else result.duration_after_vad, 3)}  # fmt: skip
    return {"transcription_info": info, "text": text, "word_count": len(words),
            "segments": segments, "vtt": subtitles(result, "vtt")}  # fmt: skip


def subtitles(result: Transcription, kind: str) -> str:
    """SRT or WebVTT cues, one a segment."""

    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        h, ms = divmod(ms, 3_600_000)
        m, ms = divmod(ms, 60_000)
        s, ms = divmod(ms, 1000)
        return f"{h:02d}:{m:02d}:{s:02d}{',' if kind == 'srt' else '.'}{ms:03d}"

    cues = []
    for i, segment in enumerate(result.segments, 1):
        times = f"{stamp(segment.start)} --> {stamp(segment.end)}"
        cue = f"{times}\n{segment.text.strip()}\n"
        cues.append(f"{i}\n{cue}" if kind == "srt" else cue)
    body = "\n".join(cues)
    return body if kind == "srt" else "WEBVTT\n\n" + body


async def _events(engine: Any, job: Any) -> AsyncIterator[str]:
    try:
        async for item in engine.stream(job):
            if isinstance(item, Transcription):
                yield sse({"type": "transcript.text.done", "text": item.text.strip(),
                           "usage": _usage(item)})  # fmt: skip
            else:
                delta = "".join(segment.text for segment in item)
                yield sse({"type": "transcript.text.delta", "delta": delta})
    except Exception as e:  # noqa: BLE001 - the stream has started: an error event ends it
        from infire.server.errors import error_body

        yield sse(json.dumps({"type": "error", **error_body(e)}))
