"""Audio files in every container the routes read, decoded to 16 kHz mono float32, and
the clear errors of bytes that are not audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infire.audio import decode_audio, pcm16_to_float
from infire.errors import InvalidRequestError
from speech_clips import CONTAINERS, encode_as, espeak


@pytest.fixture(scope="module")
def voice(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    path = espeak(
        "Open the window and let the fresh air in.", tmp_path_factory.mktemp("a") / "v.wav"
    )
    return decode_audio(path)


@pytest.mark.parametrize(
    ("container", "codec", "suffix"), CONTAINERS, ids=[c[2] for c in CONTAINERS]
)
def test_every_container_decodes_to_the_same_sound(voice, container, codec, suffix) -> None:
    data = encode_as(voice, 16000, container, codec)
    got = decode_audio(data)
    # lossy codecs pad and delay a little (AAC by 1024 samples and whole frames): the same
    # length within 0.15 s
    assert abs(got.size - voice.size) <= 2400, (got.size, voice.size)
    assert got.dtype == np.float32 and got.min() >= -1.0 and got.max() <= 1.0
    # the same loud and quiet 10 ms frames, at the codec's delay (up to 15 frames)
    frames = lambda x: np.sqrt(np.mean(x[: x.size // 160 * 160].reshape(-1, 160) ** 2, axis=1))  # noqa: E731
    a, b = frames(got), frames(voice)
    best = max(np.corrcoef(a[lag : lag + b.size - 15], b[: b.size - 15])[0, 1] for lag in range(16))
    assert best > 0.9


def test_a_44_khz_stereo_file_is_mixed_down_and_resampled(tmp_path: Path) -> None:
    import av

    t = np.arange(44100) / 44100
    left, right = np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 440 * t)
    path = tmp_path / "stereo.wav"
    with av.open(str(path), "w") as file:
        stream = file.add_stream("pcm_s16le", rate=44100)
        stream.layout = "stereo"
        frame = av.AudioFrame.from_ndarray((np.stack([left, right]) * 16000).astype(np.int16).T.reshape(1, -1),
                                           format="s16", layout="stereo")  # fmt: skip
        frame.sample_rate = 44100
        for packet in stream.encode(frame):
            file.mux(packet)
        for packet in stream.encode(None):
            file.mux(packet)
    got = decode_audio(path)
    assert abs(got.size - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(got[:16000]))
    assert abs(int(spectrum.argmax()) - 440) <= 1  # still 440 Hz, at 16 kHz


@pytest.mark.parametrize("data", [b"", b"not audio at all" * 100, b"RIFF\x00\x00\x00\x00WAVEfmt "],
                         ids=["empty", "text", "truncated wav"])  # fmt: skip
def test_bytes_that_are_not_audio_are_refused_clearly(data: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        decode_audio(data)


def test_a_wav_without_samples_is_empty_audio(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        decode_audio(encode_as(np.zeros(0, np.float32), 16000, "wav", "pcm_s16le"))


def test_pcm16_bytes() -> None:
    data = np.array([0, 16384, -32768, 32767], "<i2").tobytes()
    assert pcm16_to_float(data).tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    with pytest.raises(InvalidRequestError):
        pcm16_to_float(b"\x00")
