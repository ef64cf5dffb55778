"""What every decoder-only family shares: pipeline stages, loading by name, the KV spec.

`CausalLM` is a model (or one pipeline stage of it) over a flat varlen batch: embed on the
first stage, the stage's `layer_range` of decoder layers, the final norm and LM head on
the last. A family subclasses it with its `make_layer` (and, where it differs, its
embedding, its per-step position inputs and its KV cache spec), so that its file holds
only what its paper adds. Weights load from Hugging Face names (the GGUF loader maps to
those too), each module reading only its slice from a lazy weight source: q/k/v and
gate/up merge into one matmul each, and experts into stacked tensors, per-expert
(`experts.{e}.gate_proj`, Mixtral's `w1`/`w3`/`w2`) or already stacked (Llama 4).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.layers.attention import AttentionMetadata
from infire.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from infire.layers.kv_spec import KVCacheSpec, KVGroupSpec
from infire.layers.linear import LinearBase
from infire.layers.moe import ALL_SHARDS, FusedMoE
from infire.layers.norm import RMSNorm
from infire.layers.rotary import RotaryEmbedding
from infire.models.weights import WeightSource, as_source
from infire.parallel import SINGLE, TensorParallelGroup, check_parallel

# checkpoint name -> (our parameter name, shard index within a merged layer)
MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# an expert's projection -> (stacked parameter, shard within the expert)
_EXPERT_PARTS = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0),
    "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", 0), "w2": ("w2", 0),
}  # fmt: skip
_STACKED_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}
_NAME = re.compile(r"^(.*)\.(\w+)\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")

Target = tuple[str, str, int]  # (module, parameter, shard)


class CausalLM(nn.Module):
    """A decoder-only LM (or one pipeline stage of it): hidden states for a flat batch,
    logits for the rows asked for (last stage)."""

    supports_fused_cpu: ClassVar[bool] = False  # the fused C forward runs Llama-shaped models
    config_class: ClassVar[type[ModelConfig]] = ModelConfig

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup = SINGLE,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        type(self).check_parallel(config, tp.world_size)
        self.config = config
        self.tp = tp
        start, end = layer_range or (0, config.num_hidden_layers)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} for {config.num_hidden_layers} layers")
        self.layer_range = (start, end)
        self.is_first_stage = start == 0
        self.is_last_stage = end == config.num_hidden_layers
        self.kv_spec = type(self).kv_cache_spec(config)
        self.rotary = self.make_rotary()
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        group_of = self.kv_spec.group_of_layer(config.num_hidden_layers)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(start, end))
        for index, layer in zip(range(start, end), self.layers, strict=True):
            layer.kv_group = group_of[index]
        self.norm: nn.Module | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.is_last_stage:
            self.norm = self.make_norm(config.hidden_size)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    # --- what a family defines ---------------------------------------------------------

    # what transformers' config class fills in where a config.json leaves a field out
    hf_config_defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def hf_config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The fields of `config_class` beyond ModelConfig's, from a config.json."""
        return {}

    @classmethod
    def gguf_config_fields(cls, metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The same from GGUF metadata (keys under `prefix`, llama.cpp's architecture)."""
        return {}

    # parts of checkpoint names this family spells otherwise than our modules
    checkpoint_renames: ClassVar[dict[str, str]] = {}

    # llama.cpp's per-layer tensor names this family adds -> Hugging Face suffix (the
    # common ones, experts included, are models/gguf.py's)
    gguf_tensor_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def gguf_tensor_transform(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo what llama.cpp's converter did to a tensor of this family (read from GGUF; a
        piece of rows at a time, in float32, so row-wise transforms only). 1-D tensors
        only: 2-D weights may be served as their stored blocks (GGUFSource.blocks)."""
        return tensor

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` (global numbering) for this rank; it has `self_attn.attn`
        (a PagedAttention) and is called as layer(position_inputs, hidden, kv_cache, meta)."""
        raise NotImplementedError

    def make_norm(self, size: int) -> nn.Module:
        """A norm of this family over `size` features."""
        return RMSNorm(size, self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module | None:
        """The RoPE tables the layers share (None if the family builds its own)."""
        c = self.config
        return RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the first layer for these tokens."""
        return self.embed_tokens(token_ids)

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every layer needs of this step's positions (by default the RoPE cos/sin)."""
        return self.rotary.cos_sin(positions, dtype)

    @classmethod
    def kv_cache_spec(cls, config: ModelConfig) -> KVCacheSpec:
        """The KV groups of the whole model (by default: every layer full attention with
        K and V of num_key_value_heads x head_dim)."""
        per_layer = 2 * config.num_key_value_heads * config.head_dim
        layers = tuple(range(config.num_hidden_layers))
        return KVCacheSpec((KVGroupSpec(layers, per_layer * len(layers)),))

    @classmethod
    def check_parallel(cls, config: ModelConfig, tp_size: int) -> None:
        """Refuse a model this family cannot split over tp_size ranks (ModelLoadError)."""
        check_parallel(config, tp_size, 1)

    # --- the forward -------------------------------------------------------------------

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after this stage's layers (normed on the last stage).

        `inputs` is the flat batch's token ids [T] on the first stage, the previous stage's
        hidden states [T, hidden] on the others; kv_caches holds one tensor per local layer."""
        hidden = self.embed(inputs) if self.embed_tokens is not None else inputs
        position_inputs = self.position_inputs(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(position_inputs, hidden, kv_cache, meta.group(layer.kv_group))
        return self.norm(hidden) if self.norm is not None else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, vocab] in float32 for the selected hidden rows (last stage)."""
        if self.lm_head is None:
            raise RuntimeError("logits are computed on the last pipeline stage only")
        return self.lm_head(hidden).float()

    def cache_shapes(self, num_blocks: list[int], block_size: int) -> list[tuple[int, ...]]:
        """The KV pool slice of each local layer, its group holding num_blocks[group]."""
        return [
            layer.self_attn.attn.cache_shape(num_blocks[layer.kv_group], block_size)
            for layer in self.layers
        ]

    def pack_for_cpu(self) -> bool:
        """Prepack every matmul weight for oneDNN (call after load_weights); False if unsupported."""
        linears = [m for m in self.modules() if isinstance(m, LinearBase | FusedMoE)]
        return all([m.pack_for_cpu() for m in linears])

    def hold_palette_weights(self, choice: Any = None) -> tuple[int, int]:
        """Hold every bf16 matmul weight that takes it in Unweight's palette form, for the
        Triton matmul (kernels/triton_palette.py); (held, all) linears."""
        linears = [m for m in self.modules() if isinstance(m, LinearBase)]
        return sum(m.hold_palette(choice) for m in linears), len(linears)

    def drop_matmul_weights(self, embedding: bool = False) -> None:
        """Free every matmul weight (and the embedding), for when a fused forward with its
        own copy runs the model."""
        for module in self.modules():
            if isinstance(module, LinearBase) or (embedding and module is self.embed_tokens):
                dtype = module.weight.dtype
                module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            elif isinstance(module, FusedMoE):
                for name in ("w13", "w2"):
                    dtype = getattr(module, name).dtype
                    empty = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
                    setattr(module, name, empty)

    # --- loading -----------------------------------------------------------------------

    def load_weights(
        self,
        weights: WeightSource | dict[str, torch.Tensor],
        skip: Callable[[str], bool] | None = None,
        blocks: Callable[[str], Any] | None = None,
    ) -> None:
        """Load this stage's parameters from a checkpoint keyed by Hugging Face names (a lazy
        source or a dict of full tensors), each module reading only its slice; every
        parameter must be set, except those of the tensors `skip` names, which are left
        unwritten (a fused forward holds them in another form: their pages are never
        touched, so they take no memory until drop_matmul_weights frees them). With
        `blocks` (a quantized GGUF's GGUFSource.blocks), the linears, the embedding and the
        head hold their slices of the file's blocks where the kernel reads their type."""
        source = as_source(weights)
        modules = dict(self.named_modules())
        loaded: set[Target] = set()
        embed, head = self.embed_tokens, self.lm_head
        tied = head is not None and embed is not None and head.weight is embed.weight
        for hf_name in source.names():
            target = self._resolve(hf_name)
            if target is None:
                continue
            module_name, param_name, shard = target
            if module_name not in modules:
                raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
            module = modules[module_name]
            try:
                stored = _readable_blocks(blocks, hf_name, module, param_name)
                if stored is not None:
                    module.load_blocks(param_name, stored, shard)
                elif skip is None or not skip(hf_name):
                    module.load_shard(param_name, source.get_slice(hf_name), shard)
            except (ValueError, RuntimeError, KeyError, AttributeError) as e:
                raise ModelLoadError(f"checkpoint tensor {hf_name}: {e}") from None
            if shard == ALL_SHARDS:
                count = module.shard_count(param_name)
                loaded.update((module_name, param_name, i) for i in range(count))
            else:
                loaded.add(target)
        for module in modules.values():
            if hasattr(module, "finish_blocks"):
                module.finish_blocks()
        if tied and embed.quant is not None:  # the head reads the embedding's blocks
            head.hold_quant(embed.quant)
            head.weight = embed.weight  # still one (empty) parameter
        self._check_complete(modules, loaded)

    def resolve_in_layer(self, parent: str, leaf: str, param: str) -> Target | None:
        """Where `{parent}.{leaf}.{param}` of a local layer goes (a family may rename);
        parent is already renumbered to this stage's layer list."""
        if leaf in MERGED:
            merged, shard = MERGED[leaf]
            return (f"{parent}.{merged}", param, shard)
        return (f"{parent}.{leaf}", param, 0)

    def _resolve(self, hf_name: str) -> Target | None:
        """(module, parameter, shard) of a checkpoint tensor on this stage; None if the
        stage does not hold it."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else self._on_last("lm_head", "weight")
        name = hf_name.removeprefix("model.")
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        if name == "embed_tokens.weight":
            if self.is_first_stage:
                return ("embed_tokens", "weight", 0)
            # a tied head on a later stage reads the embedding matrix itself
            tied = self.config.tie_word_embeddings
            return self._on_last("lm_head", "weight") if tied else None
        if name == "norm.weight":
            return self._on_last("norm", "weight")
        for pattern, expert in ((_EXPERT, True), (_STACKED, False)):
            match = pattern.match(name)
            if match is not None:
                return self._resolve_experts(match.groups(), expert, hf_name)
        match = _NAME.match(name)
        if match is None:
            return (name.rsplit(".", 1)[0], name.rsplit(".", 1)[-1], 0)
        parent, leaf, param = match.groups()
        parent = self._local_layer(parent)
        if parent is None:
            return None
        return self.resolve_in_layer(parent, leaf, param)

    def _resolve_experts(self, groups: tuple[str, ...], per_expert: bool, hf_name: str):
        parent = self._local_layer(groups[0])
        if parent is None:
            return None
        if not per_expert:
            return (parent, _STACKED_EXPERTS[groups[1]], ALL_SHARDS)
        expert, part = int(groups[1]), groups[2]
        if part not in _EXPERT_PARTS:
            raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
        param, offset = _EXPERT_PARTS[part]
        return (parent, param, 2 * expert + offset if param == "w13" else expert)

    def _on_last(self, module: str, param: str) -> Target | None:
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

    def _check_complete(self, modules: dict[str, nn.Module], loaded: set[Target]) -> None:
        missing = []
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            module = modules[module_name]
            if hasattr(module, "shard_count"):
                shards = module.shard_count(param_name)
            else:
                shards = len(getattr(module, "output_sizes", [0]))
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


def _readable_blocks(
    blocks: Callable[[str], Any] | None, name: str, module: nn.Module, param: str
) -> Any:
    """The GGUF blocks of checkpoint tensor `name` where `module` holds its parameter `param`
    so (a linear, the embedding, the head, routed experts) and the kernel reads their
    type, else None."""
    if blocks is None or param not in getattr(module, "blocks_params", ()):
        return None
    from infire.kernels.cpu_forward import READ_TYPES

    stored = blocks(name)
    return stored if stored is not None and stored[0] in READ_TYPES else None
