"""Tensor-parallel linear layers (Megatron style), the identity wrappers at tp size 1.

ColumnParallelLinear splits the output features across ranks; RowParallelLinear splits
the input features and sums the partial products. Merged variants (QKV, gate+up) hold
several logical weights in one matrix so a layer runs one matmul instead of three.
Each layer loads a full (unsharded) checkpoint tensor and keeps its own slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infire.parallel import SINGLE, TensorParallelGroup


class LinearBase(nn.Module):
    """Weight storage shared by the parallel linears: [out, in] as checkpoints have it, or,
    after loading, prepacked into oneDNN's blocked layout for CPU matmuls (on this class of
    CPU 1.5-2x faster than MKL's at the small batch sizes of decoding)."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        """Replace the weight by a oneDNN-packed copy; False where oneDNN cannot pack it."""
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
        except (RuntimeError, AttributeError):
            return False
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for 2-D x, whatever the storage."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [None], "")
        return F.linear(x, self.weight, bias)


# oneDNN picks its blocking for this many rows; it stays fast from 1 to 512 rows.
PACK_BATCH_HINT = 32


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (output features) split across the tp group."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = [tp.shard(size, "output size")[1] for size in output_sizes]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        """Copy this rank's rows of logical weight `shard_index` from a full tensor."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise KeyError(f"layer has no {name}")
        size = self.output_sizes[shard_index]
        offset = sum(self.output_sizes[:shard_index])
        start = self.tp.rank * size
        if loaded.shape[0] != size * self.tp.world_size:
            raise ValueError(
                f"{name}: expected {size * self.tp.world_size} rows, got {loaded.shape[0]}"
            )
        param.data[offset : offset + size].copy_(loaded[start : start + size])


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's columns (input features) split; partial sums all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = tp.shard(input_size, "input size")[1]
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum over ranks.
        y = self.tp.all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y

    def load_shard(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        """Copy this rank's columns from a full weight (or the whole bias)."""
        if name == "bias":
            self.bias.data.copy_(loaded)
            return
        start = self.tp.rank * self.input_size
        self.weight.data.copy_(loaded[:, start : start + self.input_size])
