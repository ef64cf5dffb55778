"""Voice activity detection by webrtcvad (Google's WebRTC VAD): 30 ms frames at 16 kHz.

`FrameVad` says whether one frame holds speech (the realtime route's turns). `speech_chunks`
finds the spans of speech in a recording and `SpeechMap` maps times in the speech-only
audio back to the recording's, for the VAD filter on files (faster-whisper's `vad_filter`,
Workers AI's `vad_filter`): the silence between chunks is cut before decoding, so Whisper
does not invent text in it, and the segments keep the recording's times.

The filter's settings are faster-whisper's defaults, on 30 ms frames: a chunk is speech of
at least 250 ms; silences shorter than 2 s inside speech stay in it; each chunk keeps
400 ms of padding on both sides (halved between two chunks closer than 800 ms).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from infire.audio import SAMPLE_RATE

FRAME = 480  # samples of a frame: 30 ms at 16 kHz
FRAME_MS = 30


class FrameVad:
    """webrtcvad on 30 ms frames of float samples in [-1, 1] at 16 kHz. `mode`: webrtcvad's
    aggressiveness, 0 (least) .. 3 (most ready to call a frame silence)."""

    def __init__(self, mode: int = 2) -> None:
        import webrtcvad

        if mode not in (0, 1, 2, 3):
            raise ValueError(f"the VAD's mode is 0, 1, 2 or 3, not {mode!r}")
        self.detector = webrtcvad.Vad(mode)

    def is_speech(self, frame: np.ndarray) -> bool:
        if frame.size != FRAME:
            raise ValueError(f"a VAD frame is {FRAME} samples, not {frame.size}")
        pcm = (np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes()
        return self.detector.is_speech(pcm, SAMPLE_RATE)


@dataclass(frozen=True, slots=True)
class VadOptions:
    """faster-whisper's VadOptions that a frame VAD can follow (its silero `threshold` has
    no webrtcvad counterpart: `mode` sets how ready a frame is to be called silence)."""

    mode: int = 2
    min_speech_duration_ms: int = 250
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400


def speech_chunks(samples: np.ndarray, options: VadOptions | None = None) -> list[tuple[int, int]]:
    """The recording's spans of speech, as [start, end) sample offsets in order, padded
    and apart (see the module's docstring). Empty where it holds no speech."""
    options = options or VadOptions()
    vad = FrameVad(options.mode)
    frames = samples.size // FRAME
    voiced = [vad.is_speech(samples[i * FRAME : (i + 1) * FRAME]) for i in range(frames)]
    spans: list[list[int]] = []  # [first, last + 1) frames
    gap = options.min_silence_duration_ms // FRAME_MS
    for i, speech in enumerate(voiced):
        if not speech:
            continue
        if spans and i - spans[-1][1] < gap:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    shortest = -(-options.min_speech_duration_ms // FRAME_MS)
    chunks = [[a * FRAME, b * FRAME] for a, b in spans if b - a >= shortest]
    pad = options.speech_pad_ms * SAMPLE_RATE // 1000
    for k, chunk in enumerate(chunks):
        before = chunk[0] - chunks[k - 1][1] if k else None
        chunk[0] = max(0, chunk[0] - (pad if before is None or before >= 2 * pad else before // 2))
        after = chunks[k + 1][0] - chunk[1] if k + 1 < len(chunks) else None
        end = chunk[1] + (pad if after is None or after >= 2 * pad else after // 2)
        chunk[1] = min(samples.size, end)
    return [(a, b) for a, b in chunks]


class SpeechMap:
    """Times in the chunks' audio joined end to end -> times in the recording."""

    def __init__(self, chunks: list[tuple[int, int]]) -> None:
        self.starts: list[float] = []  # each chunk's start in the joined audio (s)
        self.offsets: list[float] = []  # what to add to a time in that chunk (s)
        joined = 0
        for start, end in chunks:
            self.starts.append(joined / SAMPLE_RATE)
            self.offsets.append((start - joined) / SAMPLE_RATE)
            joined += end - start
        self.joined_seconds = joined / SAMPLE_RATE

    def time(self, seconds: float, end: bool = False) -> float:
        """The recording's time of `seconds` into the joined audio (`end`: a span's end
        at a chunk's boundary stays in the chunk before)."""
        if not self.starts:
            return seconds
        find = bisect.bisect_left if end else bisect.bisect_right
        k = max(0, find(self.starts, seconds) - 1)
        return seconds + self.offsets[k]


def join_speech(samples: np.ndarray, chunks: list[tuple[int, int]]) -> np.ndarray:
    """The chunks' samples end to end."""
    if not chunks:
        return np.zeros(0, np.float32)
    return np.concatenate([samples[a:b] for a, b in chunks]).astype(np.float32, copy=False)
