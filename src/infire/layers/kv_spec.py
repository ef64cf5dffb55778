"""What a model keeps in the paged KV cache: groups of layers, each with its own block pool.

A group is a set of layers that share block tables: the full-attention layers (group 0,
whose blocks hold every token of a sequence and feed the prefix cache) and, for models
with local attention, one group per window rule (Gemma 3's sliding layers, Llama 4's
chunked layers). A windowed group's blocks that fall out of the window are freed as the
sequence grows, so its memory is bounded by the window, not by the context. What one
token costs is counted per group in elements (dtype-free): MLA's latent, not full K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, slots=True)
class AttentionWindow:
    """The keys a query at position p sees besides causality: the last `size` positions
    (sliding, Gemma's and Mistral's rule) or those of its own `size`-aligned chunk
    (chunked, Llama 4's local attention)."""

    kind: Literal["sliding", "chunked"]
    size: int

    def __post_init__(self) -> None:
        if self.kind not in ("sliding", "chunked") or self.size < 1:
            raise ValueError(f"bad attention window {self.kind} {self.size}")

    def first_visible(self, position: int) -> int:
        """The earliest key position a query at `position` attends to."""
        if self.kind == "sliding":
            return max(0, position - self.size + 1)
        return position // self.size * self.size

    def first_visible_tensor(self, positions: torch.Tensor) -> torch.Tensor:
        """first_visible of every element."""
        if self.kind == "sliding":
            return (positions - self.size + 1).clamp(min=0)
        return positions // self.size * self.size

    def pool_blocks(self, num_seqs: int, num_batched_tokens: int, block_size: int) -> int:
        """Blocks a pool needs so that `num_seqs` sequences each keep a window, and a
        step's `num_batched_tokens` new tokens (spread over them) have blocks too."""
        window = -(-(self.size - 1) // block_size) + 2
        return num_seqs * window + -(-num_batched_tokens // block_size)

    def max_blocks(self, num_new_tokens: int, block_size: int) -> int:
        """The most blocks one sequence holds in this window while computing a chunk of
        `num_new_tokens` (keys from the first token's window to the last new token)."""
        span = self.size - 1 + num_new_tokens
        return -(-span // block_size) + 1


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """Layers that share block tables, and what a token costs in them."""

    layers: tuple[int, ...]  # global layer indices
    elements_per_token: int  # over all of these layers, the whole model (every head)
    window: AttentionWindow | None = None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """A model's KV groups: group 0 holds the full-attention layers (possibly none), the
    others are windowed."""

    groups: tuple[KVGroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups or self.groups[0].window is not None:
            raise ValueError("group 0 of a KV cache spec is the full-attention layers")
        if any(g.window is None for g in self.groups[1:]):
            raise ValueError("every KV group after the first has a window")

    @property
    def windows(self) -> tuple[AttentionWindow, ...]:
        """The windows of groups 1.."""
        return tuple(g.window for g in self.groups[1:])  # type: ignore[misc]

    def group_of_layer(self, num_layers: int) -> list[int]:
        """The group index of every global layer."""
        groups = [-1] * num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                groups[layer] = index
        if -1 in groups:
            raise ValueError(f"layer {groups.index(-1)} is in no KV group")
        return groups

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """What a token of context costs once its windows are full: the full layers'."""
        return self.groups[0].elements_per_token * dtype.itemsize


def kv_cache_spec_by_window(
    windows: list[AttentionWindow | None], elements_per_layer: list[int]
) -> KVCacheSpec:
    """The spec of a model whose layer i has window windows[i] (None: full attention) and
    keeps elements_per_layer[i] elements a token: one group per distinct window."""
    order: list[AttentionWindow | None] = [None]
    for window in windows:
        if window not in order:
            order.append(window)
    groups = []
    for window in order:
        layers = tuple(i for i, w in enumerate(windows) if w == window)
        elements = sum(elements_per_layer[i] for i in layers)
        groups.append(KVGroupSpec(layers, elements, window))
    return KVCacheSpec(tuple(groups))
