"""Qwen3-MoE: Qwen3's attention (QK norm) with a sparse MoE MLP on the sparse layers.

A layer is sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th
(1: all). The router's softmax top-k weights are renormalized when `norm_topk_prob`
(true in every released model, and what llama.cpp assumes).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from infire.config import ModelConfig
from infire.layers.mlp import GatedMLP
from infire.models.llama import LlamaDecoderLayer
from infire.models.mixtral import MoEConfig, SparseMoeBlock, SplitsExperts, gguf_expert_fields
from infire.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(SplitsExperts, Qwen3ForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their kin."""

    config_class: ClassVar[type[ModelConfig]] = MoEConfig

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Expert counts and which layers are sparse."""
        super().hf_config_fields(raw)  # refuses what Qwen3 refuses
        step = raw.get("decoder_sparse_step", 1) or 1
        dense = set(raw.get("mlp_only_layers") or [])
        layers = range(raw["num_hidden_layers"])
        return {
            "num_experts": raw.get("num_experts") or raw["num_local_experts"],
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["moe_intermediate_size"],
            "norm_topk_prob": raw.get("norm_topk_prob", True),
            "sparse_layers": tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
        }

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """From llama.cpp's `qwen3moe.expert_*` keys (every layer sparse, as it assumes)."""
        size = int(metadata[f"{prefix}.expert_feed_forward_length"])
        return gguf_expert_fields(metadata, prefix) | {"moe_intermediate_size": size}

    def make_layer(self, index: int) -> nn.Module:
        """Qwen3 attention with the MoE (or, on a dense layer, a plain MLP)."""
        c = self.config
        if index in c.sparse_layers:
            mlp: nn.Module = SparseMoeBlock(c, self.tp)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.tp)
        return LlamaDecoderLayer(c, self.make_attention(), mlp)
