"""Unweight: lossless compression of model weights (container.py has the model folder).

A float tensor is split into its exponent field (entropy-coded) and the rest (sign and
mantissa, kept raw). Two forms:

- `rans` (distribution form; BF16, FP16, FP32): the exponents rANS-coded in
  independently decodable chunks of 8 interleaved streams (rans.py), the rest bytes as
  they are.
- `palette` (inference form; BF16): 12 bits per weight, rebuilt without branches
  (palette.py).

Other dtypes are stored `raw`. Every compressed tensor records the SHA-256 and the CRC32
of the original bytes; decompressing checks one (CRC32 when loading: it runs at memory
speed; SHA-256 when verifying), so damage is reported, never served.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from infire.errors import InfireError
from infire.unweight import palette, rans

FORMS = ("rans", "palette", "raw")
CHECKS = ("crc32", "sha256")


class UnweightError(InfireError):
    """A compressed tensor that cannot be decoded to its recorded original."""


# dtype -> (uint view, exponent shift = mantissa bits, exponent mask)
_FIELDS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.bfloat16: (torch.uint16, 7, 0xFF),
    torch.float16: (torch.uint16, 10, 0x1F),
    torch.float32: (torch.uint32, 23, 0xFF),
}
_NUMPY_UINT = {torch.uint16: np.uint16, torch.uint32: np.uint32}


@dataclass(slots=True)
class CompressedTensor:
    """One tensor in compressed form: named uint8-viewable arrays plus JSON metadata."""

    form: str  # rans | palette | raw
    dtype: str  # the original torch dtype's name, e.g. "bfloat16"
    shape: tuple[int, ...]
    sha256: str  # of the original bytes (little-endian, C order)
    crc32: int  # zlib.crc32 of the same bytes
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the metadata not counted)."""
        return sum(a.nbytes for a in self.arrays.values())


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnweightError(f"unknown dtype {name!r}")
    return dtype


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, dtype=np.uint8)


def compress_tensor(t: torch.Tensor, form: str = "rans") -> CompressedTensor:
    """Compress one tensor losslessly (palette applies to BF16; other floats use rans;
    `raw` stores the bytes as they are)."""
    if form not in FORMS:
        raise UnweightError(f"unknown form {form!r} (expected one of {', '.join(FORMS)})")
    raw = _raw_bytes(t)
    base = dict(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                sha256=hashlib.sha256(raw).hexdigest(), crc32=zlib.crc32(raw))  # fmt: skip
    if form == "raw" or t.dtype not in _FIELDS or t.numel() == 0:
        return CompressedTensor("raw", **base, arrays={"data": raw})
    uint, shift, mask = _FIELDS[t.dtype]
    bits = raw.view(_NUMPY_UINT[uint])
    exponent = ((bits >> shift) & mask).astype(np.uint8)
    counts = np.bincount(exponent, minlength=256)
    stats = {"exponent_entropy": _entropy(counts)}
    if form == "palette" and t.dtype == torch.bfloat16:
        p = palette.encode(bits)
        arrays = {"palette": p.palette, "indices": p.indices, "rest": p.rest, "rows": p.rows,
                  "verbatim": p.verbatim}  # fmt: skip
        stats["palette_coverage"] = float(counts[p.palette].sum() / len(bits))
        stats["verbatim_row_share"] = len(p.rows) / max(1, len(p.rest) // palette.ROW)
        return CompressedTensor("palette", **base, arrays=arrays,
                                meta={"row": palette.ROW, **stats})  # fmt: skip
    rest = bits & ~np.array(mask << shift, dtype=bits.dtype)  # sign and mantissa in place
    rest = _pack_rest(rest, shift)
    encoded = rans.encode(exponent, rans.quantize(counts))
    arrays = {"stream": encoded.stream, "offsets": encoded.offsets, "rest": rest}
    meta = {"frequencies": {int(s): int(encoded.frequencies[s])
                            for s in np.flatnonzero(encoded.frequencies)},
            "chunk_symbols": encoded.chunk, **stats}  # fmt: skip
    return CompressedTensor("rans", **base, arrays=arrays, meta=meta)


def _entropy(counts: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of a histogram."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _pack_rest(rest: np.ndarray, shift: int) -> np.ndarray:
    """Sign and mantissa (shift + 1 bits a weight): whole low bytes, then the leftover high
    bits of every weight packed MSB-first (FP16: one byte and 3 bits a weight)."""
    if rest.dtype == np.uint16 and shift == 7:  # BF16, the common case, in one pass
        return (((rest >> 8) & 0x80) | (rest & 0x7F)).astype(np.uint8)
    width = rest.dtype.itemsize * 8
    value = ((rest >> (width - 1)).astype(np.uint32) << shift) | (rest & ((1 << shift) - 1))
    value = value.astype(np.uint32)
    whole, extra = divmod(shift + 1, 8)
    low = value.view(np.uint8).reshape(-1, 4)[:, :whole].reshape(-1)
    if not extra:
        return low.copy()
    high = (value >> (8 * whole)).astype(np.uint8)
    bits = (high[:, None] >> np.arange(extra - 1, -1, -1, dtype=np.uint8)) & 1
    return np.concatenate([low, np.packbits(bits.reshape(-1))])


def _unpack_rest(data: np.ndarray, shift: int, count: int, uint: type) -> np.ndarray:
    width = np.dtype(uint).itemsize * 8
    whole, extra = divmod(shift + 1, 8)
    padded = np.zeros((count, 4), dtype=np.uint8)
    padded[:, :whole] = data[: count * whole].reshape(count, whole)
    value = padded.view(np.uint32).reshape(-1)
    if extra:
        bits = np.unpackbits(data[count * whole :])[: count * extra].reshape(count, extra)
        high = (bits.astype(np.uint32) << np.arange(extra - 1, -1, -1, dtype=np.uint32)).sum(1)
        value = value | (high.astype(np.uint32) << (8 * whole))
    sign = (value >> shift).astype(uint)
    mantissa = (value & ((1 << shift) - 1)).astype(uint)
    return (sign << (width - 1)) | mantissa


def _rest_nbytes(shift: int, count: int) -> int:
    whole, extra = divmod(shift + 1, 8)
    return count * whole + (count * extra + 7) // 8


def decompress_tensor(
    c: CompressedTensor, name: str = "tensor", check: str = "crc32"
) -> torch.Tensor:
    """The original tensor, bit for bit (checked against the recorded CRC32 or SHA-256);
    UnweightError naming `name` if it cannot be."""
    if check not in CHECKS:
        raise UnweightError(f"unknown check {check!r} (expected one of {', '.join(CHECKS)})")
    dtype = _dtype(c.dtype)
    try:
        raw, crc = _decode(c, dtype, name)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise UnweightError(f"{name}: malformed {c.form} data ({type(e).__name__}: {e})") from None
    except rans.CorruptStreamError as e:
        raise UnweightError(str(e)) from None
    expected = math.prod(c.shape) * dtype.itemsize
    if raw.size != expected:
        raise UnweightError(f"{name}: {raw.size} bytes decoded for shape {list(c.shape)}")
    if check == "crc32" and (zlib.crc32(raw) if crc is None else crc) != c.crc32:
        raise UnweightError(f"{name}: decompressed bytes do not match the recorded CRC32")
    if check == "sha256" and hashlib.sha256(raw).hexdigest() != c.sha256:
        raise UnweightError(f"{name}: decompressed bytes do not match the recorded SHA-256")
    if raw.size == 0:
        return torch.empty(c.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(c.shape)


def rans_encoded(c: CompressedTensor, name: str = "tensor") -> rans.Encoded:
    """A `rans` tensor's stream as the decoders take it (its frequencies checked)."""
    frequencies = np.zeros(256, dtype=np.uint32)
    for symbol, frequency in c.meta["frequencies"].items():
        if not 0 < int(frequency) <= rans.PROB_SCALE:
            raise UnweightError(f"{name}: symbol frequency {frequency} out of range")
        frequencies[int(symbol)] = int(frequency)
    return rans.Encoded(frequencies, c.arrays["stream"], c.arrays["offsets"], math.prod(c.shape),
                        int(c.meta["chunk_symbols"]))  # fmt: skip


def _decode(c: CompressedTensor, dtype: torch.dtype, name: str) -> tuple[np.ndarray, int | None]:
    """The tensor's bytes, and their CRC-32 when the decoder computed it on the way."""
    count = math.prod(c.shape)
    if c.form == "raw":
        return np.array(c.arrays["data"], dtype=np.uint8), None  # a copy: owns its bytes
    uint, shift, mask = _FIELDS[dtype]
    np_uint = _NUMPY_UINT[uint]
    if c.form == "palette":
        a = c.arrays
        p = palette.Palette(a["palette"], a["indices"], a["rest"], a["rows"],
                            a["verbatim"].reshape(-1, palette.ROW), count)  # fmt: skip
        return palette.decode(p).view(np.uint8), None
    if c.form != "rans":
        raise UnweightError(f"{name}: unknown form {c.form!r}")
    encoded = rans_encoded(c, name)
    if dtype == torch.bfloat16:  # one pass: exponents decoded straight into the weights
        weights, crc = rans.decode_bf16(encoded, c.arrays["rest"], name)
        return weights.view(np.uint8), crc
    exponent = rans.decode(encoded, name).astype(np_uint)
    if len(c.arrays["rest"]) != _rest_nbytes(shift, count):
        raise UnweightError(f"{name}: sign/mantissa data has the wrong size for {count} weights")
    rest = _unpack_rest(c.arrays["rest"], shift, count, np_uint)
    return ((exponent << shift) | rest).astype(np_uint).view(np.uint8), None
