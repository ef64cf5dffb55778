"""TensorParallelGroup: a rank's place in a tensor-parallel group and the collectives over it.

Layers take one explicitly (never a global); with world size 1 every collective is the
identity, so single-device code pays nothing for being TP-ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This rank's place in a tensor-parallel group, and the collectives over it."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed.ProcessGroup when world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along its last dimension."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, name: str = "dimension") -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of `size`."""
        if size % self.world_size:
            raise ValueError(f"{name} {size} is not divisible by tp size {self.world_size}")
        length = size // self.world_size
        return self.rank * length, length


SINGLE = TensorParallelGroup()
