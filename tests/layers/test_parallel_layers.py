"""Tensor-parallel layers, every rank of a group simulated in one process: each rank reads
only its slice of the checkpoint, and the ranks' partial results combine (sum, concat) to
exactly what the unsplit layer computes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from infire.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from infire.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from infire.models.weights import DictSource
from infire.parallel import TensorParallelGroup


@dataclass(frozen=True, slots=True)
class LocalGroup(TensorParallelGroup):
    """Rank `rank` of `world_size`, collectives left to the test to do across ranks."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x


class RecordingSource(DictSource):
    """A DictSource that notes every (name, dim, start, length) read."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(weights)
        self.reads: list[tuple[str, int, int, int]] = []

    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append((name, dim, start, length))
        return super()._read(name, dim, start, length)


def _ranks(tp: int) -> list[LocalGroup]:
    return [LocalGroup(rank, tp) for rank in range(tp)]


@pytest.fixture
def g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_merged_gate_up(tp: int, g: torch.Generator):
    gate, up = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    source = RecordingSource({"gate": gate, "up": up})
    x = torch.randn(3, 8, generator=g)
    outs = []
    for group in _ranks(tp):
        layer = ColumnParallelLinear(8, [16, 16], tp=group)
        layer.load_shard("weight", source.get_slice("gate"), 0)
        layer.load_shard("weight", source.get_slice("up"), 1)
        outs.append(layer(x).chunk(2, dim=-1))
    assert torch.allclose(torch.cat([o[0] for o in outs], -1), x @ gate.T, atol=1e-6)
    assert torch.allclose(torch.cat([o[1] for o in outs], -1), x @ up.T, atol=1e-6)
    # each rank read 16 / tp rows of each, never the whole tensor (unless tp is 1)
    assert {(dim, length) for _, dim, _, length in source.reads} == {(0, 16 // tp)}


@pytest.mark.parametrize(("heads", "kv", "tp"), [(4, 2, 2), (4, 2, 4), (4, 1, 2), (8, 4, 2)])
def test_qkv_splits_heads_and_replicates_kv(heads: int, kv: int, tp: int, g: torch.Generator):
    head_dim, hidden = 4, 8
    q = torch.randn(heads * head_dim, hidden, generator=g)
    k, v = (torch.randn(kv * head_dim, hidden, generator=g) for _ in range(2))
    bias = {n: torch.randn(w.shape[0], generator=g) for n, w in (("q", q), ("k", k), ("v", v))}
    source = DictSource({"q": q, "k": k, "v": v, **{f"{n}.b": b for n, b in bias.items()}})
    x = torch.randn(3, hidden, generator=g)
    full_q, full_k, full_v = (F.linear(x, w, bias[n]) for n, w in (("q", q), ("k", k), ("v", v)))
    for group in _ranks(tp):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv, bias=True, tp=group)
        for shard, name in enumerate("qkv"):
            layer.load_shard("weight", source.get_slice(name), shard)
            layer.load_shard("bias", source.get_slice(f"{name}.b"), shard)
        out = layer(x).view(3, -1, head_dim)
        local_q, local_kv = heads // tp, max(1, kv // tp)
        assert (layer.num_heads, layer.num_kv_heads) == (local_q, local_kv)
        q_heads = range(group.rank * local_q, (group.rank + 1) * local_q)
        first_kv = group.rank * kv // tp if kv < tp else group.rank * local_kv
        assert torch.allclose(out[:, :local_q], full_q.view(3, heads, head_dim)[:, q_heads])
        for i, full in ((1, full_k), (2, full_v)):
            part = out[:, local_q + (i - 1) * local_kv : local_q + i * local_kv]
            want = full.view(3, kv, head_dim)[:, first_kv : first_kv + local_kv]
            assert torch.allclose(part, want)
        # every q head of this rank attends with the KV head the full model pairs it with
        assert {h * kv // heads for h in q_heads} <= set(range(first_kv, first_kv + local_kv))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_partial_sums(tp: int, g: torch.Generator):
    w, b = torch.randn(6, 16, generator=g), torch.randn(6, generator=g)
    source = RecordingSource({"w": w, "b": b})
    x = torch.randn(3, 16, generator=g)
    total = torch.zeros(3, 6)
    for group in _ranks(tp):
        layer = RowParallelLinear(16, 6, bias=True, tp=group)
        layer.load_shard("weight", source.get_slice("w"))
        layer.load_shard("bias", source.get_slice("b"))
        assert layer.weight.shape == (6, 16 // tp)
        part = x[:, layer.input_start : layer.input_start + layer.input_size]
        total += layer.matmul(part)
        bias = layer.bias
    assert torch.allclose(total + bias, F.linear(x, w, b), atol=1e-5)
    assert {(n, d, ln) for n, d, _, ln in source.reads if n == "w"} == {("w", 1, 16 // tp)}


@pytest.mark.parametrize(("vocab", "tp"), [(12, 2), (10, 4), (5, 4), (7, 3)])
def test_vocab_parallel_embedding_and_head_pad_and_drop(vocab: int, tp: int, g: torch.Generator):
    table = torch.randn(vocab, 4, generator=g)
    source = DictSource({"e": table})
    ids = torch.arange(vocab).flip(0)
    hidden = torch.randn(3, 4, generator=g)
    embedded = torch.zeros(vocab, 4)
    logits = []
    for group in _ranks(tp):
        embed = VocabParallelEmbedding(vocab, 4, tp=group)
        embed.load_shard("weight", source.get_slice("e"))
        assert embed.weight.shape[0] == -(-vocab // tp)  # padded to equal slices
        embedded += embed(ids)
        head = ParallelLMHead(vocab, 4, tp=group)
        head.load_shard("weight", source.get_slice("e"))
        logits.append(head.matmul(hidden))
    assert torch.equal(embedded, table[ids])
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape[-1] == tp * -(-vocab // tp)
    assert torch.allclose(gathered[:, :vocab], hidden @ table.T, atol=1e-6)
    assert torch.equal(gathered[:, vocab:], torch.zeros(3, gathered.shape[-1] - vocab))


def test_a_wrong_shape_is_refused():
    layer = ColumnParallelLinear(8, [16], tp=LocalGroup(0, 2))
    with pytest.raises(ValueError, match=r"expected shape \[16, 8\], got \[16, 6\]"):
        layer.load_shard("weight", DictSource({"w": torch.zeros(16, 6)}).get_slice("w"))
