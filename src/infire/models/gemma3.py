"""Gemma 3 (text): local sliding-window layers interleaved with global ones, each kind with
its own RoPE, in a block with four norms.

Reads like transformers' Gemma3ForCausalLM: the embedding times sqrt(hidden_size) (rounded
to the model's dtype), then N x [norm, GQA attention with per-head q/k norms and scale
query_pre_attn_scalar^-0.5, norm, residual; norm, GeGLU MLP, norm, residual], the final
norm and the (tied) LM head, its logits optionally soft-capped. Every norm is Gemma's
x / rms(x) * (1 + weight). `layer_types` says which layers are "sliding_attention" (the
last `sliding_window` positions, RoPE base 10k) and which "full_attention" (RoPE base 1M,
linearly scaled in the 4B-27B models); the sliding layers form a windowed KV group whose
blocks are freed as they fall out of the window. GGUF files (llama.cpp's "gemma3") store
every norm weight plus one and give the layer pattern by llama.cpp's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from infire.config import ModelConfig, RopeScaling
from infire.errors import UnsupportedModelError
from infire.layers.attention import AttentionMetadata
from infire.layers.kv_spec import AttentionWindow, KVCacheSpec, kv_cache_spec_by_window
from infire.layers.mlp import GatedMLP, activation_of
from infire.layers.norm import GemmaRMSNorm
from infire.layers.rotary import RotaryEmbedding
from infire.layers.self_attention import SelfAttention
from infire.models.base import CausalLM, Target
from infire.models.checkpoint import rope_scaling_from

SLIDING, FULL = "sliding_attention", "full_attention"
_ROPE_INDEX = {FULL: 0, SLIDING: 1}  # position_inputs: (global cos/sin, local cos/sin)
# Gemma3ForConditionalGeneration checkpoints: the vision half, which a text model skips
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# llama.cpp's 27B (the one whose query_pre_attn_scalar is not head_dim) has 62 layers
_LLAMA_CPP_27B_LAYERS = 62


@dataclass(frozen=True, slots=True)
class Gemma3Config(ModelConfig):
    """Gemma 3's hyper-parameters beyond ModelConfig's. Its rope_theta / rope_scaling are
    the global layers' (`global_rope_*`, copied there: a transformers 5 config.json keeps
    them per layer type, where the common parser does not look), and tie_word_embeddings
    is `hf_tie_word_embeddings` where given (Gemma ties unless config.json says not to;
    the common parser's default is untied)."""

    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" or "full_attention"
    sliding_window: int = 4096  # a sliding layer's query sees this many positions, itself included
    global_rope_theta: float = 1_000_000.0
    global_rope_scaling: RopeScaling | None = None
    local_rope_theta: float = 10_000.0
    local_rope_scaling: RopeScaling | None = None
    query_pre_attn_scalar: float = 256.0  # attention scale: its inverse square root
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    hidden_activation: str = "gelu_tanh"
    hf_tie_word_embeddings: bool | None = None

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} (known: {SLIDING}, {FULL})")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be positive")
        # frozen: the common fields are set the one way a dataclass allows after __init__
        object.__setattr__(self, "rope_theta", self.global_rope_theta)
        object.__setattr__(self, "rope_scaling", self.global_rope_scaling)
        if self.hf_tie_word_embeddings is not None:
            object.__setattr__(self, "tie_word_embeddings", self.hf_tie_word_embeddings)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-normed block: h + norm(attn(norm(h))), then h + norm(mlp(norm(h)))."""

    def __init__(self, config: Gemma3Config, self_attn: SelfAttention, mlp: GatedMLP, kind: str):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.rope_index = _ROPE_INDEX[kind]
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        position_inputs: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cos_sin = position_inputs[self.rope_index]
        attn = self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text models (270M, 1B, and the language model of 4B-27B)."""

    # Gemma3TextConfig's defaults: the 4B-27B checkpoints' config.json leave these out
    hf_config_defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "rope_theta": 1_000_000.0, "bos_token_id": 2, "eos_token_id": 1,
    }  # fmt: skip

    config_class: ClassVar[type[ModelConfig]] = Gemma3Config
    # Gemma3ForConditionalGeneration's language model: language_model.model.* in its
    # checkpoints (the Hub's and transformers' save_pretrained), model.language_model.*
    # as transformers names it in memory
    checkpoint_renames: ClassVar[dict[str, str]] = {
        "language_model.model.": "",
        "language_model.": "",
    }
    # llama.cpp's names for the norms Gemma adds (its ffn_norm is the pre-MLP norm)
    gguf_tensor_names: ClassVar[dict[str, str]] = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    # --- config ------------------------------------------------------------------------

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Layer types, window, both RoPEs, attention scale and soft-capping of a
        config.json (Gemma3ForConditionalGeneration's: of its text_config)."""
        text = raw.get("text_config") or raw
        if text.get("attn_logit_softcapping"):
            raise UnsupportedModelError(
                "Gemma 3 with attn_logit_softcapping is not supported (paged attention "
                "cannot soft-cap scores; no released Gemma 3 sets it)"
            )
        if text.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "use_bidirectional_attention (EmbeddingGemma) is not supported: infire "
                "serves causal language models"
            )
        layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types") or _every_nth_global(
            layers, text.get("sliding_window_pattern", 6)
        )
        return {
            "layer_types": tuple(layer_types),
            "sliding_window": text.get("sliding_window") or 0,
            **_hf_rope(text),
            "query_pre_attn_scalar": float(text.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": text.get("final_logit_softcapping") or None,
            "hidden_activation": activation_of(text.get("hidden_activation", "gelu_pytorch_tanh")),
            "hf_tie_word_embeddings": text.get(
                "tie_word_embeddings", raw.get("tie_word_embeddings", True)
            ),
        }

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The same from llama.cpp's gemma3 keys, read as llama.cpp reads them."""
        if metadata.get(f"{prefix}.attn_logit_softcapping"):
            raise UnsupportedModelError("Gemma 3 with attn_logit_softcapping is not supported")
        layers = int(metadata[f"{prefix}.block_count"])
        window = int(metadata.get(f"{prefix}.attention.sliding_window") or 0)
        hidden = int(metadata[f"{prefix}.embedding_length"])
        heads = _first(metadata[f"{prefix}.attention.head_count"])
        head_dim = int(metadata.get(f"{prefix}.attention.key_length") or hidden // heads)
        # llama.cpp scales scores by head_dim^-0.5 but for the 27B, by (hidden / heads)^-0.5
        scalar = hidden // heads if layers == _LLAMA_CPP_27B_LAYERS else head_dim
        kind = metadata.get(f"{prefix}.rope.scaling.type")
        factor = float(metadata.get(f"{prefix}.rope.scaling.factor") or 1.0)
        linear = kind == "linear" and factor != 1.0
        return {
            "layer_types": _gguf_layer_types(metadata, prefix, layers, window),
            "sliding_window": window,
            "global_rope_theta": float(metadata.get(f"{prefix}.rope.freq_base", 10_000.0)),
            "global_rope_scaling": RopeScaling(factor, kind="linear") if linear else None,
            # llama.cpp runs the local layers at base 10k, unscaled
            "local_rope_theta": float(metadata.get(f"{prefix}.rope.freq_base_swa", 10_000.0)),
            "local_rope_scaling": None,
            "query_pre_attn_scalar": float(scalar),
            "final_logit_softcapping": metadata.get(f"{prefix}.final_logit_softcapping") or None,
            "hidden_activation": "gelu_tanh",
        }

    @classmethod
    def gguf_tensor_transform(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp's converter stores every Gemma norm weight plus one: take it off."""
        return tensor - 1 if hf_name.endswith("norm.weight") else tensor

    @classmethod
    def kv_cache_spec(cls, config: Gemma3Config) -> KVCacheSpec:
        """The global layers in group 0, the sliding ones in a window of `sliding_window`."""
        windows = [
            AttentionWindow("sliding", config.sliding_window) if kind == SLIDING else None
            for kind in config.layer_types
        ]
        per_layer = 2 * config.num_key_value_heads * config.head_dim
        return kv_cache_spec_by_window(windows, [per_layer] * config.num_hidden_layers)

    # --- the model ---------------------------------------------------------------------

    def make_rotary(self) -> nn.Module:
        """The global layers' RoPE table and the local layers' (in _ROPE_INDEX order)."""
        c = self.config
        tables = (
            (c.global_rope_theta, c.global_rope_scaling),
            (c.local_rope_theta, c.local_rope_scaling),
        )
        return nn.ModuleList(
            RotaryEmbedding(c.head_dim, c.max_position_embeddings, theta, scaling)
            for theta, scaling in tables
        )

    def position_inputs(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both RoPEs' cos/sin for this step; each layer takes its kind's."""
        return tuple(rotary.cos_sin(positions, dtype) for rotary in self.rotary)

    def make_norm(self, size: int) -> nn.Module:
        """Gemma's (1 + weight) RMS norm."""
        return GemmaRMSNorm(size, self.config.rms_norm_eps)

    def make_layer(self, index: int) -> nn.Module:
        """One Gemma 3 block, local or global as layer_types says."""
        c = self.config
        attention = SelfAttention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.tp,
            bias=c.attention_bias, qk_norm=partial(GemmaRMSNorm, eps=c.rms_norm_eps),
            scale=c.query_pre_attn_scalar**-0.5,
        )  # fmt: skip
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.tp, c.hidden_activation)
        return Gemma3DecoderLayer(c, attention, mlp, c.layer_types[index])

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows times sqrt(hidden_size), that factor rounded to their dtype
        first as transformers does (33.94 is 34.0 in bfloat16)."""
        hidden = self.embed_tokens(token_ids)
        scale = torch.tensor(self.config.hidden_size**0.5).to(hidden.dtype).item()
        return hidden * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in float32, soft-capped where the config says."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _resolve(self, hf_name: str) -> Target | None:
        # a multimodal checkpoint: its vision tower is not ours, its head is the usual one
        if hf_name.removeprefix("model.").startswith(_VISION_PREFIXES):
            return None
        return super()._resolve(hf_name.replace("language_model.lm_head.", "lm_head."))


def _every_nth_global(layers: int, pattern: int) -> list[str]:
    """transformers' layer types of a config without them: every pattern-th layer global."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


def _hf_rope(text: dict[str, Any]) -> dict[str, Any]:
    """Both RoPEs of a config: transformers 5 keys rope_parameters by layer type; older
    configs have rope_theta / rope_scaling (global) and rope_local_base_freq."""
    params = text.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full = {"rope_theta": text.get("rope_theta", 1_000_000.0)}
        full |= text.get("rope_scaling") or params
        local = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
    return {
        "global_rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "global_rope_scaling": rope_scaling_from(full, "config.json full_attention"),
        "local_rope_theta": float(local.get("rope_theta", 10_000.0)),
        "local_rope_scaling": rope_scaling_from(local, "config.json sliding_attention"),
    }


def _gguf_layer_types(
    metadata: dict[str, Any], prefix: str, layers: int, window: int
) -> tuple[str, ...]:
    """llama.cpp's rule: no window, no local layers; else every 6th layer is global
    (layer i is local when i % 6 < 5), unless the file lists the local layers."""
    if not window:
        return (FULL,) * layers
    pattern = metadata.get(f"{prefix}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        return tuple(SLIDING if local else FULL for local in pattern)
    return tuple(_every_nth_global(layers, 6))


def _first(value: Any) -> int:
    """A per-layer GGUF array's first value (Gemma 3's are uniform), or the scalar."""
    return int(value[0] if isinstance(value, list) else value)
