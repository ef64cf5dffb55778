"""The fused forward's kernels exported one at a time for Whisper's decoder: a dense linear
of bf16 tiles (dense_linear), attention over each sequence's own contiguous keys and values
(attend_dense) and over a paged cache (attend_paged), against PyTorch on the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infire.kernels.cpu_forward import (
    attend_dense,
    attend_paged,
    available,
    dense_addresses,
    dense_linear,
    tile_weight,
)

pytestmark = pytest.mark.skipif(
    not available(), reason="the CPU kernel needs AVX2 and a C compiler"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_matches_torch_and_not_the_batch(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=generator).to(dtype)  # rows not a multiple of 4
    bias = torch.randn(37, generator=generator)
    x = torch.randn(9, 96, generator=generator)
    got = dense_linear(tile_weight(weight), 37, x, bias)
    want = x.double() @ weight.double().T + bias.double()
    assert (got.double() - want).abs().max().item() <= 1e-5
    for n in (1, 2, 5):
        assert torch.equal(dense_linear(tile_weight(weight), 37, x[:n], bias), got[:n])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q [n, H, D] over k, v [H, S, D] in float64."""
    return F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double(), v.double(), attn_mask=mask, scale=scale
    ).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_dense_attention_matches_torch_and_not_the_batch(head_dim: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    keys = (1500, 7, 70)  # each sequence its own number of keys
    k = [(torch.randn(4, s, head_dim, generator=generator) * 2).to(dtype) for s in keys]
    v = [torch.randn(4, s, head_dim, generator=generator).to(dtype) for s in keys]
    q = torch.randn(6, 4, head_dim, generator=generator)
    seq = torch.tensor([0, 2, 1, 0, 2, 2])
    scale = head_dim**-0.5
    addresses, counts = dense_addresses(k, v), torch.tensor(keys)
    got = attend_dense(q, addresses, counts, dtype == torch.bfloat16, seq, scale)
    for i, s in enumerate(seq.tolist()):
        want = _reference(q[i : i + 1], k[s], v[s], scale)
        assert (got[i : i + 1].double() - want).abs().max().item() <= 1e-5
    # a query's result does not depend on the others in its call
    assert torch.equal(
        attend_dense(q[3:5], addresses, counts, dtype == torch.bfloat16, seq[3:5], scale), got[3:5]
    )
    with pytest.raises(ValueError, match="one dtype"):
        dense_addresses([k[0].half(), *k[1:]], v)
    with pytest.raises(ValueError, match="contiguous"):
        dense_addresses([k[0].transpose(1, 2).contiguous().transpose(1, 2), *k[1:]], v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_reads_each_sequences_blocks(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    blocks, block_size, heads, head_dim = 12, 4, 2, 64
    k = torch.randn(blocks, block_size, heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(blocks, block_size, heads, head_dim, generator=generator).to(dtype)
    tables = torch.tensor([[7, 2, 9, 0], [3, 11, 0, 0]], dtype=torch.int32)  # scattered blocks
    # sequence 0: queries at positions 9, 10 (a chunk); sequence 1: one at position 5
    seq, positions = torch.tensor([0, 0, 1]), torch.tensor([9, 10, 5])
    q = torch.randn(3, heads, head_dim, generator=generator)
    got = attend_paged(q, k, v, tables, seq, positions + 1, head_dim**-0.5)
    for i in range(3):
        table, count = tables[seq[i]], int(positions[i]) + 1
        slots = torch.arange(count)
        rows = k[table[slots // block_size].long(), slots % block_size]  # [count, H, D]
        vals = v[table[slots // block_size].long(), slots % block_size]
        want = _reference(q[i : i + 1], rows.transpose(0, 1), vals.transpose(0, 1), head_dim**-0.5)
        assert (got[i : i + 1].double() - want).abs().max().item() <= 1e-5
    assert torch.equal(
        attend_paged(q[2:], k, v, tables, seq[2:], positions[2:] + 1, 0.125), got[2:]
    )
