"""`infire serve` with its default catalog: Whisper base behind OpenAI's audio routes,
through the real `openai` client (every response format, streaming), 8 requests at once,
and the errors of each kind of bad input."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from harness import Server, assert_openai_error

from infire.audio import decode_audio
from speech_clips import encode_as, espeak, spoken_clips, wer

MODEL = "whisper-base"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(["--max-audio-seconds", "40"], tmp_path_factory.mktemp("speech") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    return spoken_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def test_the_default_catalog_lists_whisper_for_speech(server: Server) -> None:
    models = {m["id"]: m for m in httpx.get(f"{server.base_url}/models").json()["data"]}
    assert models[MODEL]["task"] == "automatic-speech-recognition"
    assert "@cf/openai/whisper" in models[MODEL]["aliases"]
    found = httpx.get(f"{server.url}/ai/models/search",
                      params={"task": "Automatic Speech Recognition"}).json()  # fmt: skip
    assert [m["name"] for m in found["result"]] == ["@cf/openai/whisper"]


def test_every_response_format_through_the_openai_client(client, clips) -> None:
    path, text = clips[3]
    with path.open("rb") as f:
        plain = client.audio.transcriptions.create(model=MODEL, file=f, language="en")
    assert wer([(text, plain.text)]) <= 0.15, plain.text
    with path.open("rb") as f:
        as_text = client.audio.transcriptions.create(model=MODEL, file=f, response_format="text",
                                                     language="en")  # fmt: skip
    assert as_text.strip() == plain.text
    with path.open("rb") as f:
        verbose = client.audio.transcriptions.create(
            model=MODEL, file=f, response_format="verbose_json", timestamp_granularities=["segment"]
        )  # the language detected
    assert verbose.language == "english" and verbose.text == plain.text
    assert 2.0 < verbose.duration < 10.0
    assert verbose.segments and verbose.segments[0].start == 0.0
    assert verbose.segments[-1].end <= verbose.duration + 0.5
    with path.open("rb") as f:
        srt = client.audio.transcriptions.create(model=MODEL, file=f, response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:\d\d,\d\d\d\n\S", srt), srt
    with path.open("rb") as f:
        vtt = client.audio.transcriptions.create(model=MODEL, file=f, response_format="vtt")
    assert re.match(r"WEBVTT\n\n00:00:00\.000 --> 00:00:\d\d\.\d\d\d\n\S", vtt), vtt
    assert " ".join(plain.text.split()) in " ".join(srt.split()) or wer([(plain.text, srt)]) < 0.5


def test_every_container_is_heard(client, clips) -> None:
    from infire.audio import decode_audio

    path, text = clips[3]
    samples = decode_audio(path)
    for container, codec, suffix in [("flac", "flac", ".flac"), ("mp3", "libmp3lame", ".mp3"),
                                     ("ogg", "libopus", ".ogg"), ("webm", "libopus", ".webm"),
                                     ("ipod", "aac", ".m4a")]:  # fmt: skip
        data = encode_as(samples, 16000, container, codec)
        got = client.audio.transcriptions.create(
            model=MODEL, file=(f"clip{suffix}", data), language="en"
        )
        # lossy codecs change a word or two of espeak's voice; a decoding error loses all
        assert wer([(text, got.text)]) <= 0.3, (suffix, got.text)


def test_streaming_sends_deltas_then_the_whole_text(client, clips) -> None:
    path, text = clips[5]
    with path.open("rb") as f:
        events = list(
            client.audio.transcriptions.create(model=MODEL, file=f, language="en", stream=True)
        )
    kinds = [event.type for event in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text
    assert wer([(text, events[-1].text)]) <= 0.15


def test_translation_to_english(client, tmp_path: Path) -> None:
    german = espeak("Guten Morgen, wie geht es dir heute?", tmp_path / "de.wav", "de")
    with german.open("rb") as f:
        verbose = client.audio.translations.create(
            model=MODEL, file=f, response_format="verbose_json"
        )
    assert verbose.task == "translate" and verbose.language == "german"
    assert verbose.text and verbose.text.isascii()


def test_eight_requests_at_once_give_each_ones_transcript(client, clips) -> None:
    chosen = clips[:8]

    def one(item: tuple[Path, str]) -> str:
        with item[0].open("rb") as f:
            return client.audio.transcriptions.create(model=MODEL, file=f, language="en").text

    alone = [one(item) for item in chosen]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, chosen))
    assert together == alone
    assert wer(list(zip([t for _, t in chosen], together, strict=True))) <= 0.15


def test_bad_input_gets_openai_errors(server: Server, clips, tmp_path: Path) -> None:
    url = f"{server.base_url}/audio/transcriptions"
    wav = clips[0][0].read_bytes()

    def post(files: dict | None, **data: str) -> httpx.Response:
        return httpx.post(url, files=files, data={"model": MODEL, **data}, timeout=120)

    assert_openai_error(post({"file": ("a.wav", b"this is not audio" * 50)}), 400, "file")
    # a corrupt file: an m4a whose frames are noise after its header
    m4a = encode_as(np.sin(np.arange(32000) / 10).astype(np.float32) * 0.3, 16000, "ipod", "aac")
    noise = np.random.default_rng(0).integers(0, 256, len(m4a) - 200, dtype=np.uint8).tobytes()
    assert_openai_error(post({"file": ("a.m4a", m4a[:200] + noise)}), 400, "file")
    assert_openai_error(post({"file": ("a.wav", b"")}), 400, "file")
    silence = encode_as(np.zeros(0, np.float32), 16000, "wav", "pcm_s16le")
    assert_openai_error(post({"file": ("empty.wav", silence)}), 400, "file")
    long = encode_as(np.zeros(16000 * 41, np.float32), 16000, "wav", "pcm_s16le")
    assert_openai_error(post({"file": ("long.wav", long)}), 413, "file")
    assert_openai_error(httpx.post(url, data={"model": MODEL}), 400, "file")
    assert_openai_error(
        post({"file": ("a.wav", wav)}, response_format="mp4"), 400, "response_format"
    )
    assert_openai_error(post({"file": ("a.wav", wav)}, language="xx"), 400, "language")
    assert_openai_error(
        post({"file": ("a.wav", wav)}, **{"timestamp_granularities[]": "char"}), 400
    )
    assert_openai_error(post({"file": ("a.wav", wav)}, temperature="2"), 400, "temperature")
    # a model that is not a speech model, and chat sent to the speech model
    error = assert_openai_error(
        post({"file": ("a.wav", wav)}, model="smollm2-135m-instruct"), 400, "model"
    )
    assert "speech" in error["message"]
    chat = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert "speech" in assert_openai_error(chat, 400, "model")["message"]
    # the server goes on
    ok = post({"file": ("a.wav", wav)}, language="en")
    assert ok.status_code == 200 and ok.json()["text"]


def test_word_timestamps_in_verbose_json(client, clips) -> None:
    path, text = clips[3]
    with path.open("rb") as f:
        verbose = client.audio.transcriptions.create(
            model=MODEL, file=f, response_format="verbose_json", language="en",
            timestamp_granularities=["word", "segment"],
        )  # fmt: skip
    assert [w.word for w in verbose.words] == verbose.text.split()
    assert all(a.start <= b.start for a, b in zip(verbose.words, verbose.words[1:], strict=False))
    assert verbose.words[-1].end <= verbose.duration + 0.5


def test_workers_ai_whisper_shapes(server: Server, clips) -> None:
    import base64

    path, text = clips[5]
    raw = httpx.post(
        f"{server.url}/ai/run/@cf/openai/whisper", content=path.read_bytes(), timeout=120
    )
    assert raw.status_code == 200, raw.text
    result = raw.json()["result"]
    assert set(result) == {"text", "word_count", "words", "vtt"}
    assert wer([(text, result["text"])]) <= 0.15 and result["word_count"] == len(result["words"])
    assert set(result["words"][0]) == {"word", "start", "end"} and result["vtt"].startswith(
        "WEBVTT"
    )
    as_list = httpx.post(f"{server.url}/ai/run/@cf/openai/whisper", timeout=120,
                         json={"audio": list(path.read_bytes())})  # fmt: skip
    assert as_list.json()["result"]["text"] == result["text"]
    turbo = httpx.post(f"{server.url}/ai/run/@cf/openai/whisper-large-v3-turbo", timeout=120,
                       json={"audio": base64.b64encode(path.read_bytes()).decode(),
                             "task": "transcribe", "language": "en"})  # fmt: skip
    assert turbo.status_code == 200, turbo.text
    body = turbo.json()["result"]
    assert set(body) == {"transcription_info", "text", "word_count", "segments", "vtt"}
    assert body["transcription_info"]["language"] == "en"
    assert set(body["segments"][0]) == {"start", "end", "text", "temperature", "avg_logprob",
                                        "compression_ratio", "no_speech_prob", "words"}  # fmt: skip
    bad = httpx.post(f"{server.url}/ai/run/@cf/openai/whisper-large-v3-turbo", timeout=60,
                     json={"audio": "not base64!"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["success"] is False
    late = encode_as(np.concatenate([np.zeros(16000 * 10, np.float32), decode_audio(path)]),
                     16000, "wav", "pcm_s16le")  # fmt: skip
    vad = httpx.post(f"{server.url}/ai/run/@cf/openai/whisper-large-v3-turbo", timeout=120,
                     json={"audio": base64.b64encode(late).decode(), "vad_filter": True})  # fmt: skip
    assert vad.status_code == 200, vad.text
    info, segments = vad.json()["result"]["transcription_info"], vad.json()["result"]["segments"]
    assert info["duration_after_vad"] < info["duration"] - 8 and segments[0]["start"] >= 9.0
    assert wer([(text, vad.json()["result"]["text"])]) <= 0.15
    not_bool = httpx.post(f"{server.url}/ai/run/@cf/openai/whisper-large-v3-turbo", timeout=60,
                          json={"audio": base64.b64encode(late).decode(), "vad_filter": "yes"})  # fmt: skip
    assert not_bool.status_code == 400 and "vad_filter" in not_bool.text


def test_chunking_strategy_filters_the_silence(server: Server, client, clips) -> None:
    """OpenAI's chunking_strategy: `auto` or server_vad settings turn the VAD filter on; the
    segments keep the recording's times."""
    path, text = clips[2]
    late = encode_as(np.concatenate([np.zeros(16000 * 10, np.float32), decode_audio(path)]),
                     16000, "wav", "pcm_s16le")  # fmt: skip
    for strategy in (
        "auto",
        {"type": "server_vad", "prefix_padding_ms": 200, "silence_duration_ms": 600},
    ):
        result = client.audio.transcriptions.create(model=MODEL, file=("late.wav", late),
                                                    response_format="verbose_json", language="en",
                                                    chunking_strategy=strategy)  # fmt: skip
        assert result.segments[0].start >= 9.0 and wer([(text, result.text)]) <= 0.15, result
    for bad in ("sometimes", '{"type": "server_vad", "threshold": 2}', '{"type": "semantic"}'):
        response = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=60,
                              files={"file": ("late.wav", late)},
                              data={"model": MODEL, "chunking_strategy": bad})  # fmt: skip
        assert_openai_error(response, 400, param="chunking_strategy")
