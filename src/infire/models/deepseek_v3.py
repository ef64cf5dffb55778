"""DeepSeek-V3 and Kimi K2: multi-head latent attention (MLA) and a MoE with shared experts.

MLA compresses each token's keys and values into one latent (`kv_lora_rank` features,
RMS-normed) plus a small RoPE key (`qk_rope_head_dim`) shared by every head; the paged
cache holds only [latent | rope key] per token and layer. Attention runs on the latent
itself ("absorbed" weights): kv_b_proj's per-head key part W_UK is folded into the query
(q_nope W_UK), so every head attends MQA-style to the one cached key, the values are the
latent, and each head's output is projected by its value part W_UV before o_proj. Queries
come from q_proj or, in the released models, a low-rank q_a_proj -> norm -> q_b_proj.
The first `first_k_dense_replace` layers have a dense MLP; the others route each token
(sigmoid scores plus a per-expert bias, top-k within the best groups, float32 as in
transformers) to `num_experts_per_tok` of `n_routed_experts` experts and add the shared
experts' output. Tensor parallelism splits heads and intermediate features; the latent is
computed and cached in full on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infire.config import ModelConfig
from infire.errors import UnsupportedModelError
from infire.layers.attention import AttentionMetadata, PagedAttention
from infire.layers.kv_spec import KVCacheSpec, KVGroupSpec
from infire.layers.linear import ColumnParallelLinear, RowParallelLinear
from infire.layers.mlp import GatedMLP, activation_of
from infire.layers.moe import ALL_SHARDS, FusedMoE, expect_shape, grouped_topk
from infire.layers.norm import RMSNorm
from infire.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_interleaved,
    yarn_mscale,
)
from infire.models.base import CausalLM, Target
from infire.models.llama import LlamaDecoderLayer
from infire.models.mixtral import MoEConfig, check_expert_split
from infire.parallel import SINGLE, TensorParallelGroup, check_parallel

if TYPE_CHECKING:
    from infire.models.weights import LazyTensor

# transformers builds the q_a and kv_a norms with DeepseekV3RMSNorm's default eps, not
# rms_norm_eps
LATENT_NORM_EPS = 1e-6
# llama.cpp's expert_gating_func for sigmoid scores (1 is DeepSeek-V2's softmax)
_GGUF_SIGMOID_GATING = 2
# kv_b_proj's loads: the whole [H * (nope + v), C] weight, or llama.cpp's split halves
_LATENT_PARTS = {"kv_b_proj": ALL_SHARDS, "k_b_proj": 0, "v_b_proj": 1}
_LAYER_INDEX = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class DeepseekV3Config(MoEConfig):
    """MLA dimensions and DeepSeek's routing on top of the MoE fields. ModelConfig's
    head_dim and num_key_value_heads are the checkpoint's and unused: MLA heads are
    qk_nope_head_dim + qk_rope_head_dim wide and share one latent key."""

    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = True  # RoPE on adjacent pairs (transformers' rope_interleave)

    def __post_init__(self) -> None:
        MoEConfig.__post_init__(self)
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"{self.num_experts} experts in n_group {self.n_group} groups, topk_group "
                f"{self.topk_group}: the groups must split the experts evenly"
            )


def softmax_scale(config: DeepseekV3Config) -> float:
    """1 / sqrt(qk head dim), times YaRN's mscale(mscale_all_dim) squared (transformers'
    yarn_apply_mscale: MLA scales the non-rotary dimensions too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        mscale = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale *= mscale * mscale
    return scale


class LatentProjection(nn.Module):
    """kv_b_proj of this rank's heads, [H, qk_nope + v, C]: per head the key part W_UK
    [qk_nope, C] then the value part W_UV [v, C], applied in latent space."""

    def __init__(
        self,
        num_heads: int,
        nope_dim: int,
        value_dim: int,
        latent_dim: int,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.full_heads = num_heads
        self.first_head, self.num_heads = tp.shard(num_heads, "num_attention_heads")
        self.nope_dim, self.value_dim, self.latent_dim = nope_dim, value_dim, latent_dim
        self.weight = nn.Parameter(
            torch.empty(self.num_heads, nope_dim + value_dim, latent_dim), requires_grad=False
        )

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope] queries -> [T, H, C]: q_nope . (W_UK latent) = (q_nope W_UK) . latent."""
        w_uk = self.weight[:, : self.nope_dim]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[T, H, C] attention outputs over the latent -> [T, H, v] per-head values."""
        w_uv = self.weight[:, self.nope_dim :]
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def shard_count(self, name: str) -> int:
        """Two loads: the key and value halves (one kv_b_proj tensor sets both at once)."""
        return 2

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """This rank's heads of kv_b_proj [H * (nope + v), C] (ALL_SHARDS), or of llama.cpp's
        halves: k_b [H, C, nope] (shard 0, transposed per head) and v_b [H, v, C] (shard 1)."""
        if name != "weight":
            raise KeyError(f"kv_b_proj has no {name}")
        heads, nope, value, latent = self.full_heads, self.nope_dim, self.value_dim, self.latent_dim
        first, count = self.first_head, self.num_heads
        if shard_index == ALL_SHARDS:
            expect_shape(loaded, (heads * (nope + value), latent))
            rows = nope + value
            loaded.read_into(self.weight.data.view(-1, latent), 0, first * rows, count * rows)
        elif shard_index == 0:
            expect_shape(loaded, (heads, latent, nope))
            self.weight.data[:, :nope] = loaded.read(0, first, count).transpose(1, 2)
        else:
            expect_shape(loaded, (heads, value, latent))
            loaded.read_into(self.weight.data[:, nope:], 0, first, count)


class MultiHeadLatentAttention(nn.Module):
    """MLA over the paged cache of [latent | rope key], with absorbed kv_b_proj weights."""

    def __init__(self, config: DeepseekV3Config, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        c = config
        heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.latent_dim = (
            c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank,
        )  # fmt: skip
        qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.low_rank_query = c.q_lora_rank is not None
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, [heads * qk_head_dim], tp=tp)
        else:  # the low-rank query is replicated: every rank needs all of it
            self.q_a_proj = ColumnParallelLinear(c.hidden_size, [c.q_lora_rank], c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, [heads * qk_head_dim], tp=tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            c.hidden_size, [c.kv_lora_rank + c.qk_rope_head_dim], c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(
            heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, tp
        )
        self.o_proj = RowParallelLinear(heads * c.v_head_dim, c.hidden_size, c.attention_bias, tp)
        self.num_heads = self.kv_b_proj.num_heads  # this rank's
        self.qk_head_dim = qk_head_dim
        self.attn = PagedAttention(
            self.num_heads, 1, c.kv_lora_rank + c.qk_rope_head_dim, softmax_scale(c),
            latent_values=c.kv_lora_rank,
        )  # fmt: skip
        self.rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            apply_rotary_interleaved if c.rope_interleave else apply_rotary
        )

    def forward(
        self,
        cos_sin: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self._query(hidden).view(tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [self.latent_dim, self.rope_dim], dim=-1
        )
        key = torch.cat(
            (self.kv_a_layernorm(latent), self.rotate(k_rope.unsqueeze(1), cos_sin)[:, 0]), -1
        ).unsqueeze(1)  # [T, 1, C + R]: what the cache keeps
        query = torch.cat(
            (self.kv_b_proj.absorb_query(q_nope), self.rotate(q_rope, cos_sin)), dim=-1
        )
        out = self.attn(query, key, None, kv_cache, meta).view(tokens, self.num_heads, -1)
        return self.o_proj(self.kv_b_proj.expand_values(out).reshape(tokens, -1))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.low_rank_query:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return self.q_proj(hidden)


class TopkRouter(nn.Module):
    """Replicated router in float32 (transformers keeps gate.weight and the bias float32
    whatever the model's dtype): sigmoid scores, group-limited biased top-k."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        c = config
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.renormalize, self.scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        experts = c.num_experts
        self.weight = nn.Parameter(
            torch.empty(experts, c.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight)
        return grouped_topk(
            logits, self.top_k, self.e_score_correction_bias, self.n_group, self.topk_group,
            self.renormalize, self.scaling_factor,
        )  # fmt: skip

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> TopkRouter:
        # .to(dtype) of the whole model moves the router but leaves it float32
        super()._apply(fn, recurse)
        for param in self._parameters.values():
            if param is not None and param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """The whole router (every rank routes the same way)."""
        if name not in ("weight", "e_score_correction_bias"):
            raise KeyError(f"the router has no {name}")
        param = self.weight if name == "weight" else self.e_score_correction_bias
        expect_shape(loaded, tuple(param.shape))
        loaded.read_into(param.data)


class DeepseekV3MoE(nn.Module):
    """Routed experts (FusedMoE) plus the shared experts, one gated MLP of
    moe_intermediate_size * n_shared_experts features."""

    def __init__(self, config: DeepseekV3Config, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        c = config
        self.gate = TopkRouter(c)
        self.experts = FusedMoE(c.num_experts, c.hidden_size, c.moe_intermediate_size, tp)
        self.shared_experts = (
            GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, tp)
            if c.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / R1 and Kimi K2 (DeepseekV3ForCausalLM checkpoints, llama.cpp's deepseek2)."""

    config_class: ClassVar[type[ModelConfig]] = DeepseekV3Config
    checkpoint_renames: ClassVar[dict[str, str]] = {
        # a parameter named like a module's; llama.cpp spells it so too (exp_probs_b.bias)
        ".gate.e_score_correction_bias": ".gate.e_score_correction.bias",
    }
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",  # converters before the MLA split
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        "exp_probs_b": "mlp.gate.e_score_correction",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    }

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """MLA dimensions and routing, with transformers' defaults for what is absent."""
        if activation_of(raw.get("hidden_act", "silu")) != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} (DeepSeek-V3 uses silu)")
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModelError(
                f"scoring_func {raw['scoring_func']!r}: only sigmoid is supported"
            )
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise UnsupportedModelError(
                f"quantized checkpoint ({method}, as DeepSeek-V3's and Kimi K2's FP8 releases "
                "are) is not supported: use a bfloat16 conversion or a GGUF file"
            )
        if raw.get("moe_layer_freq", 1) != 1:
            raise UnsupportedModelError(
                f"moe_layer_freq {raw['moe_layer_freq']} (transformers runs every layer "
                "after first_k_dense_replace as MoE)"
            )
        dense = raw.get("first_k_dense_replace", 3) or 0
        return {
            "num_experts": raw.get("n_routed_experts", 256),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 8),
            "moe_intermediate_size": raw.get("moe_intermediate_size", 2048),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "sparse_layers": tuple(range(dense, raw["num_hidden_layers"])),
            "q_lora_rank": raw.get("q_lora_rank", 1536),
            "kv_lora_rank": raw.get("kv_lora_rank", 512),
            "qk_nope_head_dim": raw.get("qk_nope_head_dim", 128),
            "qk_rope_head_dim": raw.get("qk_rope_head_dim", 64),
            "v_head_dim": raw.get("v_head_dim", 128),
            "n_shared_experts": raw.get("n_shared_experts", 1) or 0,
            "n_group": raw.get("n_group", 8) or 1,
            "topk_group": raw.get("topk_group", 4) or 1,
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 2.5)),
            "rope_interleave": bool(raw.get("rope_interleave", True)),
        }

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The same from llama.cpp's deepseek2 keys, written before or after its converter
        split kv_b (key_length_mla / value_length_mla then hold the per-head sizes)."""
        p = prefix
        # llama.cpp reads a file without the key as DeepSeek-V2's softmax routing
        gating = metadata.get(f"{p}.expert_gating_func")
        if gating != _GGUF_SIGMOID_GATING:
            raise UnsupportedModelError(
                f"{p}.expert_gating_func {gating}: only DeepSeek-V3's sigmoid routing (2) is "
                "supported, not DeepSeek-V2's softmax"
            )
        rope = int(metadata[f"{p}.rope.dimension_count"])
        key = metadata.get(f"{p}.attention.key_length_mla") or metadata[f"{p}.attention.key_length"]
        value = (
            metadata.get(f"{p}.attention.value_length_mla")
            or metadata[f"{p}.attention.value_length"]
        )
        q_lora = metadata.get(f"{p}.attention.q_lora_rank")
        dense = int(metadata.get(f"{p}.leading_dense_block_count", 0))
        return {
            "num_experts": int(metadata[f"{p}.expert_count"]),
            "num_experts_per_tok": int(metadata[f"{p}.expert_used_count"]),
            "moe_intermediate_size": int(metadata[f"{p}.expert_feed_forward_length"]),
            "norm_topk_prob": bool(metadata.get(f"{p}.expert_weights_norm", False)),
            "sparse_layers": tuple(range(dense, int(metadata[f"{p}.block_count"]))),
            "q_lora_rank": None if q_lora is None else int(q_lora),
            "kv_lora_rank": int(metadata[f"{p}.attention.kv_lora_rank"]),
            "qk_nope_head_dim": int(key) - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": int(value),
            "n_shared_experts": int(metadata.get(f"{p}.expert_shared_count", 0)),
            "n_group": int(metadata.get(f"{p}.expert_group_count", 1)),
            "topk_group": int(metadata.get(f"{p}.expert_group_used_count", 1)),
            "routed_scaling_factor": float(metadata.get(f"{p}.expert_weights_scale", 1.0)),
            "rope_interleave": True,  # llama.cpp rotates deepseek2's adjacent pairs
        }

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> KVCacheSpec:
        """One full-attention group; a token costs [latent | rope key] per layer."""
        assert isinstance(config, DeepseekV3Config)
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
        layers = tuple(range(config.num_hidden_layers))
        return KVCacheSpec((KVGroupSpec(layers, per_layer * len(layers)),))

    @classmethod
    def check_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        """Heads, the dense MLP and every expert's features must split over tp_size."""
        check_parallel(config, tp_size, 1)
        assert isinstance(config, DeepseekV3Config)
        if config.sparse_layers:  # the shared experts' size is a multiple of the experts'
            check_expert_split(config, tp_size)

    def make_rotary(self) -> nn.Module:
        """RoPE tables of the rope part of the heads (qk_rope_head_dim), YaRN-scaled in the
        released models."""
        c = self.config
        return RotaryEmbedding(
            c.qk_rope_head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
            interleaved=c.rope_interleave,
        )  # fmt: skip

    def make_layer(self, index: int) -> nn.Module:
        """MLA with a dense MLP (the first layers) or the MoE."""
        c = self.config
        if index in c.sparse_layers:
            mlp: nn.Module = DeepseekV3MoE(c, self.tp)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.tp)
        return LlamaDecoderLayer(c, MultiHeadLatentAttention(c, self.tp), mlp)

    def resolve_in_layer(self, parent: str, leaf: str, param: str) -> Target | None:
        """kv_b_proj (or its llama.cpp halves) into the latent projection; q_proj is not
        merged with k/v here; the router's bias is a parameter of the gate."""
        if leaf in _LATENT_PARTS:
            return (f"{parent}.kv_b_proj", param, _LATENT_PARTS[leaf])
        if leaf == "q_proj":
            return (f"{parent}.q_proj", param, 0)
        if leaf == "e_score_correction":
            return (parent, "e_score_correction_bias", 0)
        return super().resolve_in_layer(parent, leaf, param)

    def _resolve(self, hf_name: str) -> Target | None:
        # Layers past num_hidden_layers are multi-token prediction modules (DeepSeek-V3's
        # layer 61), which transformers ignores too.
        match = _LAYER_INDEX.match(hf_name)
        if match is not None and int(match.group(1)) >= self.config.num_hidden_layers:
            return None
        return super()._resolve(hf_name)
