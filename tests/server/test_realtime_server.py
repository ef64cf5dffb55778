"""Realtime transcription over a WebSocket against `infire serve`: PCM16 streamed at real
time, server VAD turns, deltas before a turn ends, and bad frames that leave the session
(and the server) going."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness import Server
from websockets.sync.client import connect

from infire.audio import decode_audio
from infire.server.realtime import final_delta, stable_delta
from speech_clips import espeak, wer

MODEL = "whisper-base"
RATE = 24000  # OpenAI's pcm16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server([], tmp_path_factory.mktemp("realtime") / "server.log")
    yield server
    server.stop()


def _pcm24k(samples: np.ndarray) -> bytes:
    times = np.arange(int(samples.size * RATE / 16000)) * 16000 / RATE
    up = np.interp(times, np.arange(samples.size), samples)
    return (np.clip(up, -1, 1) * 32767).astype("<i2").tobytes()


def _events(ws, until: str, timeout: float = 120) -> list[dict]:
    out, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        event = json.loads(ws.recv(timeout=end - time.monotonic()))
        out.append(event)
        if event["type"] == until:
            return out
    raise AssertionError(f"no {until} in {[e['type'] for e in out]}")


def _open(server: Server):
    ws = connect(server.url.replace("http", "ws") + "/v1/realtime?intent=transcription")  # noqa: SIM115
    assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
    ws.send(json.dumps({"type": "session.update", "session": {
        "input_audio_format": "pcm16",
        "input_audio_transcription": {"model": MODEL, "language": "en"},
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 600}}}))  # fmt: skip
    assert (
        _events(ws, "session.updated")[-1]["session"]["input_audio_transcription"]["model"] == MODEL
    )
    return ws


def test_speech_at_real_time_pace_gets_deltas_before_the_turn_ends(
    server: Server, tmp_path: Path
) -> None:
    text = ("Please call Stella and ask her to bring these things with her from the store. "
            "The children played football in the park until it got dark.")  # fmt: skip
    speech = decode_audio(espeak(text, tmp_path / "turn.wav", "en-us", 150))
    audio = _pcm24k(
        np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(24000, np.float32)])
    )
    chunk = RATE * 2 // 10  # 100 ms of PCM16
    with _open(server) as ws:
        received: list[dict] = []
        reader = threading.Thread(target=lambda: received.extend(
            _events(ws, "conversation.item.input_audio_transcription.completed", 180)))  # fmt: skip
        reader.start()
        for start in range(0, len(audio), chunk):
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(audio[start : start + chunk]).decode()}))  # fmt: skip
            time.sleep(0.1)
        reader.join(180)
    kinds = [e["type"] for e in received]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
        "input_audio_buffer.speech_stopped"
    )
    deltas = [i for i, k in enumerate(kinds) if k.endswith("transcription.delta")]
    assert deltas and deltas[0] < kinds.index("input_audio_buffer.speech_stopped"), kinds
    committed = received[kinds.index("input_audio_buffer.committed")]
    completed = received[-1]
    assert completed["item_id"] == committed["item_id"] == received[deltas[0]]["item_id"]
    transcript = completed["transcript"]
    streamed = "".join(received[i]["delta"] for i in deltas)
    print("deltas:", [received[i]["delta"] for i in deltas], "\ntranscript:", transcript)
    assert wer([(text, transcript)]) <= 0.15
    assert wer([(transcript, streamed)]) <= 0.2  # the deltas spell the turn, near enough


def test_manual_commit_and_bad_frames_leave_the_session_going(
    server: Server, tmp_path: Path
) -> None:
    speech = decode_audio(
        espeak("Turn off the lights when you leave the kitchen.", tmp_path / "a.wav")
    )
    with _open(server) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        _events(ws, "session.updated")
        for bad, code in [("not json", "invalid_json"), (json.dumps({"type": "nope"}), "unknown_event"),
                          (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_value"),
                          (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty")]:  # fmt: skip
            ws.send(bad)
            assert _events(ws, "error")[-1]["error"]["code"] == code
        ws.send(b"\x00\x01binary")
        assert _events(ws, "error")[-1]["error"]["code"] == "invalid_frame"
        ws.send(
            json.dumps(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(_pcm24k(speech)).decode(),
                }
            )
        )
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = _events(ws, "conversation.item.input_audio_transcription.completed")
        assert (
            wer([("Turn off the lights when you leave the kitchen.", events[-1]["transcript"])])
            <= 0.15
        )


def test_a_client_that_leaves_mid_turn_does_not_stop_the_server(
    server: Server, tmp_path: Path
) -> None:
    speech = decode_audio(
        espeak("We will meet at the library after lunch on Friday.", tmp_path / "b.wav")
    )
    ws = _open(server)
    pcm = _pcm24k(speech)
    ws.send(
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(pcm[: len(pcm) // 4 * 2]).decode(),  # half, whole samples
            }
        )
    )
    _events(ws, "input_audio_buffer.speech_started")
    ws.close()  # mid-turn
    with _open(server) as again:  # a new session is served
        again.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
            )
        )
        again.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = _events(again, "conversation.item.input_audio_transcription.completed")
        assert "library" in events[-1]["transcript"].lower()


def test_partial_passes_send_the_words_they_agree_on_but_the_last() -> None:
    # the newest pass's last word is held back even where both passes have it
    assert (
        stable_delta("", ["Please", "call", "Stel"], ["Please", "call", "Stel", "and"])
        == "Please call Stel"
    )
    assert stable_delta("", ["Please", "call"], ["Please", "call"]) == "Please"
    assert (
        stable_delta("Please", ["Please", "call", "Stella"], ["Please", "call", "Stella", "and"])
        == " call Stella"
    )
    assert (
        stable_delta("Please call", ["Please", "fall"], ["Please", "call", "it"]) == ""
    )  # nothing new agreed
    assert stable_delta("Please call", ["Please", "call", "X"], ["Please", "call", "Y", "z"]) == ""


def test_the_last_delta_carries_the_transcript_beyond_what_was_sent() -> None:
    assert final_delta("", "Please call Stella.") == "Please call Stella."
    assert final_delta("Please call", "Please call Stella.") == " Stella."
    assert final_delta("Please call Stella.", "Please call Stella.") == ""
    # words sent and changed by the final pass cannot be taken back: the rest follows on
    text = "Please call Taylor and ask her to bring these things"
    assert final_delta("Please call Taylor and ask for", text) == " to bring these things"
    assert final_delta("Please call Taylor and ask for", "Please call Taylor") == ""
