"""RMS norms, computed in float32 and cast back, as each family's reference does.

RMSNorm is Llama's (weight times the cast-back normed input); GemmaRMSNorm stores its
weight as an offset from one and multiplies in float32 before the cast; a norm over the
last dimension also serves per-head q/k norms (Qwen3, Gemma 3) on [T, heads, head_dim];
`rms_normalize` is the weightless one (Llama 4's QK norm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infire.kernels.triton_support import use_triton

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
        if use_triton(x):  # one launch for the add and the norm
            from infire.kernels.triton_ops import add_rms_norm

            return add_rms_norm(x, self.weight, self.eps, residual)
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


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32 (Gemma's checkpoints store weight - 1)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise NotImplementedError("GemmaRMSNorm has no fused residual")
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, no weight (in float32, cast back)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
