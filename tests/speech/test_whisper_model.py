"""Whisper in infire against transformers: the log-mel front end, the weights of both
formats, and greedy tokens (tiny random models, and Whisper base mapped into transformers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infire.audio import log_mel
from infire.engine.speech import WindowBatcher
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


def test_the_decoder_in_bf16_tiles_matches_bf16_weights_in_float32(tiny_whisper) -> None:
    """`dtype="auto"`: the decoder's linears and output projection in bf16 tiles of the CPU
    kernel, and the cross-attention over the encoding's k and v in bf16, give the logits of
    the float32 model whose decoder weights and cross k, v are rounded to bf16 (float32 sums
    in another order: within 1e-4), and a sequence's logits do not depend on its batch."""
    from infire.models.whisper import TiledLinear

    tiled = load_whisper(tiny_whisper, "auto")
    assert tiled.model.decoder_dtype == "bfloat16"
    assert isinstance(tiled.model.decoder_layers[0].mlp.fc1, TiledLinear)
    assert not isinstance(tiled.model.decoder_layers[0].encoder_attn.k_proj, TiledLinear)
    rounded = load_whisper(tiny_whisper)
    assert rounded.model.decoder_dtype == "float32"
    with torch.no_grad():
        for name, parameter in rounded.model.named_parameters():
            tiled_name = (
                name.endswith(".weight") and "norm" not in name and "encoder_attn.k" not in name
            )
            if name.startswith("decoder_layers.") and tiled_name and "encoder_attn.v" not in name:
                parameter.copy_(parameter.bfloat16().float())
    head = rounded.model.embed_tokens.weight.bfloat16().float()
    features = log_mel(np.stack([np.pad(_noise_and_tones(s, i), (0, 480000 - int(s * 16000)))
                                 for i, s in enumerate([4.0, 9.5])]))  # fmt: skip
    tokens = torch.tensor(
        [[50258, 50259, 50359, 50363, 440, 1151], [50258, 50259, 50359, 50363, 220, 11]]
    )
    model = rounded.model
    with torch.inference_mode():
        cache = model.start(model.encode(features))
        cache.cross = [(k.bfloat16().float(), v.bfloat16().float()) for k, v in cache.cross]
        x = model.embed_tokens(tokens) + model.decoder_positions[: tokens.shape[1]]
        cache.self_kv = [[] for _ in model.decoder_layers]
        for layer, kv, cross in zip(model.decoder_layers, cache.self_kv, cache.cross, strict=True):
            x = layer(x, kv, cross)
        want = model.decoder_norm(x) @ head.T
    got = tiled.model.decode(tokens, tiled.model.start(tiled.model.encode(features)))
    assert (got - want).abs().max().item() <= 1e-4
    alone = tiled.model.decode(tokens[1:], tiled.model.start(tiled.model.encode(features[1:])))
    assert torch.equal(alone[0], got[1])


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_windows_with_prompts_of_different_lengths_batch_as_each_alone(tiny_whisper, dtype) -> None:
    """Prompts of different lengths (previous text after <|startofprev|>) run in one batch:
    each window's tokens, log-probability and no-speech probability are those it gets
    alone."""
    whisper = load_whisper(tiny_whisper, dtype)
    tokenizer = WhisperTokenizer(tiny_whisper / "tokenizer.json")
    features = log_mel(np.stack([np.pad(_noise_and_tones(s, i), (0, 480000 - int(s * 16000)))
                                 for i, s in enumerate([4.0, 9.5, 30.0])]))  # fmt: skip
    sot = tokenizer.sot_sequence("en", "transcribe")
    previous = tokenizer.encode(" The quick brown fox jumps over the lazy dog.")
    prompts = [
        sot,
        [tokenizer.sot_prev, *previous, *sot],
        [tokenizer.sot_prev, *previous[:3], *sot],
    ]
    for timestamps in (False, True):
        batched = decode_greedy(whisper, tokenizer, features, prompts, 20, timestamps)
        for i, prompt in enumerate(prompts):
            alone = decode_greedy(
                whisper, tokenizer, features[i : i + 1], [prompt], 20, timestamps
            )[0]
            assert batched[i].tokens == alone.tokens
            assert batched[i].sum_logprob == pytest.approx(alone.sum_logprob, abs=1e-4)
            assert batched[i].no_speech_prob == pytest.approx(alone.no_speech_prob, abs=1e-5)


def _features(count: int) -> torch.Tensor:
    return log_mel(np.stack([np.pad(_noise_and_tones(4.0 + 3 * i, i), (0, 480000 - (4 + 3 * i) * 16000))
                             for i in range(count)]))  # fmt: skip


def _run(batcher: WindowBatcher, steps: int | None = None) -> dict:
    results: dict = {}
    while batcher.busy and (steps is None or steps > 0):
        results.update(batcher.step())
        steps = None if steps is None else steps - 1
    return results


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_windows_join_and_leave_the_batch_at_any_step(tiny_whisper, dtype) -> None:
    """Continuous batching: a window added while others decode joins their steps; one that
    ends leaves; each gets the tokens it gets alone, and every block is free at the end."""
    whisper = load_whisper(tiny_whisper, dtype)
    tokenizer = WhisperTokenizer(tiny_whisper / "tokenizer.json")
    features = _features(3)
    encoded = whisper.model.encode(features)
    sot = tokenizer.sot_sequence("en", "transcribe")
    prompts = [sot, [tokenizer.sot_prev, *tokenizer.encode(" Hello there."), *sot], sot]
    lengths = [30, 12, 20]
    alone = [decode_greedy(whisper, tokenizer, None, [prompt], n, True, encoded[i : i + 1])[0]
             for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
    batcher = WindowBatcher(whisper, tokenizer, max_seqs=4)
    batcher.add("a", encoded[0:1], prompts[0], lengths[0], True)
    results = _run(batcher, steps=5)  # "a" is 5 tokens in
    batcher.add("b", encoded[1:2], prompts[1], lengths[1], True)
    results |= _run(batcher, steps=3)
    batcher.add("c", encoded[2:3], prompts[2], lengths[2], True)
    results |= _run(batcher)
    assert batcher.most_windows == 3
    for key, want in zip("abc", alone, strict=True):
        assert results[key].tokens == want.tokens
        assert results[key].sum_logprob == pytest.approx(want.sum_logprob, abs=1e-4)
        assert results[key].no_speech_prob == pytest.approx(want.no_speech_prob, abs=1e-5)
    manager = batcher.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not batcher.windows


def test_windows_preempted_for_blocks_are_recomputed_to_the_same_tokens(tiny_whisper) -> None:
    """A pool that holds one window's 448 tokens, and 5 windows of 4 + 120: the newest are
    preempted (their blocks freed) and recomputed later, with the tokens they get alone."""
    whisper = load_whisper(tiny_whisper, "auto")
    tokenizer = WhisperTokenizer(tiny_whisper / "tokenizer.json")
    encoded = whisper.model.encode(_features(5))
    sot = tokenizer.sot_sequence("en", "transcribe")
    batcher = WindowBatcher(whisper, tokenizer, max_seqs=5, kv_tokens=1)
    for i in range(5):
        batcher.add(i, encoded[i : i + 1], sot, 120, False)
    results = _run(batcher)
    assert batcher.preemptions > 0
    for i in range(5):
        alone = decode_greedy(whisper, tokenizer, None, [sot], 120, False, encoded[i : i + 1])[0]
        assert results[i].tokens == alone.tokens
        assert len(alone.tokens) == 120  # the random model writes to the limit: the pool fills


def test_an_aborted_window_frees_its_blocks_and_the_others_go_on(tiny_whisper) -> None:
    whisper = load_whisper(tiny_whisper, "auto")
    tokenizer = WhisperTokenizer(tiny_whisper / "tokenizer.json")
    encoded = whisper.model.encode(_features(2))
    sot = tokenizer.sot_sequence("en", "transcribe")
    batcher = WindowBatcher(whisper, tokenizer, max_seqs=2)
    batcher.add("gone", encoded[0:1], sot, 40, False)
    batcher.add("kept", encoded[1:2], sot, 40, False)
    _run(batcher, steps=4)
    batcher.abort("gone")
    manager = batcher.scheduler.block_manager
    assert manager.num_blocks - manager.num_free_blocks == manager.blocks_needed(4 + 3)
    results = _run(batcher)
    assert list(results) == ["kept"]
    alone = decode_greedy(whisper, tokenizer, None, [sot], 40, False, encoded[1:2])[0]
    assert results["kept"].tokens == alone.tokens
    assert manager.num_free_blocks == manager.num_blocks
