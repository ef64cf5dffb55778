"""Vocabulary-parallel token embedding and LM head: each tp rank holds a slice of the vocab.

The vocabulary is cut into tp equal slices of ceil(vocab / tp) rows; where it does not
divide, the last slices are padded with zero rows. The embedding sums each rank's rows of
the tokens it holds (all-reduce); the LM head all-gathers every rank's logits and drops
the padding columns, so every rank sees the whole vocabulary's logits. Either may hold its
rows as a quantized GGUF's blocks (`load_blocks`): the embedding then decodes only the
rows it looks up, and the head multiplies through the CPU kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infire.layers.linear import LinearBase, check_blocks
from infire.parallel import SINGLE, TensorParallelGroup

if TYPE_CHECKING:
    from infire.kernels.cpu_forward import GGUFBlocks, QuantWeight
    from infire.models.weights import LazyTensor


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (vocab entries) are split across the tp group."""

    quant: QuantWeight | None = None  # this rank's rows as GGUF blocks (`weight` empty)
    blocks_params = ("weight",)  # what load_blocks takes

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = min(vocab_size, tp.rank * per_rank)
        self.vocab_end = min(vocab_size, self.vocab_start + per_rank)
        self.per_rank = per_rank
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._rows(token_ids)
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(mine, token_ids - self.vocab_start, 0)
        out = self._rows(local) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def _rows(self, local: torch.Tensor) -> torch.Tensor:
        """The embedding rows of local ids, decoded from the blocks where it holds them."""
        if self.quant is None:
            return F.embedding(local, self.weight)
        from infire.kernels.cpu_forward import dequantize_gather

        rows = dequantize_gather(self.quant, local.reshape(-1), self.hidden_size)
        return rows.to(self.weight.dtype).reshape(*local.shape, self.hidden_size)

    def load_blocks(self, name: str, part: GGUFBlocks, shard_index: int = 0) -> None:
        """Hold this rank's vocab rows as GGUF blocks (a view; padding rows are not held)."""
        from infire.kernels.cpu_forward import QuantWeight, block_rows

        check_blocks(part, self.vocab_size, self.hidden_size)
        rows = block_rows(part, self.vocab_start, self.vocab_end - self.vocab_start)
        self.hold_quant(QuantWeight([rows]))

    def hold_quant(self, quant: QuantWeight) -> None:
        """Serve the rows from `quant` (shared by a tied head and embedding)."""
        self.quant = quant
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

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
        local = self.matmul(hidden)
        if local.shape[-1] < self.per_rank:  # blocks hold no padding rows
            local = F.pad(local, (0, self.per_rank - local.shape[-1]))
        logits = self.tp.all_gather_last_dim(local)
        return logits[..., : self.vocab_size]
