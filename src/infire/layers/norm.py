"""RMSNorm, computed in float32 and cast back, as the Llama reference does."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from infire.models.weights import LazyTensor


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with an optional fused residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """Norm weights are replicated on every rank."""
        if tuple(loaded.shape) != tuple(self.weight.shape):
            raise ValueError(f"{name}: expected shape {list(self.weight.shape)}, got "
                             f"{list(loaded.shape)}")  # fmt: skip
        loaded.read_into(self.weight.data)
