"""Configuration dataclasses: what a model is (ModelConfig) and how the engine runs it.

ModelConfig is filled by the loader from config.json or GGUF metadata; the engine
configs come from the CLI / Python API and are checked once in __post_init__.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers' rope_type names it: "llama3" (Llama 3.x,
    Llama 4), "linear" (positions divided by factor: Gemma 3's global layers) or "yarn"
    (DeepSeek-V3, Kimi K2); None in a config means plain RoPE."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0  # yarn's
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear", "yarn"):
            raise ValueError(f"rope scaling {self.kind!r} is not supported (llama3, linear, yarn)")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters every decoder-only family has; a family with more subclasses it
    (models/registry.py says which class `architecture` names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # every layer's, where a family has one (Mistral)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2G', '1.5GB' (binary units); ValueError else."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"invalid size {text!r} (use e.g. 512MiB or 2GiB)")
    number, unit = match.groups()
    return int(float(number) * (_UNITS[unit[0].lower()] if unit else 1))


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget that sizes the block pool."""

    block_size: int = 16
    kv_cache_memory: int = 512 * 1024**2
    num_blocks: int | None = None  # overrides kv_cache_memory when set (tests, tuning)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits per engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")


@dataclass(slots=True)
class ParallelConfig:
    """Tensor x pipeline parallel ranks, and where they meet (torchrun's names).

    Rank r holds pipeline stage r // tp and tensor shard r % tp. With nnodes > 1 each node
    starts world_size / nnodes ranks (node 0 has rank 0, the engine core); master_port 0
    picks a free port on one node."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    threads_per_rank: int | None = None  # default: this machine's cores / local ranks

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor x pipeline parallel size {self.world_size} must be a multiple of "
                f"--nnodes {self.nnodes} (each node starts the same number of ranks)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need --master-port (and --master-addr) to meet")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation (disagg/): this engine's role and its KV transfer.

    `both` (the default) is a whole engine. `prefill` runs prompts and holds their KV
    blocks for a decode engine to pull, for at most `lease_seconds`; `decode` takes
    requests with a prefill engine's handle, pulls the blocks it lacks and decodes.
    `kv_host` is the address peers reach this engine's transfer engine at, `kv_protocol`
    its transport (tcp; rdma with Mooncake's CUDA build and RDMA NICs)."""

    role: str = "both"
    connector: str = "mooncake"
    kv_host: str = "127.0.0.1"
    lease_seconds: float = 30.0
    kv_protocol: str = "tcp"
    # shared by the prefill and decode workers of a deployment: handles are signed with it
    # and a decode worker takes no other (without it, any client that reaches a decode
    # worker can hand it KV blocks)
    secret: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, not {self.role!r}")
        if self.lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")


@dataclass(slots=True)
class EngineConfig:
    """Everything an LLMEngine needs besides the model itself."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    cpu_kernels: bool = True  # fused C forward on CPU where it applies (infire.kernels)
    enforce_eager: bool = False  # on CUDA: no decode from CUDA graphs (engine/cuda_graphs.py)
    # a quantized GGUF's weights: "auto" serves them as the file's blocks where the fused
    # CPU forward runs the model (else dequantized to dtype), "none" always dequantizes
    quantization: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, device: str, fused_cpu_bf16: bool = False) -> torch.dtype:
    """Map a dtype name ('auto', 'float32', 'bfloat16', ...) to the serving torch dtype.

    On CPU, auto is bfloat16 where matmuls in it are fast: natively (AMX, AVX512-BF16) or
    through the fused CPU forward (`fused_cpu_bf16`), which reads bf16 weights and
    computes in fp32; elsewhere float32.
    """
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if fused_cpu_bf16 or _cpu_has_fast_bf16() else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16"
        ) from None


def _cpu_has_fast_bf16() -> bool:
    """True where the CPU does bf16 matmuls natively (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
