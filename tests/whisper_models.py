"""Whisper models for the speech tests: tiny random ones written by transformers, Whisper
base (the installed CTranslate2 folder) mapped into transformers, and the generation
settings transformers needs for both (from the CTranslate2 folder's config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from infire.models.whisper import whisper_base_path
from infire.models.whisper_tokenizer import LANGUAGES


def generation_settings(folder: Path) -> dict:
    """transformers' Whisper generation fields, from faster-whisper's config.json and the
    tokenizer (the ids of the special tokens)."""
    raw = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    return {
        "suppress_tokens": raw["suppress_ids"],
        "begin_suppress_tokens": raw["suppress_ids_begin"],
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "is_multilingual": True,
        "lang_to_id": {
            f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES if f"<|{code}|>" in ids
        },
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "max_initial_timestamp_index": 50,
        "prev_sot_token_id": ids["<|startofprev|>"],
    }


def write_tiny_whisper(folder: Path, seed: int = 0, n_mels: int = 80) -> Path:
    """A random 2+2-layer Whisper (d_model 64) with Whisper base's vocabulary, tokenizer and
    generation settings, saved as transformers saves it."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    base = whisper_base_path()
    settings = generation_settings(base)
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=51865, num_mel_bins=n_mels, d_model=64, encoder_layers=2,
        encoder_attention_heads=4, decoder_layers=2, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
        max_target_positions=448, init_std=0.2,
        decoder_start_token_id=settings["decoder_start_token_id"],
        eos_token_id=settings["eos_token_id"], pad_token_id=settings["pad_token_id"],
        bos_token_id=settings["eos_token_id"],
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(**settings)
    model.save_pretrained(folder)
    shutil.copy(base / "tokenizer.json", folder / "tokenizer.json")
    return folder


def whisper_base_in_transformers():
    """Whisper base's CTranslate2 weights in transformers' WhisperForConditionalGeneration
    (float32), with its generation settings."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from infire.models.ct2 import model_parts, read_model_bin
    from infire.models.whisper import WhisperConfig as Dims
    from infire.models.whisper import ct2_to_hf

    base = whisper_base_path()
    weights, heads = ct2_to_hf(read_model_bin(model_parts(base)).variables)
    dims = Dims.from_weights(weights, heads)
    settings = generation_settings(base)
    config = WhisperConfig(
        vocab_size=dims.vocab_size, num_mel_bins=dims.num_mel_bins, d_model=dims.d_model,
        encoder_layers=dims.encoder_layers, encoder_attention_heads=heads[0],
        decoder_layers=dims.decoder_layers, decoder_attention_heads=heads[1],
        encoder_ffn_dim=dims.encoder_ffn_dim, decoder_ffn_dim=dims.decoder_ffn_dim,
        decoder_start_token_id=settings["decoder_start_token_id"],
        eos_token_id=settings["eos_token_id"], pad_token_id=settings["pad_token_id"],
        bos_token_id=settings["eos_token_id"],
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    state = {name: tensor.float() for name, tensor in weights.items()}
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "k_proj.bias" not in m], (
        missing,
        unexpected,
    )
    model.generation_config = GenerationConfig(**settings)
    return model
