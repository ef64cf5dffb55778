"""`infire transcribe FILE`: text, subtitles and JSON on stdout, progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from infire.audio import SAMPLE_RATE, decode_audio
from speech_clips import encode_as, espeak, wer


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infire.cli", "transcribe", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_transcribe_a_long_file_with_progress_to_srt_and_json(tmp_path: Path) -> None:
    texts = ["Open the window and let the fresh air into the room.",
             "The children played football in the park until it got dark."]  # fmt: skip
    parts = [decode_audio(espeak(t, tmp_path / f"{i}.wav")) for i, t in enumerate(texts)]
    gap = np.zeros(SAMPLE_RATE * 14, np.float32)  # over 30 s in all: two windows, each heard
    audio = np.concatenate([parts[0], gap, parts[1], gap, parts[0]])
    path = tmp_path / "long.flac"
    path.write_bytes(encode_as(audio, SAMPLE_RATE, "flac", "flac"))
    srt = _run(str(path), "--format", "srt", "--language", "en", "--progress")
    assert srt.returncode == 0, srt.stderr
    assert srt.stdout.startswith("1\n00:00:0") and "-->" in srt.stdout
    assert "audio" in srt.stderr and "100%" in srt.stderr  # the progress bar reached the end
    out = _run(str(path), "--format", "json", "--word-timestamps")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["language"] == "english" and body["duration"] > 30
    assert wer([(" ".join([*texts, texts[0]]), body["text"])]) <= 0.15
    assert body["segments"][-1]["start"] > 12 and body["segments"][0]["words"]


def test_a_file_that_is_not_audio_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello" * 100)
    out = _run(str(path))
    assert out.returncode == 2 and "not audio" in out.stderr and "Traceback" not in out.stderr


def test_the_vad_filter_keeps_the_recordings_times(tmp_path: Path) -> None:
    text = "The weather today is sunny with a light breeze from the west."
    speech = decode_audio(espeak(text, tmp_path / "s.wav"))
    path = tmp_path / "late.wav"
    path.write_bytes(encode_as(np.concatenate([np.zeros(SAMPLE_RATE * 12, np.float32), speech]),
                               SAMPLE_RATE, "wav", "pcm_s16le"))  # fmt: skip
    run = _run(str(path), "--vad-filter", "--language", "en", "--format", "srt")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[1].startswith("00:00:1"), run.stdout  # about 12 s in, not at 0
    assert wer([(text, lines[2])]) <= 0.2, run.stdout
