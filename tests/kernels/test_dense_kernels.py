"""The fused forward's kernels exported one at a time for Whisper's decoder: a dense linear
of bf16 tiles (dense_linear) and attention over contiguous bf16 keys and values
(attend_dense_bf16), against PyTorch on the same bf16 values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infire.kernels.cpu_forward import attend_dense_bf16, available, dense_linear, tile_weight

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


@pytest.mark.parametrize("head_dim", [64, 32])
def test_dense_attention_matches_torch_and_not_the_batch(head_dim: int) -> None:
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 2, head_dim, generator=generator)
    k = (torch.randn(3, 4, 1500, head_dim, generator=generator) * 2).bfloat16()
    v = torch.randn(3, 4, 1500, head_dim, generator=generator).bfloat16()
    scale = head_dim**-0.5
    got = attend_dense_bf16(q, k, v, scale)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    assert (got.double() - want).abs().max().item() <= 1e-5
    assert torch.equal(attend_dense_bf16(q[1:2], k[1:2], v[1:2], scale), got[1:2])
    with pytest.raises(ValueError, match="bf16"):
        attend_dense_bf16(q, k.float(), v, scale)
