"""Vocabulary-parallel token embedding and LM head: each tp rank holds a slice of the vocab.

The vocabulary is cut into tp equal slices of ceil(vocab / tp) rows; where it does not
divide, the last slices are padded with zero rows. The embedding sums each rank's rows of
the tokens it holds (all-reduce); the LM head all-gathers every rank's logits and drops
the padding columns, so every rank sees the whole vocabulary's logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infire.layers.linear import LinearBase
from infire.parallel import SINGLE, TensorParallelGroup

if TYPE_CHECKING:
    from infire.models.weights import LazyTensor


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (vocab entries) are split across the tp group."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = min(vocab_size, tp.rank * per_rank)
        self.vocab_end = min(vocab_size, self.vocab_start + per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(mine, token_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """Read this rank's vocab rows of the full embedding matrix (padding rows zeroed)."""
        expected = (self.vocab_size, self.weight.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{name}: expected shape {list(expected)}, got {list(loaded.shape)}")
        count = self.vocab_end - self.vocab_start
        if count:
            loaded.read_into(self.weight.data[:count], 0, self.vocab_start, count)
        self.weight.data[count:].zero_()


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Output projection to vocab logits; may share its weight with the embedding (tied).

    Packing it for oneDNN unties it: the embedding keeps its own rows."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(self.matmul(hidden))
        return logits[..., : self.vocab_size]
