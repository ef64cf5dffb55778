"""The palette form of a BF16 tensor: 12 bits per weight, rebuilt without branches.

Per tensor a palette of its 16 most common exponents; per weight a 4-bit palette index
(two per byte, low nibble first) and its sign+mantissa byte; rows of ROW weights (of the
flattened tensor) that hold an exponent outside the palette keep their exponents verbatim
(one byte each) in a side table with their row numbers; their sign and mantissa bytes
stay in the main array like every other row's. A weight is `sign << 15 | palette[index]
<< 7 | mantissa`; then the exponents of the verbatim rows are written over their places.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROW = 64
PALETTE_SIZE = 16


@dataclass(slots=True)
class Palette:
    """The arrays of one palette-form tensor."""

    palette: np.ndarray  # [<=16] uint8 exponents
    indices: np.ndarray  # uint8, two 4-bit indices per byte
    rest: np.ndarray  # uint8 per weight: sign << 7 | mantissa
    rows: np.ndarray  # uint32 row numbers kept verbatim
    verbatim: np.ndarray  # [len(rows), ROW] uint8 exponents (the padded last row as padded)
    count: int  # weights


def choose(exponent: np.ndarray) -> np.ndarray:
    """The palette of a tensor: its (up to) 16 most common exponents, ascending."""
    frequency = np.bincount(exponent.reshape(-1), minlength=256)
    order = np.argsort(-frequency, kind="stable")
    return np.sort(order[: min(PALETTE_SIZE, int(np.count_nonzero(frequency)))]).astype(np.uint8)


def encode(bits: np.ndarray) -> Palette:
    """The palette form of BF16 values given as uint16."""
    bits = bits.reshape(-1)
    count = len(bits)
    palette = choose(((bits >> 7) & 0xFF).astype(np.uint8))
    lookup = np.full(256, 255, dtype=np.uint8)
    lookup[palette] = np.arange(len(palette), dtype=np.uint8)
    pad = (-count) % ROW
    padded = np.concatenate([bits, np.full(pad, int(palette[0]) << 7, dtype=np.uint16)])
    index = lookup[((padded >> 7) & 0xFF).astype(np.uint8)]
    outside = (index == 255).reshape(-1, ROW).any(axis=1)
    rows = np.flatnonzero(outside).astype(np.uint32)
    verbatim = ((padded.reshape(-1, ROW)[rows] >> 7) & 0xFF).astype(np.uint8)
    index = np.where(index == 255, 0, index)
    if len(index) % 2:
        index = np.append(index, 0)
    packed = (index[0::2] | (index[1::2] << 4)).astype(np.uint8)
    rest = (((padded >> 8) & 0x80) | (padded & 0x7F)).astype(np.uint8)
    return Palette(palette, packed, rest, rows, verbatim, count)


def decode(p: Palette) -> np.ndarray:
    """The uint16 BF16 bits."""
    index = np.empty(len(p.indices) * 2, dtype=np.uint8)
    index[0::2] = p.indices & 0x0F
    index[1::2] = p.indices >> 4
    index = index[: len(p.rest)]
    palette = np.zeros(PALETTE_SIZE, dtype=np.uint16)
    palette[: len(p.palette)] = p.palette
    rest = p.rest.astype(np.uint16)
    bits = ((rest & 0x80) << 8) | (palette[index] << 7) | (rest & 0x7F)
    rows = bits.reshape(-1, ROW)
    kept = p.rows.astype(np.int64)
    rows[kept] = (rows[kept] & 0x807F) | (p.verbatim.astype(np.uint16) << 7)
    return bits[: p.count]
