"""Model loading errors: each bad input names the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from infire.errors import ModelLoadError, UnsupportedModelError
from infire.models.loader import load_model


def test_hf_folder_loads(tiny_llama: Path):
    loaded = load_model(tiny_llama, torch.float32)
    assert loaded.config.architecture == "llama"
    assert loaded.config.num_key_value_heads == 2
    assert "model.layers.1.mlp.down_proj.weight" in loaded.weights


def test_missing_path(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32)


def test_truncated_safetensors(tiny_llama: Path, tmp_path: Path):
    folder = shutil.copytree(tiny_llama, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(folder, torch.float32)


def test_unsupported_model_type(tiny_llama: Path, tmp_path: Path):
    folder = shutil.copytree(tiny_llama, tmp_path / "gpt2ish")
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"llama"', '"gpt2"'))
    with pytest.raises(UnsupportedModelError, match="gpt2") as error:
        load_model(folder, torch.float32)
    assert "supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral" in str(error.value)


def test_an_unknown_multimodal_class_is_refused_by_its_name(tiny_llama: Path, tmp_path: Path):
    folder = shutil.copytree(tiny_llama, tmp_path / "llava")
    config = json.loads((folder / "config.json").read_text())
    text = {**config, "model_type": "llama"}
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": text}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration"):
        load_model(folder, torch.float32)


def test_gemma3_fields_a_config_leaves_out_take_transformers_defaults(tmp_path: Path):
    from tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "gemma", "gemma3_text")
    config = json.loads((folder / "config.json").read_text())
    for field in ("max_position_embeddings", "query_pre_attn_scalar", "tie_word_embeddings"):
        del config[field]  # as the 4B-27B checkpoints' text_config leave them out
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder, torch.float32).config
    assert loaded.max_position_embeddings == 131072
    assert loaded.tie_word_embeddings


def test_missing_tensor(tiny_llama: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama, tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    from infire.config import CacheConfig
    from infire.engine.runner import ModelRunner

    loaded = load_model(folder, torch.float32)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.qkv_proj\.weight\[1\]"):
        ModelRunner(loaded.config, loaded.weights, CacheConfig(num_blocks=4), torch.float32)


def test_not_a_model(tmp_path: Path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model folder or GGUF"):
        load_model(junk, torch.float32)
