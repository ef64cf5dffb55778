"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat varlen batch.

Reads like the architecture: embed -> N x [RMSNorm, GQA attention with RoPE, residual,
RMSNorm, SwiGLU MLP, residual] -> RMSNorm -> LM head. Qwen2 differs only by q/k/v biases.
q/k/v and gate/up are merged into one matmul each; every linear layer is tensor-parallel
ready. Weights load from Hugging Face names (the GGUF loader maps to those too).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.layers.attention import AttentionMetadata, PagedAttention
from infire.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from infire.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from infire.layers.norm import RMSNorm
from infire.layers.rotary import RotaryEmbedding, apply_rotary
from infire.parallel import SINGLE, TensorParallelGroup


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE over the paged KV cache."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(config.num_key_value_heads, "num_key_value_heads")[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_full = config.num_attention_heads * self.head_dim
        kv_full = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_full, kv_full, kv_full], bias=config.attention_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(q_full, config.hidden_size, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        cos_sin: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)
        # q and k heads are adjacent in the merged projection: one RoPE pass rotates both.
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], tp=tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# HF checkpoint name -> (our parameter name, shard index within a merged layer)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NAME = re.compile(r"^(.*)\.(\w+)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM: hidden states for a flat batch, logits for the rows asked for."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch; kv_caches is [layers, 2, ...]."""
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(cos_sin, hidden, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, vocab] in float32 for the selected hidden rows."""
        return self.lm_head(hidden).float()

    def pack_for_cpu(self) -> bool:
        """Prepack every matmul weight for oneDNN (call after load_weights); False if unsupported."""
        linears = [m for m in self.modules() if isinstance(m, LinearBase)]
        return all([m.pack_for_cpu() for m in linears])

    def drop_matmul_weights(self, embedding: bool = False) -> None:
        """Free every matmul weight (and the embedding), for when a fused forward with its
        own copy runs the model."""
        for module in self.modules():
            if isinstance(module, LinearBase) or (embedding and module is self.embed_tokens):
                dtype = module.weight.dtype
                module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a full checkpoint keyed by Hugging Face names; every parameter must be set."""
        modules = dict(self.named_modules())
        loaded: set[tuple[str, str, int]] = set()
        for hf_name, tensor in weights.items():
            target = self._resolve(hf_name)
            if target is None:
                continue
            module_name, param_name, shard = target
            if module_name not in modules:
                raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
            try:
                modules[module_name].load_shard(param_name, tensor, shard)
            except (ValueError, RuntimeError) as e:
                raise ModelLoadError(f"checkpoint tensor {hf_name}: {e}") from None
            loaded.add(target)
        self._check_complete(modules, loaded)

    def _resolve(self, hf_name: str) -> tuple[str, str, int] | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        name = hf_name.removeprefix("model.")
        match = _NAME.match(name)
        if match is None:
            return (name.rsplit(".", 1)[0], name.rsplit(".", 1)[-1], 0)
        parent, leaf, param = match.groups()
        if leaf in _MERGED:
            merged, shard = _MERGED[leaf]
            return (f"{parent}.{merged}", param, shard)
        return (f"{parent}.{leaf}", param, 0)

    def _check_complete(
        self, modules: dict[str, nn.Module], loaded: set[tuple[str, str, int]]
    ) -> None:
        missing = []
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            shards = len(getattr(modules[module_name], "output_sizes", [0]))
            missing += [
                f"{name}[{i}]" if shards > 1 else name
                for i in range(shards)
                if (module_name, param_name, i) not in loaded
            ]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")
