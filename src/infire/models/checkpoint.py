"""Opening a checkpoint as it is stored: a Hugging Face folder of safetensors, or a GGUF file.

`open_checkpoint` reads the config and the tokenizer and returns the weights as a lazy
`WeightSource`; nothing of the weights is read until the model asks. It knows nothing of
Unweight folders: `loader.load_model` adds those on top, and Unweight's compressor reads
its originals through here, so the two never import each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from infire.config import ModelConfig, RopeScaling
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.models.weights import SafetensorsSource, WeightSource
from infire.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"


def open_checkpoint(
    path: Path, dtype: torch.dtype | None
) -> tuple[ModelConfig, WeightSource, Tokenizer]:
    """Config, lazy weights (as `dtype`; None: as stored) and tokenizer of a folder or GGUF."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return open_hf_folder(path, dtype)
    if is_gguf(path):
        from infire.models.gguf import load_gguf

        return load_gguf(path, dtype or torch.bfloat16)
    raise ModelLoadError(
        f"{path}: not a model folder or GGUF file (expected a folder with config.json "
        "and *.safetensors, or a .gguf file)"
    )


def is_gguf(path: Path) -> bool:
    """Whether the file starts with the GGUF magic."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from None


def open_hf_folder(
    folder: Path, dtype: torch.dtype | None
) -> tuple[ModelConfig, WeightSource, Tokenizer]:
    """config.json, the safetensors weights (lazy) and the tokenizer of a Hugging Face folder."""
    config = read_hf_config(folder)
    weights = SafetensorsSource(safetensors_files(folder), dtype)
    tokenizer = hf_tokenizer(folder, config.eos_token_ids)
    return config, weights, tokenizer


def hf_tokenizer(folder: Path, eos_token_ids: tuple[int, ...] | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face folder (EOS ids from config.json unless given)."""
    if eos_token_ids is None:
        raw = read_json(folder / "config.json", required=False)
        eos_token_ids = eos_ids(raw.get("eos_token_id"))
    return Tokenizer.from_hf_folder(folder, eos_token_ids=eos_token_ids)


def read_hf_config(folder: Path) -> ModelConfig:
    """ModelConfig of a Hugging Face folder (config.json and generation_config.json)."""
    raw = read_json(folder / "config.json", required=True)
    generation = read_json(folder / "generation_config.json", required=False)
    return config_from_hf(raw, generation, folder)


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any], where: Path) -> ModelConfig:
    """ModelConfig from an HF config.json (and generation_config.json for extra EOS ids)."""
    from infire.models.registry import family_of_hf

    raw = text_config(raw)
    family = family_of_hf(raw, where)
    raw = {**family.model_class.hf_config_defaults, **raw}
    arch = family.architecture
    try:
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        return family.model_class.config_class(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw, where),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "qwen2"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            **family.model_class.hf_config_fields(raw),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}/config.json: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ModelLoadError(f"{where}/config.json: {e}") from None


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text model as a flat config: `text_config` over the top
    level, whose class name, tying and special token ids still hold."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = {**raw, **text}
    for key in ("architectures", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in raw:
            merged[key] = raw[key]
    return merged


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any], where: Path) -> RopeScaling | None:
    return rope_scaling_from(raw.get("rope_scaling") or raw.get("rope_parameters"), where)


def rope_scaling_from(scaling: dict[str, Any] | None, where: object) -> RopeScaling | None:
    """A config's RoPE scaling dict (rope_scaling / rope_parameters) as a RopeScaling;
    None for plain RoPE."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    try:
        if kind == "linear":
            return RopeScaling(factor=float(scaling["factor"]), kind="linear")
        if kind == "yarn":
            return RopeScaling(
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                kind="yarn",
                beta_fast=float(scaling.get("beta_fast") or 32),
                beta_slow=float(scaling.get("beta_slow") or 1),
                mscale=scaling.get("mscale"),
                mscale_all_dim=scaling.get("mscale_all_dim"),
                attention_factor=scaling.get("attention_factor"),
                truncate=scaling.get("truncate", True),
            )
        if kind == "llama3":
            return RopeScaling(
                factor=scaling["factor"],
                low_freq_factor=scaling["low_freq_factor"],
                high_freq_factor=scaling["high_freq_factor"],
                original_max_position_embeddings=scaling["original_max_position_embeddings"],
            )
    except KeyError as e:
        raise ModelLoadError(f"{where}: rope scaling {kind!r} lacks {e.args[0]!r}") from None
    raise UnsupportedModelError(
        f"{where}: rope scaling {kind!r} is not supported (llama3, linear, yarn are)"
    )


def eos_ids(*values: Any) -> tuple[int, ...]:
    """The distinct integer EOS ids among config values (ints or lists of ints)."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def read_json(path: Path, required: bool) -> dict[str, Any]:
    """A JSON file's object ({} when absent and not required)."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: no {path.name} (not a Hugging Face model folder)")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder (from its index when it has one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, required=True).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard {missing[0].name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (infire never loads pickles)")
    return files
