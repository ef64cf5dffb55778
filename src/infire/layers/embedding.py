"""Vocabulary-parallel token embedding and LM head: each tp rank holds a slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infire.layers.linear import LinearBase
from infire.parallel import SINGLE, TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (vocab entries) are split across the tp group."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * per_rank
        self.vocab_end = min(vocab_size, self.vocab_start + per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(mine, token_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def load_shard(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        """Copy this rank's vocab rows from the full embedding matrix."""
        rows = loaded[self.vocab_start : self.vocab_end]
        self.weight.data[: rows.shape[0]].copy_(rows)
        self.weight.data[rows.shape[0] :].zero_()


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Output projection to vocab logits; may share its weight with the embedding (tied).

    Packing it for oneDNN unties it: the embedding keeps its own rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(self.matmul(hidden))
        return logits[..., : self.vocab_size]
