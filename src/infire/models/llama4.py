"""Llama 4 (text): Llama blocks with interleaved RoPE / NoPE attention and a routed MoE.

Most layers use RoPE (interleaved pairs, as Meta's complex rotation) followed by a
weightless RMS norm of q and k, and attend only within their `attention_chunk_size`-
aligned chunk; every `no_rope_layer_interval`-th layer has no position encoding, attends
to the whole context, and scales its queries by a slowly growing function of the
position (temperature tuning). Every `interleave_moe_layer_step`-th layer's MLP is a
mixture of experts: the router's top-k logits, squashed by a sigmoid, scale each chosen
expert's input (not its output), and a shared expert sees every token; the others are a
dense SwiGLU of `intermediate_size_mlp`. Checkpoints store the experts stacked
(`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.layers.kv_spec import AttentionWindow, KVCacheSpec, kv_cache_spec_by_window
from infire.layers.linear import ColumnParallelLinear
from infire.layers.mlp import GatedMLP
from infire.layers.moe import FusedMoE, sigmoid_topk
from infire.layers.norm import rms_normalize
from infire.layers.rotary import RotaryEmbedding
from infire.layers.self_attention import SelfAttention
from infire.models.base import CausalLM, Target
from infire.models.llama import LlamaDecoderLayer
from infire.models.mixtral import MoEConfig, check_expert_split
from infire.parallel import TensorParallelGroup

# What llama.cpp assumes of every Llama 4 GGUF it does not mark as all-global (its
# src/llama-model.cpp): chunks of 8192, every 4th layer NoPE, temperature tuning on.
_GGUF_CHUNK_SIZE = 8192
_GGUF_NO_ROPE_INTERVAL = 4
_GGUF_FLOOR_SCALE = 8192.0
_GGUF_ATTN_SCALE = 0.1
_GGUF_EXPERTS_WITHOUT_QK_NORM = 128  # llama.cpp turns the QK norm off for Maverick (128E)


@dataclass(frozen=True, slots=True)
class Llama4Config(MoEConfig):
    """Llama 4's layer pattern on top of the MoE fields (`moe_intermediate_size` is each
    expert's and the shared expert's size, `intermediate_size_mlp` the dense layers')."""

    intermediate_size_mlp: int = 0
    rope_layers: tuple[int, ...] = ()  # layers with RoPE; the others are NoPE
    chunked_layers: tuple[int, ...] = ()  # layers attending within their chunk only
    attention_chunk_size: int = 0
    use_qk_norm: bool = True  # on the RoPE layers
    attn_temperature_tuning: bool = True  # on the NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        MoEConfig.__post_init__(self)
        if self.chunked_layers and self.attention_chunk_size < 1:
            raise ValueError("chunked attention layers need a positive attention_chunk_size")


@dataclass(frozen=True, slots=True)
class Llama4Positions:
    """What the layers need of a step's positions, computed once per step."""

    cos_sin: torch.Tensor  # [2, T, 1, head_dim], for the RoPE layers
    attn_scales: torch.Tensor | None  # [T, 1, 1] query scales of the NoPE layers


class Llama4Attention(SelfAttention):
    """GQA attention; a RoPE layer rotates q/k and then RMS-normalizes them (no weight), a
    NoPE layer leaves them as they are but for the temperature scale of its queries."""

    def __init__(self, config: Llama4Config, tp: TensorParallelGroup, use_rope: bool) -> None:
        c = config
        super().__init__(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp,
            bias=c.attention_bias, interleaved_rope=True,
        )  # fmt: skip
        self.use_rope = use_rope
        self.qk_norm_eps = c.rms_norm_eps if use_rope and c.use_qk_norm else None
        self.temperature_tuning = not use_rope and c.attn_temperature_tuning

    def transform_qk(self, qk: torch.Tensor, positions: Llama4Positions) -> torch.Tensor:
        """RoPE then the QK norm, or on a NoPE layer the queries' temperature."""
        if self.use_rope:
            qk = self.rotate(qk, positions.cos_sin)
            return qk if self.qk_norm_eps is None else rms_normalize(qk, self.qk_norm_eps)
        if not self.temperature_tuning:
            return qk
        heads = self.num_heads
        q = (qk[:, :heads] * positions.attn_scales).to(qk.dtype)
        return torch.cat((q, qk[:, heads:]), dim=1)


class Llama4MoE(nn.Module):
    """Router (replicated: every rank routes alike), sigmoid top-k scaling of the chosen
    experts' inputs, plus the shared expert on every token."""

    def __init__(self, config: Llama4Config, tp: TensorParallelGroup) -> None:
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.router = ColumnParallelLinear(c.hidden_size, [c.num_experts])
        self.experts = FusedMoE(c.num_experts, c.hidden_size, c.moe_intermediate_size, tp)
        self.shared_expert = GatedMLP(c.hidden_size, c.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = sigmoid_topk(self.router(x), self.top_k)
        routed = self.experts(x, ids, None, input_weights=scores.to(x.dtype))
        return self.shared_expert(x) + routed


class Llama4ForCausalLM(CausalLM):
    """Llama 4 Scout / Maverick (the text model) and its smaller kin."""

    config_class: ClassVar[type[ModelConfig]] = Llama4Config
    checkpoint_renames: ClassVar[dict[str, str]] = {".feed_forward.": ".mlp."}
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "ffn_gate_inp": "feed_forward.router",
        "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
        "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
        "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
    }
    # what a Llama4ForConditionalGeneration checkpoint holds besides the text model
    _MULTIMODAL_PREFIXES = ("vision_model.", "multi_modal_projector.")

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The layer pattern as transformers' Llama4TextConfig derives it (its defaults
        where config.json leaves a field out)."""
        layers = raw["num_hidden_layers"]
        interval = raw.get("no_rope_layer_interval", 4)
        rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        step = raw.get("interleave_moe_layer_step", 1)
        moe = raw.get("moe_layers")
        chunk = raw.get("attention_chunk_size", 8192)
        types = raw.get("layer_types") or [
            "chunked_attention" if uses_rope and chunk is not None else "full_attention"
            for uses_rope in rope[:layers]
        ]
        if len(rope) < layers or len(types) < layers:
            raise ModelLoadError(
                f"no_rope_layers ({len(rope)}) and layer_types ({len(types)}) need an entry "
                f"for each of the {layers} layers"
            )
        return {
            "num_experts": raw.get("num_local_experts", 16),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 1),
            "moe_intermediate_size": raw["intermediate_size"],
            "norm_topk_prob": False,
            "sparse_layers": tuple(moe if moe is not None else range(step - 1, layers, step)),
            "intermediate_size_mlp": raw.get("intermediate_size_mlp", 16384),
            "rope_layers": tuple(i for i in range(layers) if rope[i]),
            "chunked_layers": tuple(i for i in range(layers) if types[i] == "chunked_attention"),
            "attention_chunk_size": chunk or 0,
            "use_qk_norm": raw.get("use_qk_norm", True),
            "attn_temperature_tuning": raw.get("attn_temperature_tuning", True),
            "floor_scale": float(raw.get("floor_scale", 8192)),
            "attn_scale": float(raw.get("attn_scale", 0.1)),
        }

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """From llama.cpp's `llama4.*` keys, with the constants llama.cpp assumes (an
        `attention.sliding_window` of 0 marks a model with neither chunks nor NoPE)."""
        layers = int(metadata[f"{prefix}.block_count"])
        step = int(metadata[f"{prefix}.interleave_moe_layer_step"])
        experts = int(metadata[f"{prefix}.expert_count"])
        local = metadata.get(f"{prefix}.attention.sliding_window") != 0
        interval = _GGUF_NO_ROPE_INTERVAL if local else layers + 1
        rope = tuple(i for i in range(layers) if (i + 1) % interval != 0)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(metadata[f"{prefix}.expert_used_count"]),
            "moe_intermediate_size": int(metadata[f"{prefix}.expert_feed_forward_length"]),
            "norm_topk_prob": False,
            "sparse_layers": tuple(range(step - 1, layers, step)) if step > 0 else (),
            "intermediate_size_mlp": int(metadata[f"{prefix}.feed_forward_length"]),
            "rope_layers": rope,
            "chunked_layers": rope if local else (),
            "attention_chunk_size": _GGUF_CHUNK_SIZE if local else 0,
            "use_qk_norm": experts != _GGUF_EXPERTS_WITHOUT_QK_NORM,
            "attn_temperature_tuning": True,  # only NoPE layers use it
            "floor_scale": _GGUF_FLOOR_SCALE,
            "attn_scale": _GGUF_ATTN_SCALE,
        }

    @classmethod
    def kv_cache_spec(cls, config: Llama4Config) -> KVCacheSpec:
        """Chunked layers in a windowed group whose earlier chunks' blocks are freed, the
        global (NoPE) layers in group 0. A chunk no shorter than the context never cuts
        anything: those layers are full attention."""
        c = config
        chunk = AttentionWindow("chunked", c.attention_chunk_size) if c.chunked_layers else None
        if chunk is not None and c.attention_chunk_size >= c.max_position_embeddings:
            chunk = None
        windows = [chunk if i in c.chunked_layers else None for i in range(c.num_hidden_layers)]
        per_layer = 2 * c.num_key_value_heads * c.head_dim
        return kv_cache_spec_by_window(windows, [per_layer] * c.num_hidden_layers)

    @classmethod
    def check_parallel(cls, config: Llama4Config, tp_size: int) -> None:
        """Heads as for Llama; the experts' and the dense MLP's features split evenly."""
        super().check_parallel(config, tp_size)
        check_expert_split(config, tp_size)
        dense = len(config.sparse_layers) < config.num_hidden_layers
        if dense and config.intermediate_size_mlp % tp_size:
            raise ModelLoadError(
                f"cannot split this model over tensor_parallel_size {tp_size}: "
                f"intermediate_size_mlp {config.intermediate_size_mlp} is not divisible by it"
            )

    def make_rotary(self) -> nn.Module:
        """Interleaved RoPE (Meta's complex rotation), with Llama 3 scaling if configured."""
        c = self.config
        return RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, interleaved=True
        )

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Llama4Positions:
        """RoPE cos/sin and, for the NoPE layers, 1 + attn_scale * log(1 + floor((p + 1) /
        floor_scale)) per position p."""
        c = self.config
        scales = None
        if c.attn_temperature_tuning and len(c.rope_layers) < c.num_hidden_layers:
            buckets = torch.floor((positions.float() + 1.0) / c.floor_scale)
            scales = (torch.log1p(buckets) * c.attn_scale + 1.0).view(-1, 1, 1)
        return Llama4Positions(self.rotary.cos_sin(positions, dtype), scales)

    def make_layer(self, index: int) -> nn.Module:
        """Attention with or without RoPE; the MoE or the dense MLP."""
        c = self.config
        attention = Llama4Attention(c, self.tp, index in c.rope_layers)
        if index in c.sparse_layers:
            mlp: nn.Module = Llama4MoE(c, self.tp)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size_mlp, self.tp)
        return LlamaDecoderLayer(c, attention, mlp)

    def _resolve(self, hf_name: str) -> Target | None:
        """Also the text model's tensors of a Llama4ForConditionalGeneration checkpoint
        (under `language_model.`); its vision tower and projector are not ours."""
        if hf_name.startswith(self._MULTIMODAL_PREFIXES):
            return None
        return super()._resolve(hf_name.removeprefix("language_model."))
