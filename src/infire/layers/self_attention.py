"""Grouped-query self-attention with RoPE: the attention block of Llama, Qwen, Mixtral and
Gemma, and of Llama 4's layers with their options.

q/k/v are one merged matmul split by heads (tensor parallel), optionally normed per head
(Qwen3, Gemma 3: `qk_norm` builds the norm), rotated (unless the layer has no RoPE), run
through PagedAttention against the layer's KV pool slice, and projected back by the
row-parallel o_proj.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infire.layers.attention import AttentionMetadata, PagedAttention
from infire.layers.linear import QKVParallelLinear, RowParallelLinear
from infire.layers.rotary import apply_rotary, apply_rotary_interleaved
from infire.parallel import SINGLE, TensorParallelGroup


class SelfAttention(nn.Module):
    """GQA self-attention over the paged KV cache."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tp: TensorParallelGroup = SINGLE,
        *,
        bias: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        scale: float | None = None,
        interleaved_rope: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, bias=bias, tp=tp
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, scale)
        self.rotate = apply_rotary_interleaved if interleaved_rope else apply_rotary

    def forward(
        self,
        cos_sin: torch.Tensor | None,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos_sin None: a layer without RoPE."""
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)
        heads = self.num_heads
        qk = qkv[:, : heads + self.num_kv_heads]  # q and k heads are adjacent
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = self.transform_qk(qk, cos_sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + self.num_kv_heads :]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def transform_qk(self, qk: torch.Tensor, cos_sin: torch.Tensor | None) -> torch.Tensor:
        """q and k heads together after any norm: RoPE (one pass for both)."""
        return qk if cos_sin is None else self.rotate(qk, cos_sin)
