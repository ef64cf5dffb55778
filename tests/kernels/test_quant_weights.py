"""GGUF blocks in the fused forward's kernel: every type decodes to exactly the values of
the `gguf` package's dequantize (the reference), and the kernel's products equal NumPy's
of the same arithmetic (int8 activations per 32 values for the legacy types, per 256 for
the K-quants) within float32 rounding, bit for bit the same whatever the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from emulated import EMULATED_ISAS, native, use_emulated
from infire.kernels.cpu_forward import (
    QuantWeight,
    available,
    block_columns,
    block_rows,
    can_interleave,
    dequantize_rows,
    interleave_rows,
    quant_isa,
    quant_linear,
)
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
    return QuantWeight(
        [(int(qtype), torch.from_numpy(np.ascontiguousarray(packed)), None)]
    ), reference


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


def quantized_activations(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x as the kernel quantizes it, per `block` values (32 for legacy types, 256 for
    K-quants): codes rint(x / d), d = max|x| / 127 (float32 arithmetic, as the kernel's),
    returned as d * code."""
    blocks = x.reshape(len(x), -1, block).astype(np.float32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse)
    return (codes.astype(np.float64) * d).reshape(x.shape)


# |kernel - float64 reference| <= TOLERANCE * sum_k |w_k x_k|: float32 rounding of the
# per-block scales and of the running sum over 512 products
TOLERANCE = 64 * np.finfo(np.float32).eps


def isas() -> list[str]:
    """The instruction sets of the products: those this CPU runs (AVX2 always), and the
    others emulated (tests/emulated.py)."""
    return [isa if native(isa) else f"{isa} emulated" for isa in ("avx2", *EMULATED_ISAS)]


@pytest.fixture(params=isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    name = request.param.removesuffix(" emulated")
    if name != request.param:
        use_emulated(monkeypatch, name)
    assert quant_isa(name) == name
    yield name
    quant_isa()  # back to the best


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_numpy_and_do_not_depend_on_the_batch(qtype: T, isa: str) -> None:
    """Quantized types multiply int8-quantized activations (llama.cpp's arithmetic), the
    F32/F16/BF16 ones fp32 activations: the reference does the same in float64. For each
    instruction set the CPU has; 37 tokens and odd row counts take every path."""
    rng = np.random.default_rng(100 + int(qtype))
    values = (rng.standard_normal((41, 800)) * 0.1).astype(np.float32)  # 25 blocks of 32
    if qtype in K_QUANTS:
        values = values[:, :512]
    w, reference = weight(values, qtype)
    x = rng.standard_normal((37, values.shape[1])).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    if qtype in (T.F32, T.F16, T.BF16):
        xs = x.astype(np.float64)
    else:
        xs = quantized_activations(x, 256 if qtype in K_QUANTS else 32)
    exact = xs @ reference.astype(np.float64).T
    bound = TOLERANCE * (np.abs(xs) @ np.abs(reference.astype(np.float64)).T) + 1e-30
    assert np.all(np.abs(y - exact) <= bound), np.abs(y - exact).max()
    # a token's result is the same alone or in any batch (a block of 32 tokens takes the
    # wide kernels, Q6_K's from 12 tokens with 16 lanes, Q4_K's from 30)
    for n in (1, 2, 5, 13, 30, 33):
        alone = quant_linear(w, torch.from_numpy(x[:n])).numpy()
        assert np.array_equal(alone, y[:n])


def test_q6_k_extremes_alone_and_in_a_batch() -> None:
    """Q6_K's 6-bit codes at 0 and 63 and scales at -128 and 127 against activations at
    +-127: the batch kernel's 16-bit sums (8 values' (u - 32) x each, from the tokens'
    offsets -32 sum x up through the products u x, wrapping on the way) reach 32512. Every
    token's products equal its own alone and the reference's."""
    rng = np.random.default_rng(11)
    rows, cols = 24, 512
    packed = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    packed[0:8, :, :192] = 0  # every code 0
    packed[8:16, :, :192] = 0xFF  # every code 63
    packed[0::2, :, 192:208] = np.array(-128, np.int8).view(np.uint8)  # the 16s' scales
    packed[1::2, :, 192:208] = 127
    packed[:, :, 208:210] = np.array([0.002], np.float16).view(np.uint8)
    packed = packed.reshape(rows, -1)
    reference = dequantize(packed, T.Q6_K).reshape(rows, cols).astype(np.float64)
    w = QuantWeight([(int(T.Q6_K), torch.from_numpy(np.ascontiguousarray(packed)), None)])
    x = rng.choice(np.array([-1.0, 1.0], np.float32), (32, cols))
    x[0], x[1] = 1.0, -1.0  # every code 127, every code -127
    x[2] = rng.standard_normal(cols).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    xs = quantized_activations(x, 256)
    error = np.abs(y - xs @ reference.T)
    assert np.all(error <= TOLERANCE * (np.abs(xs) @ np.abs(reference).T)), error.max()
    for t in (0, 1, 2, 31):
        assert np.array_equal(quant_linear(w, torch.from_numpy(x[t : t + 1])).numpy(), y[t : t + 1])


def test_a_weight_of_parts_with_different_types_and_a_row_order() -> None:
    """q|k|v fused where v has another type (as in Q4_K_M files), and k's rows stored in
    another order (llama.cpp's q/k permutation), read through a row index."""
    rng = np.random.default_rng(7)
    pieces = [(rng.standard_normal((rows, 256)) * 0.1).astype(np.float32) for rows in (16, 8, 8)]
    types = [T.Q4_K, T.Q4_K, T.Q6_K]
    parts, references = [], []
    for i, (values, qtype) in enumerate(zip(pieces, types, strict=True)):
        packed = blocks(values, qtype)
        reference = dequantize(packed, qtype).reshape(values.shape)
        index = None
        if i == 1:  # stored shuffled: row r at index[r]
            index = rng.permutation(len(values)).astype(np.int32)
            stored = np.empty_like(packed)
            stored[index] = packed
            packed, index = stored, torch.from_numpy(index)
        parts.append((int(qtype), torch.from_numpy(np.ascontiguousarray(packed)), index))
        references.append(reference)
    w = QuantWeight(parts)
    reference = np.concatenate(references).astype(np.float32)
    assert np.array_equal(dequantize_rows(w, 0, 32, 256).numpy(), reference)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    assert np.allclose(y, quantized_activations(x, 256) @ reference.T, rtol=1e-5, atol=1e-5)


def test_the_test_quantizer_is_close_to_its_input() -> None:
    """The K-quant blocks these tests write are real quantizations, not noise."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    bound = {T.Q4_K: 0.07, T.Q5_K: 0.035, T.Q6_K: 0.02}
    for qtype, relative in bound.items():
        decoded = dequantize(quantize_k(values, qtype), qtype).reshape(values.shape)
        assert np.abs(decoded - values).max() <= relative * np.abs(values).max(), qtype.name


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_tensor_parallel_shards_cut_on_block_boundaries(qtype: T) -> None:
    """A column-parallel rank's rows multiply bit for bit as in the whole weight; a
    row-parallel rank's columns (views whose rows lie further apart than their bytes)
    multiply bit for bit as the same columns copied out, and the ranks' partial sums add
    up to the whole product; a cut inside a block is refused."""
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((24, 1024)) * 0.1).astype(np.float32)
    w, _ = weight(values, qtype)
    part = w.parts_blocks[0]
    x = torch.from_numpy(rng.standard_normal((5, 1024)).astype(np.float32))
    whole = quant_linear(w, x)
    rows = [quant_linear(QuantWeight([block_rows(part, r, 8)]), x) for r in (0, 8, 16)]
    assert torch.equal(torch.cat(rows, dim=1), whole)
    partials = []
    for start in (0, 512):
        view = block_columns(part, start, 512)
        copied = (view[0], view[1].contiguous(), None)
        assert view[1].stride(0) > view[1].shape[1]
        y = quant_linear(QuantWeight([view]), x[:, start : start + 512].contiguous())
        assert torch.equal(y, quant_linear(QuantWeight([copied]), x[:, start : start + 512]))
        partials.append(y)
    assert torch.allclose(partials[0] + partials[1], whole, rtol=1e-4, atol=1e-4)
    values_per_block = 256 if qtype in K_QUANTS else 32
    with pytest.raises(ValueError, match=f"blocks of {values_per_block} values"):
        block_columns(part, values_per_block // 2, 512)


@pytest.mark.parametrize("qtype", [*LEGACY, *K_QUANTS], ids=lambda t: t.name)
def test_the_vnni_products_equal_avx2s_bit_for_bit(
    qtype: T, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 256-bit VNNI instructions compute the same integers as AVX2's multiply-adds
    (in AVX512-VNNI's 256-bit form where the CPU has no AVX-VNNI: the same code; emulated
    where it has neither)."""
    if not native("avx-vnni"):
        use_emulated(monkeypatch, "avx-vnni")
    rng = np.random.default_rng(200 + int(qtype))
    values = (rng.standard_normal((18, 512)) * 0.1).astype(np.float32)
    values[0, :32] = -values[0, :32].max()  # Q8_0 codes at -127 (and -128 in a block)
    w, _ = weight(values, qtype)
    if qtype == T.Q8_0:
        w.parts_blocks[0][1][1, 2:4] = torch.tensor([128, 128], dtype=torch.uint8)  # -128
    x = torch.from_numpy(rng.standard_normal((7, 512)).astype(np.float32))
    try:
        quant_isa("avx2")
        want = quant_linear(w, x)
        assert quant_isa("avx-vnni") == "avx-vnni"
        got = quant_linear(w, x)
    finally:
        quant_isa()
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_rows_interleaved_in_groups_of_16_hold_the_same_blocks(qtype: T, isa: str) -> None:
    """A part copied into groups of 16 rows (read through its row index, as q/k are) takes
    the same bytes, decodes to the reference bit for bit, and multiplies as the plain
    blocks do, within the same tolerance and whatever the batch, next to a plain part of
    an odd number of rows of another type. The forward leaves Q4_K's rows as they are
    where AVX512-VNNI's products are in use; they multiply in groups all the same."""
    rng = np.random.default_rng(200 + int(qtype))
    cols, block = (768, 256) if qtype in K_QUANTS else (800, 32)
    values = (rng.standard_normal((48, cols)) * 0.1).astype(np.float32)  # 3 groups
    packed = blocks(values, qtype)
    index = rng.permutation(len(values)).astype(np.int32)
    stored = np.empty_like(packed)
    stored[index] = packed
    part = (int(qtype), torch.from_numpy(stored), torch.from_numpy(index))
    assert can_interleave(part) == (qtype != T.Q4_K or isa != "avx512-vnni")
    grouped = interleave_rows(part)
    assert grouped[1].shape == stored.shape and grouped[2] is None
    assert not np.array_equal(grouped[1].numpy(), packed)  # reordered
    tail = (rng.standard_normal((5, cols)) * 0.1).astype(np.float32)
    w = QuantWeight([grouped, (int(T.Q5_0), torch.from_numpy(blocks(tail, T.Q5_0)), None)],
                    [True, False])  # fmt: skip
    reference = np.concatenate(
        [dequantize(packed, qtype).reshape(values.shape), weight(tail, T.Q5_0)[1]]
    ).astype(np.float64)
    assert np.array_equal(dequantize_rows(w, 0, 53, cols).numpy(), reference.astype(np.float32))
    x = rng.standard_normal((37, cols)).astype(np.float32)
    y = quant_linear(w, torch.from_numpy(x)).numpy()
    for rows, size in ((slice(0, 48), block), (slice(48, 53), 32)):
        xs = quantized_activations(x, size)
        exact = xs @ reference[rows].T
        bound = TOLERANCE * (np.abs(xs) @ np.abs(reference[rows]).T) + 1e-30
        assert np.all(np.abs(y[:, rows] - exact) <= bound), np.abs(y[:, rows] - exact).max()
    for n in (1, 2, 9, 30, 33):
        assert np.array_equal(quant_linear(w, torch.from_numpy(x[:n])).numpy(), y[:n])


def test_units_taken_in_any_runs_give_the_same_products_bit_for_bit() -> None:
    """A linear's threads take units (groups of 16 interleaved rows, pairs of others) in
    runs, a thread done with its own share taking the rest of another's from its back:
    cut anywhere (inside a part, a window of 16 rows, the Q6_K kernel's passes of 16 rows)
    and taken last run first, the units give exactly the products of the whole weight, with
    a bias and added into an output (as o_proj and down add into the residual) too."""
    rng = np.random.default_rng(41)
    cols = 512
    grouped = interleave_rows(
        (int(T.Q4_K), torch.from_numpy(blocks(rng.standard_normal((48, cols)) * 0.1, T.Q4_K)), None)
    )
    parts = [grouped if can_interleave(grouped) else (grouped[0], grouped[1], None)]
    for rows, qtype in ((37, T.Q6_K), (5, T.Q5_0)):
        values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        parts.append((int(qtype), torch.from_numpy(blocks(values, qtype)), None))
    w = QuantWeight(parts, [can_interleave(grouped), False, False])
    units = (3 if can_interleave(grouped) else 24) + 19 + 3
    x = torch.from_numpy(rng.standard_normal((37, cols)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(w.rows).astype(np.float32))
    for n in (1, 12, 32, 37):
        whole = quant_linear(w, x[:n])
        assert torch.equal(quant_linear(w, x[:n], [0, units]), whole)
        with_bias = quant_linear(w, x[:n], bias=bias)
        assert torch.equal(with_bias, whole + bias)
        with pytest.raises(ValueError, match="bias of"):
            quant_linear(w, x[:n], bias=bias[1:])
        residual = torch.from_numpy(rng.standard_normal((n, w.rows)).astype(np.float32))
        for _ in range(4):
            cuts = sorted(rng.choice(np.arange(1, units), size=6, replace=False).tolist())
            assert torch.equal(quant_linear(w, x[:n], [0, *cuts, units]), whole), (n, cuts)
            assert torch.equal(quant_linear(w, x[:n], [0, *cuts, units], bias), with_bias)
            added = quant_linear(w, x[:n], [0, *cuts, units], bias, out=residual.clone())
            assert torch.equal(added, residual + with_bias), (n, cuts)


def test_only_whole_rows_in_sixteens_of_some_types_interleave() -> None:
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((32, 512)) * 0.1).astype(np.float32)
    q4 = (int(T.Q4_0), torch.from_numpy(blocks(values, T.Q4_0)), None)
    assert can_interleave(q4)
    assert not can_interleave(block_rows(q4, 0, 24))  # 24 rows
    assert not can_interleave(block_columns(q4, 0, 256))  # a tensor-parallel rank's columns
    assert not can_interleave((int(T.Q5_K), torch.from_numpy(blocks(values, T.Q5_K)), None))
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_rows(block_rows(q4, 0, 24))
