"""The model registry: which class runs an architecture, by the names checkpoints use.

A Hugging Face folder names its class in config.json (`architectures`, or `model_type`),
a GGUF file in `general.architecture` (llama.cpp's name); both map to one `ModelFamily`:
its model class (a `CausalLM`), the ModelConfig subclass it reads, and our short name
(`ModelConfig.architecture`). Anything else is refused with the list of what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infire.config import ModelConfig
from infire.errors import UnsupportedModelError
from infire.models.base import CausalLM
from infire.models.deepseek_v3 import DeepseekV3ForCausalLM
from infire.models.gemma3 import Gemma3ForCausalLM
from infire.models.llama import LlamaForCausalLM
from infire.models.llama4 import Llama4ForCausalLM
from infire.models.mixtral import MixtralForCausalLM
from infire.models.qwen3 import Qwen3ForCausalLM
from infire.models.qwen3_moe import Qwen3MoeForCausalLM
from infire.parallel import check_parallel


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One architecture as every format names it."""

    architecture: str  # ours: ModelConfig.architecture
    model_class: type[CausalLM]
    hf_architectures: tuple[str, ...]  # config.json "architectures"
    hf_model_types: tuple[str, ...]  # config.json "model_type"
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture (llama.cpp's)


FAMILIES = (
    ModelFamily("llama", LlamaForCausalLM, ("LlamaForCausalLM",), ("llama",), ("llama",)),
    ModelFamily("mistral", LlamaForCausalLM, ("MistralForCausalLM",), ("mistral",)),
    ModelFamily("qwen2", LlamaForCausalLM, ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",)),
    ModelFamily("qwen3", Qwen3ForCausalLM, ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    ModelFamily(
        "qwen3_moe", Qwen3MoeForCausalLM, ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)
    ),
    # llama.cpp writes Mixtral as "llama" with experts: see family_of_gguf
    ModelFamily("mixtral", MixtralForCausalLM, ("MixtralForCausalLM",), ("mixtral",)),
    # the multimodal checkpoints' text part too (their vision tower is not loaded)
    ModelFamily(
        "gemma3",
        Gemma3ForCausalLM,
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        ("gemma3_text", "gemma3"),
        ("gemma3",),
    ),
    ModelFamily(
        "deepseek_v3",
        DeepseekV3ForCausalLM,
        ("DeepseekV3ForCausalLM",),
        ("deepseek_v3", "kimi_k2"),
        ("deepseek2",),
    ),
    ModelFamily(
        "llama4",
        Llama4ForCausalLM,
        ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
        ("llama4_text", "llama4"),
        ("llama4",),
    ),
)
_BY_NAME = {family.architecture: family for family in FAMILIES}


def supported() -> str:
    """The supported architectures, for error messages."""
    return ", ".join(family.architecture for family in FAMILIES)


def family_named(architecture: str) -> ModelFamily:
    """The family of a ModelConfig.architecture."""
    try:
        return _BY_NAME[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported (supported: {supported()})"
        ) from None


def check_split(config: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Refuse (ModelLoadError naming the constraint) a model that cannot be cut into tp_size
    tensor-parallel ranks and pp_size pipeline stages, by its family's rules too."""
    check_parallel(config, tp_size, pp_size)
    family_named(config.architecture).model_class.check_parallel(config, tp_size)


def family_of_hf(raw: dict[str, Any], where: object) -> ModelFamily:
    """The family of a config.json: by its `architectures` where its `model_type` agrees
    (or is absent), else by its `model_type`."""
    names = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    for family in FAMILIES:
        agrees = not model_type or model_type in family.hf_model_types
        if agrees and any(name in family.hf_architectures for name in names):
            return family
    if "text_config" in raw:  # a multimodal class we do not know: not its text model's
        model_type = ""
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    shown = ", ".join(names) or repr(model_type)
    raise UnsupportedModelError(
        f"{where}: architecture {shown} (model_type {model_type!r}) is not supported "
        f"(supported: {supported()})"
    )


def family_of_gguf(file_arch: str, metadata: dict[str, Any], where: object) -> ModelFamily:
    """The family of a GGUF file's general.architecture."""
    if file_arch == "llama" and metadata.get("llama.expert_count"):
        return _BY_NAME["mixtral"]
    for family in FAMILIES:
        if file_arch in family.gguf_architectures:
            return family
    known = sorted({name for family in FAMILIES for name in family.gguf_architectures})
    raise UnsupportedModelError(
        f"{where}: GGUF architecture {file_arch!r} is not supported (supported: {', '.join(known)})"
    )
