"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat varlen batch.

Reads like the architecture: embed -> N x [RMSNorm, GQA attention with RoPE, residual,
RMSNorm, SwiGLU MLP, residual] -> RMSNorm -> LM head. Qwen2 differs only by q/k/v biases.
Qwen3, Mixtral and Qwen3-MoE reuse this block with their own attention and MLP parts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from infire.config import ModelConfig
from infire.errors import UnsupportedModelError
from infire.layers.attention import AttentionMetadata
from infire.layers.kv_spec import AttentionWindow, KVCacheSpec, kv_cache_spec_by_window
from infire.layers.mlp import GatedMLP
from infire.layers.norm import RMSNorm
from infire.layers.self_attention import SelfAttention
from infire.models.base import CausalLM
from infire.parallel import TensorParallelGroup


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: Any,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def llama_attention(config: ModelConfig, tp: TensorParallelGroup) -> SelfAttention:
    """Llama's GQA attention (q/k/v biases where the config has them)."""
    c = config
    return SelfAttention(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp,
        bias=c.attention_bias,
    )  # fmt: skip


def sliding_window_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The `sliding_window` field of a config.json: Mistral's and Mixtral's apply to every
    layer; Qwen's apply only where `use_sliding_window` (refused: released models keep it
    off)."""
    if raw.get("model_type") in ("mistral", "mixtral"):
        return {"sliding_window": raw.get("sliding_window")}
    if raw.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window (Qwen's windowed layers) is not supported")
    return {}


def uniform_kv_spec(config: ModelConfig) -> KVCacheSpec:
    """Every layer's K and V of num_key_value_heads x head_dim, windowed where the config
    gives every layer a sliding window."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim
    size = config.sliding_window
    # a window as long as the context cuts nothing: full attention (and the fused forward)
    cuts = size is not None and 0 < size < config.max_position_embeddings
    window = AttentionWindow("sliding", size) if cuts else None
    layers = config.num_hidden_layers
    return kv_cache_spec_by_window([window] * layers, [per_layer] * layers)


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2."""

    supports_fused_cpu: ClassVar[bool] = True  # where no sliding window applies

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Mistral's sliding window."""
        return sliding_window_of(raw)

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> KVCacheSpec:
        """Full attention, or Mistral's sliding window on every layer."""
        return uniform_kv_spec(config)

    def make_layer(self, index: int) -> nn.Module:
        """One Llama block."""
        c = self.config
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.tp)
        return LlamaDecoderLayer(c, llama_attention(c, self.tp), mlp)
