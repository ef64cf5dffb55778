"""Audio in: any container PyAV (FFmpeg) reads, as 16 kHz mono float32, and Whisper's
log-mel features.

`decode_audio` takes bytes or a path (wav, flac, mp3, ogg/opus, webm, m4a, ...), mixes the
channels down and resamples to 16 kHz with FFmpeg's resampler; bytes that are not audio,
or a file that is corrupt or holds no samples, raise InvalidRequestError with the reason.

`log_mel` is Whisper's front end, as transformers' WhisperFeatureExtractor computes it:
a 400-point STFT with a periodic Hann window every 160 samples (centered, reflected at the
edges), the power spectrum without its last frame, Slaney-style mel filters (80 or 128
bins up to 8 kHz), log10 floored at 1e-10, clamped to 8 below the maximum, then
(x + 4) / 4. Audio is padded with zeros (or cut) to 30 s: 3000 frames.
"""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path

import numpy as np
import torch

from infire.errors import InvalidRequestError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in a window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames of features
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100


def decode_audio(source: bytes | str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `sample_rate` from an audio file's bytes or path."""
    import av

    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source))
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(f"the file is not audio that can be decoded ({_reason(exc)})",
                                  param="file") from exc  # fmt: skip
    chunks: list[np.ndarray] = []
    try:
        with container:
            if not container.streams.audio:
                raise InvalidRequestError(
                    "the file is not audio: it has no audio stream", param="file"
                )
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as exc:
        raise InvalidRequestError(f"the audio is corrupt: it could not be decoded ({_reason(exc)})",
                                  param="file") from exc  # fmt: skip
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InvalidRequestError("the audio is empty: it holds no samples", param="file")
    return samples


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian 16-bit PCM bytes as float32 samples in [-1, 1)."""
    if len(data) % 2:
        raise InvalidRequestError("PCM16 audio must be an even number of bytes", param="audio")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


@cache
def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters on the Slaney mel scale (linear below 1
    kHz, logarithmic above), each normalized to unit area (Slaney's norm), 0 Hz to 8 kHz."""
    freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)

    def hz_to_mel(hz: np.ndarray) -> np.ndarray:
        hz = np.asarray(hz, dtype=np.float64)
        mel = 3.0 * hz / 200.0
        log = hz >= 1000.0
        return np.where(
            log, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mel
        )

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        hz = 200.0 * mel / 3.0
        log = mel >= 15.0
        return np.where(log, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)

    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - freqs[:, None]  # [bins, n_mels + 2]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))  # [bins, n_mels]
    filters *= 2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])
    return torch.from_numpy(filters.T.astype(np.float32))


def pad_or_trim(samples: np.ndarray, length: int = N_SAMPLES) -> np.ndarray:
    if samples.shape[-1] >= length:
        return samples[..., :length]
    return np.pad(samples, [(0, 0)] * (samples.ndim - 1) + [(0, length - samples.shape[-1])])


def log_mel(samples: np.ndarray | torch.Tensor, n_mels: int = 80, pad: bool = True) -> torch.Tensor:
    """Whisper's input features [n_mels, 3000] (a batch [B, n_mels, 3000] for [B, samples])
    in float32: 30 s windows, padded with zeros (pad=False: as long as the samples)."""
    x = torch.as_tensor(pad_or_trim(np.asarray(samples)) if pad else samples, dtype=torch.float32)
    window = torch.hann_window(N_FFT)
    spectrum = torch.stft(
        x.double(), N_FFT, HOP_LENGTH, window=window.double(), return_complex=True
    )
    power = (spectrum[..., :-1].abs() ** 2).float()
    mel = mel_filters(n_mels) @ power
    log = torch.clamp(mel, min=1e-10).log10()
    floor = log.amax(dim=(-2, -1), keepdim=True) - 8.0
    return (torch.maximum(log, floor) + 4.0) / 4.0
