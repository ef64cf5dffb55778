"""Whisper in infire against transformers: the log-mel front end, the weights of both
formats, and greedy tokens (tiny random models, and Whisper base mapped into transformers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infire.audio import log_mel
from infire.models.ct2 import model_parts, read_model_bin
from infire.models.whisper import load_whisper, whisper_base_path
from infire.models.whisper_tokenizer import WhisperTokenizer
from infire.speech import decode_greedy
from whisper_models import whisper_base_in_transformers, write_tiny_whisper


def _noise_and_tones(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tones = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t * (1 + t / 20))
    return (tones + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [0.7, 12.3, 30.0, 41.0])
def test_log_mel_matches_whisper_feature_extractor(n_mels: int, seconds: float) -> None:
    from transformers import WhisperFeatureExtractor

    audio = _noise_and_tones(seconds, seed=int(seconds * 10))
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    want = extractor(audio, sampling_rate=16000, return_tensors="pt").input_features[0]
    got = log_mel(audio, n_mels)
    assert got.shape == want.shape == (n_mels, 3000)
    assert (got - want).abs().max().item() <= 1e-4


def test_a_batch_of_windows_has_each_windows_features() -> None:
    clips = [_noise_and_tones(s, seed=i) for i, s in enumerate([3.0, 30.0])]
    batch = log_mel(np.stack([np.pad(c, (0, 480000 - c.size)) for c in clips]))
    for row, clip in zip(batch, clips, strict=True):
        assert torch.equal(row, log_mel(clip))


def test_whisper_base_ct2_folder_reads_every_variable() -> None:
    ct2 = read_model_bin(model_parts(whisper_base_path()))
    assert ct2.spec == "WhisperSpec" and ct2.revision == 3
    assert ct2.scalar("encoder/num_heads") == 8 and ct2.scalar("decoder/num_heads") == 8
    assert ct2.variables["decoder/embeddings/weight"].shape == (51865, 512)
    # the alias is the same tensor, not a copy
    assert ct2.variables["decoder/projection/weight"] is ct2.variables["decoder/embeddings/weight"]
    whisper = load_whisper(whisper_base_path())
    assert (whisper.config.encoder_layers, whisper.config.decoder_layers) == (6, 6)
    assert whisper.config.num_mel_bins == 80 and whisper.config.d_model == 512


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def _transformers_greedy(model, features: torch.Tensor, **kwargs) -> list[list[int]]:
    """transformers' greedy tokens after the prompt (Whisper's generate leaves the prompt
    out), up to <|endoftext|> (finished rows are padded with it)."""
    with torch.inference_mode():
        out = model.generate(features, do_sample=False, num_beams=1, **kwargs)
    eot = model.generation_config.eos_token_id
    return [row[: row.index(eot)] if eot in row else row for row in out.tolist()]


def test_tiny_whisper_greedy_equals_transformers(tiny_whisper) -> None:
    from transformers import WhisperForConditionalGeneration

    reference = WhisperForConditionalGeneration.from_pretrained(tiny_whisper).eval()
    whisper = load_whisper(tiny_whisper)
    tokenizer = WhisperTokenizer(tiny_whisper / "tokenizer.json")
    features = log_mel(np.stack([np.pad(_noise_and_tones(s, i), (0, 480000 - int(s * 16000)))
                                 for i, s in enumerate([4.0, 9.5, 30.0])]))  # fmt: skip
    for language, task in [("en", "transcribe"), ("de", "translate")]:
        prompt = tokenizer.sot_sequence(language, task)
        want = _transformers_greedy(reference, features, language=language, task=task,
                                    max_new_tokens=24)  # fmt: skip
        got = decode_greedy(whisper, tokenizer, features, [prompt] * 3, 24)
        assert [r.tokens for r in got] == want
        alone = [
            decode_greedy(whisper, tokenizer, features[i : i + 1], [prompt], 24)[0]
            for i in range(3)
        ]
        assert [r.tokens for r in alone] == want


def test_whisper_base_greedy_equals_transformers() -> None:
    reference = whisper_base_in_transformers()
    whisper = load_whisper(whisper_base_path())
    tokenizer = WhisperTokenizer(whisper_base_path() / "tokenizer.json")
    features = log_mel(_noise_and_tones(6.0, seed=3))[None]
    prompt = tokenizer.sot_sequence("en", "transcribe")
    want = _transformers_greedy(reference, features, language="en", task="transcribe",
                                max_new_tokens=32)  # fmt: skip
    got = decode_greedy(whisper, tokenizer, features, [prompt], 32)
    assert [r.tokens for r in got] == want
