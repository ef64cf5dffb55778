"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat varlen batch.

Reads like the architecture: embed -> N x [RMSNorm, GQA attention with RoPE, residual,
RMSNorm, SwiGLU MLP, residual] -> RMSNorm -> LM head. Qwen2 differs only by q/k/v biases.
q/k/v and gate/up are merged into one matmul each; every linear layer is tensor-parallel.
A pipeline stage builds only its `layer_range` of layers: the first stage embeds, the
last one holds the final norm and the LM head, and the hidden states in between are the
caller's to pass on. Weights load from Hugging Face names (the GGUF loader maps to those
too), each layer reading only its own slice from a lazy weight source.
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
from infire.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from infire.layers.norm import RMSNorm
from infire.layers.rotary import RotaryEmbedding, apply_rotary
from infire.models.weights import WeightSource, as_source
from infire.parallel import SINGLE, TensorParallelGroup, check_parallel


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE over the paged KV cache."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias, tp=tp,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        q_full = config.num_attention_heads * self.head_dim
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
    """Decoder-only LM (or one pipeline stage of it): hidden states for a flat batch, logits
    for the rows asked for (last stage)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup = SINGLE,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        check_parallel(config, tp.world_size, 1)  # a model tp cannot split is named, not hit
        self.config = config
        start, end = layer_range or (0, config.num_hidden_layers)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} for {config.num_hidden_layers} layers")
        self.layer_range = (start, end)
        self.is_first_stage = start == 0
        self.is_last_stage = end == config.num_hidden_layers
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(start, end))
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after this stage's layers (normed on the last stage).

        `inputs` is the flat batch's token ids [T] on the first stage, the previous stage's
        hidden states [T, hidden] on the others; kv_caches is [local layers, 2, ...]."""
        hidden = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(cos_sin, hidden, kv_cache, meta)
        return self.norm(hidden) if self.norm is not None else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, vocab] in float32 for the selected hidden rows (last stage)."""
        if self.lm_head is None:
            raise RuntimeError("logits are computed on the last pipeline stage only")
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

    def load_weights(self, weights: WeightSource | dict[str, torch.Tensor]) -> None:
        """Load this stage's parameters from a checkpoint keyed by Hugging Face names (a lazy
        source or a dict of full tensors), each layer reading only its slice; every
        parameter must be set."""
        source = as_source(weights)
        modules = dict(self.named_modules())
        loaded: set[tuple[str, str, int]] = set()
        for hf_name in source.names():
            target = self._resolve(hf_name)
            if target is None:
                continue
            module_name, param_name, shard = target
            if module_name not in modules:
                raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
            try:
                modules[module_name].load_shard(param_name, source.get_slice(hf_name), shard)
            except (ValueError, RuntimeError, KeyError) as e:
                raise ModelLoadError(f"checkpoint tensor {hf_name}: {e}") from None
            loaded.add(target)
        self._check_complete(modules, loaded)

    def _resolve(self, hf_name: str) -> tuple[str, str, int] | None:
        """(module, parameter, shard) of a checkpoint tensor on this stage; None if the
        stage does not hold it."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else self._on_last("lm_head", "weight")
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight":
            if self.is_first_stage:
                return ("embed_tokens", "weight", 0)
            # a tied head on a later stage reads the embedding matrix itself
            tied = self.config.tie_word_embeddings
            return self._on_last("lm_head", "weight") if tied else None
        if name == "norm.weight":
            return self._on_last("norm", "weight")
        match = _NAME.match(name)
        if match is None:
            return (name.rsplit(".", 1)[0], name.rsplit(".", 1)[-1], 0)
        parent, leaf, param = match.groups()
        parent = self._local_layer(parent)
        if parent is None:
            return None
        if leaf in _MERGED:
            merged, shard = _MERGED[leaf]
            return (f"{parent}.{merged}", param, shard)
        return (f"{parent}.{leaf}", param, 0)

    def _on_last(self, module: str, param: str) -> tuple[str, str, int] | None:
        return (module, param, 0) if self.is_last_stage else None

    def _local_layer(self, parent: str) -> str | None:
        """`layers.i...` renumbered to this stage's ModuleList; None if layer i is elsewhere."""
        parts = parent.split(".")
        if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
            return parent
        index = int(parts[1])
        start, end = self.layer_range
        if index >= self.config.num_hidden_layers:
            return parent  # no such layer in any stage: refused as having no place
        if not start <= index < end:
            return None
        return ".".join(["layers", str(index - start), *parts[2:]])

    def _check_complete(
        self, modules: dict[str, nn.Module], loaded: set[tuple[str, str, int]]
    ) -> None:
        missing = []
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            shards = len(getattr(modules[module_name], "output_sizes", [0]))
            missing += [
                f"{self._global_name(name)}[{i}]" if shards > 1 else self._global_name(name)
                for i in range(shards)
                if (module_name, param_name, i) not in loaded
            ]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")

    def _global_name(self, name: str) -> str:
        """A parameter's name with the layer numbered as in the checkpoint."""
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + self.layer_range[0])
        return ".".join(parts)
