"""Qwen3: the Llama block with an RMSNorm over each q and k head before RoPE (QK norm).

No q/k/v biases (Qwen2 had them); head_dim is given by the config, not hidden / heads.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

from torch import nn

from infire.layers.mlp import GatedMLP
from infire.layers.norm import RMSNorm
from infire.layers.self_attention import SelfAttention
from infire.models.base import CausalLM
from infire.models.llama import LlamaDecoderLayer, sliding_window_of


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense models."""

    supports_fused_cpu: ClassVar[bool] = True  # the fused forward norms q and k heads too

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Nothing beyond the common fields (a windowed config is refused)."""
        return sliding_window_of(raw)

    def make_attention(self) -> SelfAttention:
        """GQA attention with per-head RMSNorm on q and k."""
        c = self.config
        return SelfAttention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.tp,
            bias=c.attention_bias, qk_norm=partial(RMSNorm, eps=c.rms_norm_eps),
        )  # fmt: skip

    def make_layer(self, index: int) -> nn.Module:
        """One Qwen3 block."""
        c = self.config
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.tp)
        return LlamaDecoderLayer(c, self.make_attention(), mlp)
