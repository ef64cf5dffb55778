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


class ColumnParallelLinear(nn.Module):
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
        return F.linear(x, self.weight, self.bias)

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


class RowParallelLinear(nn.Module):
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
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def load_shard(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        """Copy this rank's columns from a full weight (or the whole bias)."""
        if name == "bias":
            self.bias.data.copy_(loaded)
            return
        start = self.tp.rank * self.input_size
        self.weight.data.copy_(loaded[:, start : start + self.input_size])
