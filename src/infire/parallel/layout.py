"""How a model is cut across ranks: KV heads per tensor-parallel rank, layer ranges per
pipeline stage, and the startup check that refuses a model that cannot be cut that way.

Tensor parallelism splits attention by heads and the MLP by intermediate features, so
both must divide evenly; KV heads divide evenly where there are at least as many as
ranks, and are replicated (rank r serves KV head r * kv_heads // tp) where there are
fewer. Pipeline parallelism gives each stage a contiguous, balanced range of layers.
"""

from __future__ import annotations

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.parallel.group import TensorParallelGroup


def kv_head_shard(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first KV head, count) this tp rank holds: an even share, or one replicated head."""
    if num_kv_heads >= tp.world_size:
        return tp.shard(num_kv_heads, "num_key_value_heads")
    if tp.world_size % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp.world_size} is not a multiple of "
                         f"num_key_value_heads {num_kv_heads}")  # fmt: skip
    return tp.rank * num_kv_heads // tp.world_size, 1


def layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges of pp_size stages; sizes differ by at most one
    (the earlier stages take the extra layers)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pipeline parallel size {pp_size} for {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage in range(pp_size):
        end = start + base + (stage < extra)
        ranges.append((start, end))
        start = end
    return ranges


def check_parallel(config: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Refuse (ModelLoadError naming the constraint) a model that cannot be cut into
    tp_size tensor-parallel ranks and pp_size pipeline stages."""
    problems = []
    if tp_size < 1 or pp_size < 1:
        problems.append(f"tensor_parallel_size {tp_size} and pipeline_parallel_size {pp_size} "
                        "must be at least 1")  # fmt: skip
    else:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if heads % tp_size:
            problems.append(f"num_attention_heads {heads} is not divisible by "
                            f"tensor_parallel_size {tp_size}")  # fmt: skip
        if kv % tp_size and tp_size % kv:
            problems.append(f"num_key_value_heads {kv} is neither a multiple nor a divisor "
                            f"of tensor_parallel_size {tp_size}")  # fmt: skip
        if config.intermediate_size % tp_size:
            problems.append(f"intermediate_size {config.intermediate_size} is not divisible "
                            f"by tensor_parallel_size {tp_size}")  # fmt: skip
        if pp_size > config.num_hidden_layers:
            problems.append(f"pipeline_parallel_size {pp_size} is more than the model's "
                            f"{config.num_hidden_layers} layers (num_hidden_layers)")  # fmt: skip
    if problems:
        raise ModelLoadError(
            f"cannot split this model over tensor_parallel_size {tp_size} x "
            f"pipeline_parallel_size {pp_size}: " + "; ".join(problems)
        )
