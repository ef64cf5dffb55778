"""Mixtral: the Llama block whose MLP is a sparse mixture of experts.

Each token's router logits pick its top-k experts (of `num_local_experts`, k =
`num_experts_per_tok`, 2 in Mixtral 8x7B); their softmax weights, renormalized over the
chosen k, weigh the experts' SwiGLU outputs. Checkpoints name the router
`block_sparse_moe.gate` and expert e's projections `experts.{e}.w1` (gate), `w3` (up)
and `w2` (down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.layers.kv_spec import KVCacheSpec
from infire.layers.linear import ColumnParallelLinear
from infire.layers.moe import FusedMoE, softmax_topk
from infire.models.base import CausalLM
from infire.models.llama import (
    LlamaDecoderLayer,
    llama_attention,
    sliding_window_of,
    uniform_kv_spec,
)
from infire.parallel import TensorParallelGroup


@dataclass(frozen=True, slots=True)
class MoEConfig(ModelConfig):
    """A model whose MLPs are (some or all) top-k routed experts."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0  # each expert's; 0: intermediate_size
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE; the rest are dense

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} of {self.num_experts} experts"
            )


def check_expert_split(config: MoEConfig, tp_size: int) -> None:
    """Refuse experts whose intermediate features do not split over tp_size ranks."""
    size = config.moe_intermediate_size or config.intermediate_size
    if size % tp_size:
        raise ModelLoadError(
            f"cannot split this model over tensor_parallel_size {tp_size}: the experts' "
            f"intermediate size {size} is not divisible by it"
        )


def gguf_expert_fields(metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The MoEConfig fields llama.cpp writes as `{arch}.expert_*` (it makes every layer
    sparse and renormalizes the top-k weights)."""
    return {
        "num_experts": int(metadata[f"{prefix}.expert_count"]),
        "num_experts_per_tok": int(metadata[f"{prefix}.expert_used_count"]),
        "norm_topk_prob": True,
        "sparse_layers": tuple(range(int(metadata[f"{prefix}.block_count"]))),
    }


class SplitsExperts:
    """Mixin of the MoE families: the base split rules, and experts that split by
    intermediate features."""

    @classmethod
    def check_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        """Refuse a model whose heads, MLP or experts cannot split over tp_size ranks."""
        super().check_parallel(config, tp_size)  # type: ignore[misc]
        check_expert_split(config, tp_size)  # type: ignore[arg-type]


class SparseMoeBlock(nn.Module):
    """Router (replicated: every rank routes the same way) + softmax top-k experts."""

    def __init__(self, config: MoEConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = ColumnParallelLinear(config.hidden_size, [config.num_experts])
        size = config.moe_intermediate_size or config.intermediate_size
        self.experts = FusedMoE(config.num_experts, config.hidden_size, size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, ids, weights.to(x.dtype))


class MixtralForCausalLM(SplitsExperts, CausalLM):
    """Mixtral 8x7B / 8x22B and other Llama-with-experts models."""

    config_class: ClassVar[type[ModelConfig]] = MoEConfig
    supports_fused_cpu: ClassVar[bool] = True  # the fused forward runs its experts too
    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Mixtral's expert counts; every layer is sparse."""
        return {
            "num_experts": raw["num_local_experts"],
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "norm_topk_prob": True,
            "sparse_layers": tuple(range(raw["num_hidden_layers"])),
            **sliding_window_of(raw),
        }

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> KVCacheSpec:
        """Full attention, or a sliding window on every layer."""
        return uniform_kv_spec(config)

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The same from llama.cpp's `llama.expert_*` keys."""
        return gguf_expert_fields(metadata, prefix)

    def make_layer(self, index: int) -> nn.Module:
        """A Llama block with the sparse MoE as its MLP."""
        return LlamaDecoderLayer(
            self.config, llama_attention(self.config, self.tp), SparseMoeBlock(self.config, self.tp)
        )
