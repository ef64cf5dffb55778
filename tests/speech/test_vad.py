"""The VAD filter on whole recordings (infire.vad: webrtcvad): espeak-ng speech between
silences is found, its chunks keep the recording's times, and Whisper decodes the speech
only."""

from __future__ import annotations

import numpy as np
import pytest

from infire.audio import SAMPLE_RATE, decode_audio
from infire.models.whisper import load_whisper, whisper_base_path
from infire.models.whisper_tokenizer import WhisperTokenizer
from infire.speech import TranscribeOptions, transcribe
from infire.vad import FRAME, FrameVad, SpeechMap, VadOptions, join_speech, speech_chunks
from speech_clips import espeak, wer

PAD = VadOptions().speech_pad_ms * SAMPLE_RATE // 1000


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SAMPLE_RATE), np.float32)


def voiced_span(samples: np.ndarray) -> tuple[int, int]:
    """[first, last + 1) of the samples louder than the silence around them."""
    loud = np.flatnonzero(np.abs(samples) > 0.02)
    return int(loud[0]), int(loud[-1]) + 1


@pytest.fixture(scope="module")
def sentences(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[np.ndarray, str]]:
    folder = tmp_path_factory.mktemp("vad")
    texts = ["The quick brown fox jumps over the lazy dog.",
             "We will meet at the library after lunch on Friday."]  # fmt: skip
    return [
        (decode_audio(espeak(text, folder / f"s{i}.wav")), text) for i, text in enumerate(texts)
    ]


def test_chunks_hold_each_utterance_with_its_padding(sentences) -> None:
    (a, _), (b, _) = sentences
    audio = np.concatenate([silence(3), a, silence(4), b, silence(3)])
    chunks = speech_chunks(audio)
    assert len(chunks) == 2  # 4 s apart: more than the 2 s that joins two spans
    for (start, end), (offset, clip) in zip(chunks, [(3 * SAMPLE_RATE, a), (len(audio) - 3 * SAMPLE_RATE - len(b), b)], strict=True):  # fmt: skip
        first, last = voiced_span(clip)
        # the utterance inside, with at most the padding and 3 frames of onset around it
        assert start <= offset + first and offset + last <= end
        assert (
            offset + first - start <= PAD + 3 * FRAME and end - (offset + last) <= PAD + 4 * FRAME
        )
    # a pause under 2 s stays inside one chunk
    assert len(speech_chunks(np.concatenate([a, silence(1.2), b]))) == 1
    assert speech_chunks(silence(5)) == []


def test_the_map_takes_joined_times_back_to_the_recording() -> None:
    chunks = [(16_000, 48_000), (80_000, 96_000)]  # 1-3 s and 5-6 s of the recording
    speech = SpeechMap(chunks)
    assert speech.joined_seconds == 3.0
    assert speech.time(0.0) == 1.0 and speech.time(1.5) == 2.5
    assert speech.time(2.0) == 5.0  # the second chunk's start
    assert speech.time(2.0, end=True) == 3.0  # a span ending there ends in the first chunk
    assert speech.time(2.75) == 5.75
    samples = np.arange(100_000, dtype=np.float32)
    joined = join_speech(samples, chunks)
    assert np.array_equal(joined, np.concatenate([samples[16_000:48_000], samples[80_000:96_000]]))
    assert SpeechMap([]).time(1.25) == 1.25 and join_speech(samples, []).size == 0


def test_frame_vad_refuses_a_frame_of_the_wrong_size() -> None:
    vad = FrameVad()
    assert vad.is_speech(np.zeros(FRAME, np.float32)) is False
    with pytest.raises(ValueError, match="480 samples"):
        vad.is_speech(np.zeros(FRAME - 1, np.float32))
    with pytest.raises(ValueError, match="mode"):
        FrameVad(4)


@pytest.fixture(scope="module")
def base():
    folder = whisper_base_path()
    return load_whisper(folder), WhisperTokenizer(folder / "tokenizer.json")


def test_the_filter_decodes_the_speech_and_keeps_the_recordings_times(base, sentences) -> None:
    """20 s of silence before the speech and 15 s after: one window of speech decoded, its
    segments timed in the recording; without the filter the same words, in two windows."""
    whisper, tokenizer = base
    (a, text_a), (b, text_b) = sentences
    audio = np.concatenate([silence(20), a, silence(3), b, silence(15)])
    options = TranscribeOptions(language="en", vad_filter=True, word_timestamps=True)
    result = transcribe(whisper, tokenizer, audio, options)
    assert result.duration == audio.size / SAMPLE_RATE
    assert result.duration_after_vad is not None
    assert result.duration_after_vad < len(a) / SAMPLE_RATE + len(b) / SAMPLE_RATE + 4 * 0.4 + 0.1
    assert wer([(f"{text_a} {text_b}", result.text)]) <= 0.15, result.text
    assert {segment.seek for segment in result.segments} == {0}  # one window
    first = voiced_span(a)[0] / SAMPLE_RATE + 20
    second = (20 + len(a) / SAMPLE_RATE + 3) + voiced_span(b)[0] / SAMPLE_RATE
    assert first - 0.5 <= result.segments[0].start <= first + 1.0
    assert result.segments[-1].end <= second + len(b) / SAMPLE_RATE + 0.5
    words = [w for segment in result.segments for w in segment.words]
    fridays = [w for w in words if "friday" in w.word.lower()]
    assert fridays and second < fridays[0].start < second + len(b) / SAMPLE_RATE
    assert all(s.start <= s.end for s in result.segments)
    plain = transcribe(whisper, tokenizer, audio, TranscribeOptions(language="en"))
    assert plain.duration_after_vad is None
    assert wer([(f"{text_a} {text_b}", plain.text)]) <= 0.15


def test_silence_alone_gives_no_text(base) -> None:
    whisper, tokenizer = base
    result = transcribe(whisper, tokenizer, silence(8), TranscribeOptions(vad_filter=True))
    assert result.text == "" and result.segments == [] and result.duration_after_vad == 0.0
    assert result.duration == 8.0
