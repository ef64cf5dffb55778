"""RMSNorm, computed in float32 and cast back, as the Llama reference does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def load_shard(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        """Norm weights are replicated on every rank."""
        self.weight.data.copy_(loaded)
