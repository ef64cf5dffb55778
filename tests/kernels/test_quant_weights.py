"""GGUF blocks in the fused forward's kernel: every type decodes to exactly the values of
the `gguf` package's dequantize (the reference), and the kernel's products equal NumPy's
on those values within float32 summation error, whatever the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from infire.kernels.cpu_forward import QuantWeight, available, dequantize_rows, quant_linear
from kquants import quantize as quantize_k

pytestmark = pytest.mark.skipif(not available(), reason="no fused CPU kernel here")

LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
TYPES = [T.F32, T.F16, T.BF16, *LEGACY, *K_QUANTS]


def blocks(values: np.ndarray, qtype: T) -> np.ndarray:
    """[rows, cols] float32 -> [rows, row_bytes] uint8 in `qtype`'s layout."""
    if qtype in K_QUANTS:
        return quantize_k(values, qtype)
    if qtype == T.F32:
        return values.astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        bits = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
        return bits.view(np.uint8)
    return quantize(values, qtype)


def weight(values: np.ndarray, qtype: T) -> tuple[QuantWeight, np.ndarray]:
    """The QuantWeight of `values` in `qtype`, and the reference's decoded values."""
    packed = blocks(values, qtype)
    reference = dequantize(packed, qtype).reshape(values.shape).astype(np.float32)
    return QuantWeight([(int(qtype), torch.from_numpy(np.ascontiguousarray(packed)))]), reference


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_decodes_to_the_reference_bit_for_bit(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((12, 512)) * rng.uniform(0.01, 2, (12, 1))).astype(np.float32)
    values[3] = 0.0  # an all-zero row (a zero scale)
    values[5, :256] = np.abs(values[5, :256])  # a block with no negative value
    w, reference = weight(values, qtype)
    decoded = dequantize_rows(w, 0, 12, 512).numpy()
    assert np.array_equal(decoded.view(np.uint32), reference.view(np.uint32))
    assert np.array_equal(dequantize_rows(w, 7, 3, 512).numpy(), reference[7:10])


# |kernel - float64 reference| <= TOLERANCE * sum_k |w_k x_k|: float32 accumulation over
# 512 products (the kernel's 8-lane partial sums and their reduction), whatever the type
TOLERANCE = 512 * np.finfo(np.float32).eps


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_numpy_and_do_not_depend_on_the_batch(qtype: T) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    values = (rng.standard_normal((40, 512)) * 0.1).astype(np.float32)
    w, reference = weight(values, qtype)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    exact = x.astype(np.float64) @ reference.astype(np.float64).T
    bound = TOLERANCE * (np.abs(x) @ np.abs(reference).T)
    assert np.all(np.abs(y - exact) <= bound)
    for n in (1, 2, 5):  # a token's result is the same alone or in any batch
        alone = quant_linear(w, torch.from_numpy(x[:n])).numpy()
        assert np.array_equal(alone, y[:n])


def test_a_weight_of_parts_with_different_types() -> None:
    """q|k|v fused where v has another type (as in Q4_K_M files)."""
    rng = np.random.default_rng(7)
    pieces = [(rng.standard_normal((rows, 256)) * 0.1).astype(np.float32) for rows in (16, 8, 8)]
    types = [T.Q4_K, T.Q4_K, T.Q6_K]
    parts, references = [], []
    for values, qtype in zip(pieces, types, strict=True):
        packed = blocks(values, qtype)
        parts.append((int(qtype), torch.from_numpy(np.ascontiguousarray(packed))))
        references.append(dequantize(packed, qtype).reshape(values.shape))
    w = QuantWeight(parts)
    reference = np.concatenate(references).astype(np.float32)
    assert np.array_equal(dequantize_rows(w, 0, 32, 256).numpy(), reference)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    assert np.allclose(y, x @ reference.T, rtol=1e-5, atol=1e-5)


def test_the_test_quantizer_is_close_to_its_input() -> None:
    """The K-quant blocks these tests write are real quantizations, not noise."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    bound = {T.Q4_K: 0.07, T.Q5_K: 0.035, T.Q6_K: 0.02}
    for qtype, relative in bound.items():
        decoded = dequantize(quantize_k(values, qtype), qtype).reshape(values.shape)
        assert np.abs(decoded - values).max() <= relative * np.abs(values).max(), qtype.name
