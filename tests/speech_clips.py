"""Speech for the tests, synthesized by espeak-ng (a Debian package, `.ci/run` installs it):
sentences in several voices and speeds, a word error rate, and faster-whisper's folder of
Whisper base (model.bin assembled from the installed parts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore.",
    "A journey of a thousand miles begins with a single step.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "Open the window and let the fresh air into the room.",
    "My favorite color is blue and my brother likes green.",
    "We will meet at the library after lunch on Friday.",
    "The children played football in the park until it got dark.",
    "Learning a new language takes patience and practice.",
    "The train to the city leaves every morning at eight.",
    "Turn off the lights when you leave the kitchen.",
]
# (espeak-ng voice, words a minute)
VOICES = [("en-us", 150), ("en", 165), ("en-us+f3", 140), ("en+m3", 175), ("en-us+m7", 155),
          ("en+f2", 160)]  # fmt: skip


def espeak(text: str, path: Path, voice: str = "en-us", speed: int = 160) -> Path:
    """A WAV file (22.05 kHz mono PCM16) of espeak-ng saying `text`."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed: `apt-get install espeak-ng` (.ci/run does)")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    return path


def spoken_clips(folder: Path) -> list[tuple[Path, str]]:
    """Every sentence in a voice and speed of its own: (wav path, text)."""
    clips = []
    for i, text in enumerate(SENTENCES):
        voice, speed = VOICES[i % len(VOICES)]
        clips.append((espeak(text, folder / f"clip{i}.wav", voice, speed), text))
    return clips


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words) after lowercasing and
    dropping punctuation."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1], len(ref)


def wer(pairs: list[tuple[str, str]]) -> float:
    """Word error rate over (reference, hypothesis) pairs."""
    errors = [word_errors(ref, hyp) for ref, hyp in pairs]
    return sum(e for e, _ in errors) / sum(n for _, n in errors)


def faster_whisper_folder(folder: Path) -> Path:
    """Whisper base as faster-whisper loads it: the parts of model.bin joined into one file
    beside config.json, tokenizer.json and vocabulary.json."""
    from infire.models.whisper import whisper_base_path

    base = whisper_base_path()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "model.bin").open("wb") as out:
        for part in sorted(base.glob("model.bin.part*")):
            out.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):
        shutil.copy(base / name, folder / name)
    return folder


# container (PyAV format name), codec, file suffix: what the audio routes must read
CONTAINERS = [("flac", "flac", ".flac"), ("mp3", "libmp3lame", ".mp3"), ("ogg", "libopus", ".ogg"),
              ("webm", "libopus", ".webm"), ("ipod", "aac", ".m4a"), ("wav", "pcm_s16le", ".wav")]  # fmt: skip


def encode_as(samples, rate: int, container: str, codec: str) -> bytes:
    """Mono float32 samples written by FFmpeg (PyAV) in a container and codec."""
    import io

    import av
    import numpy as np

    out = io.BytesIO()
    if codec == "pcm_s16le":  # the standard library's writer (it writes an empty file too)
        import wave

        with wave.open(out, "wb") as file:
            file.setnchannels(1)
            file.setsampwidth(2)
            file.setframerate(rate)
            file.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
        return out.getvalue()
    with av.open(out, "w", format=container) as file:
        target = 48000 if codec == "libopus" else rate
        stream = file.add_stream(codec, rate=target)
        stream.layout = "mono"
        stream.bit_rate = 128_000  # lossy codecs: well above what speech needs
        frame = av.AudioFrame.from_ndarray(
            (np.clip(samples, -1, 1) * 32767).astype(np.int16)[None], format="s16", layout="mono"
        )
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=target)
        for chunk in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(chunk):
                file.mux(packet)
        for packet in stream.encode(None):
            file.mux(packet)
    return out.getvalue()
