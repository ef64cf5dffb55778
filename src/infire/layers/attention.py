"""Paged attention over a flattened varlen batch, in plain PyTorch (CPU and CUDA alike).

Every step's tokens arrive as one flat [T, heads, head_dim] tensor. New keys/values are
written into the block pool at `slot_mapping`; queries then attend to their sequence's
context, read back from the pool through its block table. Sequences are grouped so each
layer runs at most three batched SDPA calls, never a Python loop over sequences:
- fresh: one sequence's first prefill chunk with no cached context (plain causal SDPA on
  the new keys, no pool read);
- decode: every sequence with one new token, batched with a key-padding mask;
- prefill: other prefill chunks (chunked or prefix-cached), padded to the longest chunk.
Grouped-query attention goes through SDPA's enable_gqa, so keys/values are never repeated.

Where the Triton kernels serve (a CUDA device, kernels/triton_support.use_triton), the
runner also gives each group without a window `TritonGroups`, and attention reads the pool
through the block tables with no gather (kernels/triton_attention.py): split-K decode
with GQA, and tiles of prefill queries. Latent attention (MLA) and windowed groups keep
the PyTorch path.

Layers of a windowed KV group (layers/kv_spec.py) get metadata whose block tables start
at the first block in the window and whose masks also hide keys before it. Multi-head
latent attention stores one "key" per token (the compressed latent and its RoPE part) and
reads its values as the first `latent_values` features of that key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeGroup:
    """Sequences decoding one token each."""

    token_index: torch.Tensor  # [B] rows of the flat batch
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size], True = attend


@dataclass(slots=True)
class PrefillGroup:
    """Prefill chunks that attend to context already in the pool, padded to max_q."""

    gather_index: torch.Tensor  # [B * max_q] rows of the flat batch (padding -> row 0)
    valid_index: torch.Tensor  # [n] positions in the padded layout that are real tokens
    token_index: torch.Tensor  # [n] rows of the flat batch, in the same order
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size]
    max_q: int


@dataclass(slots=True)
class TritonGroups:
    """The same step for the Triton kernels (kernels/triton_attention.py), which read the
    pool through the block tables: decode rows one query each, the other rows in tiles."""

    decode_index: torch.Tensor | None  # [B] rows of the flat batch
    decode_tables: torch.Tensor | None  # [B, max_blocks] int32
    decode_lengths: torch.Tensor | None  # [B] int32: keys each sees (its position + 1)
    prefill_tables: torch.Tensor | None  # [S, max_blocks] int32
    prefill_tiles: torch.Tensor | None  # [4, tiles] int32 (triton_attention.prefill_tiles)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flat batch for one KV group, built once by the runner and
    shared by all of its layers; `windows` holds the windowed groups' (1, 2, ...)."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    fresh: slice | None = None  # rows of a single no-context prefill, if any
    fresh_mask: torch.Tensor | None = None  # [n, n] where a window cuts the causal mask
    decode: DecodeGroup | None = None
    prefill: PrefillGroup | None = None
    only_decode: bool = False  # every row decodes, in order: skip the scatter
    windows: tuple[AttentionMetadata, ...] = field(default_factory=tuple)
    triton: TritonGroups | None = None  # set where the Triton kernels serve this group

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of KV group `index` (0: this one)."""
        return self if index == 0 else self.windows[index - 1]


class PagedAttention:
    """Attention of one layer against its slice of the KV block pool."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        latent_values: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim  # of queries and keys
        self.scale = head_dim**-0.5 if scale is None else scale
        self.latent_values = latent_values  # MLA: values are keys[..., :latent_values]

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's slice of the pool: [2 (K, V) or 1 (latent), blocks, bs, heads, dim]."""
        planes = 1 if self.latent_values else 2
        return (planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (v None for latent attention), kv_cache from
        cache_shape -> [T, H * value dim]."""
        k_cache = kv_cache[0]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        if self.latent_values:
            v_cache = k_cache[..., : self.latent_values]
            v = k[..., : self.latent_values]
        else:
            v_cache = kv_cache[1]
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        if meta.triton is not None and not self.latent_values:
            return self._triton(q, k_cache, v_cache, meta.triton).view(q.shape[0], -1)
        if meta.only_decode:
            return self._decode(q, k_cache, v_cache, meta.decode).reshape(q.shape[0], -1)
        out = q.new_empty(q.shape[0], self.num_heads, v.shape[-1])
        if meta.fresh is not None:
            rows = meta.fresh
            out[rows] = self._fresh(q[rows], k[rows], v[rows], meta.fresh_mask)
        if meta.decode is not None:
            out[meta.decode.token_index] = self._decode(q, k_cache, v_cache, meta.decode)
        if meta.prefill is not None:
            out[meta.prefill.token_index] = self._prefill(q, k_cache, v_cache, meta.prefill)
        return out.view(q.shape[0], -1)

    def _triton(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: TritonGroups
    ) -> torch.Tensor:
        from infire.kernels.triton_attention import paged_decode, paged_prefill

        out = q.new_empty(q.shape[0], self.num_heads, v_cache.shape[-1])
        if groups.prefill_tiles is not None:
            paged_prefill(q, k_cache, v_cache, groups.prefill_tables, groups.prefill_tiles,
                          self.scale, out)  # fmt: skip
        if groups.decode_index is not None:
            rows = groups.decode_index
            out[rows] = paged_decode(q[rows], k_cache, v_cache, groups.decode_tables,
                                     groups.decode_lengths, self.scale)  # fmt: skip
        return out

    def _fresh(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=True,
        )  # fmt: skip
        return o[0].transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:
        qh = q[group.token_index].unsqueeze(2)  # [B, H, 1, D]
        keys = _gather(k_cache, group.block_tables)
        values = _gather(v_cache, group.block_tables)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=group.mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: PrefillGroup
    ) -> torch.Tensor:
        b, max_q = group.block_tables.shape[0], group.max_q
        qh = q[group.gather_index].view(b, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        keys = _gather(k_cache, group.block_tables)
        values = _gather(v_cache, group.block_tables)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=group.mask, scale=self.scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(b * max_q, self.num_heads, -1)[group.valid_index]


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[blocks, bs, KVH, D] pool + [B, nb] tables -> [B, KVH, nb*bs, D] contiguous context."""
    b, nb = block_tables.shape
    blocks = cache[block_tables]  # [B, nb, bs, KVH, D]
    return blocks.reshape(b, nb * cache.shape[1], cache.shape[2], -1).transpose(1, 2)
