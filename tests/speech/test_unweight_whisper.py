"""Unweight-compressed Whisper: `infire compress` on a Hugging Face Whisper (a tiny random
one) and on the installed CTranslate2 Whisper base; the folder verifies against its
original, loads the same weights bit for bit, and transcribes as the original does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infire.audio import decode_audio
from infire.models.whisper import is_whisper_folder, load_whisper, whisper_base_path, whisper_bytes
from infire.models.whisper_tokenizer import WhisperTokenizer
from infire.speech import TranscribeOptions, transcribe
from infire.unweight import UnweightError
from infire.unweight.container import compress_model, forms, verify
from speech_clips import espeak, wer
from whisper_models import write_tiny_whisper


def _compress(src: Path, dst: Path, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "infire.cli", "compress", str(src), str(dst), *args],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stderr


def _same_weights(a: Path, b: Path) -> None:
    one, two = load_whisper(a).model.state_dict(), load_whisper(b).model.state_dict()
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_a_hugging_face_whisper_round_trips(tmp_path: Path) -> None:
    tiny = write_tiny_whisper(tmp_path / "tiny")
    dst = tmp_path / "tiny-unweight"
    _compress(tiny, dst, "--form", "rans")
    assert is_whisper_folder(dst) and "rans" in forms(dst)
    assert verify(dst, against=tiny, progress=False) == []
    assert whisper_bytes(dst) == whisper_bytes(tiny)
    _same_weights(tiny, dst)
    with pytest.raises(UnweightError, match="already an Unweight folder"):
        compress_model(dst, tmp_path / "again", progress=False)


def test_whisper_base_compressed_transcribes_as_the_original(tmp_path: Path) -> None:
    """The CTranslate2 folder (float16 tensors) compressed with rANS: smaller, the same
    float16 bits, the same transcript; `infire transcribe --model` serves it."""
    dst = tmp_path / "whisper-base-unweight"
    report = _compress(whisper_base_path(), dst)
    assert "of the original" in report
    stored = sum(
        p.stat().st_size for p in whisper_base_path().iterdir() if p.name.startswith("model.bin")
    )
    assert (dst / "unweight.safetensors").stat().st_size < stored
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "whisper" and config["d_model"] == 512
    generation = json.loads((dst / "generation_config.json").read_text())
    assert generation["suppress_tokens"] and "alignment_heads" in generation
    assert verify(dst, against=whisper_base_path(), progress=False) == []
    _same_weights(whisper_base_path(), dst)
    text = "Open the window and let the fresh air into the room."
    path = espeak(text, tmp_path / "clip.wav")
    tokenizer = WhisperTokenizer(dst / "tokenizer.json")
    options = TranscribeOptions(language="en")
    want = transcribe(
        load_whisper(whisper_base_path(), "auto"), tokenizer, decode_audio(path), options
    )
    got = transcribe(load_whisper(dst, "auto"), tokenizer, decode_audio(path), options)
    assert got.text == want.text and [s.tokens for s in got.segments] == [
        s.tokens for s in want.segments
    ]
    run = subprocess.run([sys.executable, "-m", "infire.cli", "transcribe", str(path), "--model", str(dst),
                          "--language", "en"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == want.text.strip() and wer([(text, run.stdout)]) <= 0.15
