"""Canonical Huffman coding of byte symbols with codes of at most 12 bits, in chunks.

`encode(symbols)` builds a length-limited code from the symbol counts and writes the codes
MSB-first into one bit stream cut into chunks of CHUNK_SYMBOLS symbols, recording every
chunk's starting bit, so chunks decode independently (threads here, GPU blocks later).
`decode` reads the next 12 bits at a time through one 4096-entry table: no branches on
the code length. The C decoder (huffman_decode.c, built on first use) runs chunks in
parallel; without a C compiler a NumPy decoder steps all chunks at once, slower.
"""

from __future__ import annotations

import ctypes
import heapq
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from infire.errors import InfireError
from infire.kernels.build import compile_library

MAX_BITS = 12
CHUNK_SYMBOLS = 4096
_SOURCE = Path(__file__).with_name("huffman_decode.c")
_ENCODE_SLICE = 1 << 20  # symbols expanded to bits at a time while encoding


class CorruptStreamError(InfireError):
    """A Huffman stream that does not decode to what its metadata says."""


@dataclass(slots=True)
class Encoded:
    """A chunked Huffman stream and what decoding it needs."""

    lengths: np.ndarray  # [256] uint8: code length per symbol, 0 = absent
    stream: np.ndarray  # uint8, MSB-first bits, 3 zero bytes of padding at the end
    offsets: np.ndarray  # [num_chunks + 1] uint64: first bit of each chunk, then the total
    count: int  # symbols


def code_lengths(counts: np.ndarray, max_bits: int = MAX_BITS) -> np.ndarray:
    """Huffman code lengths of 256 symbols, limited to max_bits (a complete prefix code)."""
    present = [int(s) for s in np.flatnonzero(counts)]
    lengths = np.zeros(256, dtype=np.uint8)
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(int(counts[s]), s, (s,)) for s in present]
    heapq.heapify(heap)
    depth = dict.fromkeys(present, 0)
    while len(heap) > 1:
        c1, t1, a = heapq.heappop(heap)
        c2, t2, b = heapq.heappop(heap)
        for s in a + b:
            depth[s] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), a + b))
    if max(depth.values()) > max_bits:
        _limit(depth, counts, max_bits)
    for s, d in depth.items():
        lengths[s] = d
    return lengths


def _limit(depth: dict[int, int], counts: np.ndarray, max_bits: int) -> None:
    """Clamp lengths to max_bits, then lengthen the rarest short codes until Kraft holds."""
    for s in depth:
        depth[s] = min(depth[s], max_bits)
    budget = 1 << max_bits
    kraft = sum(1 << (max_bits - d) for d in depth.values())
    by_rarity = sorted(depth, key=lambda s: (int(counts[s]), s))
    while kraft > budget:
        for s in by_rarity:  # the rarest symbol whose code can still grow
            if depth[s] < max_bits:
                kraft -= 1 << (max_bits - depth[s] - 1)
                depth[s] += 1
                break
    # Give back slack: shorten the most frequent codes while the code stays a prefix code.
    for s in reversed(by_rarity):
        while depth[s] > 1 and kraft + (1 << (max_bits - depth[s])) <= budget:
            kraft += 1 << (max_bits - depth[s])
            depth[s] -= 1


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """[256] uint32 canonical codes for the lengths (shorter first, then by symbol)."""
    codes = np.zeros(256, dtype=np.uint32)
    code, previous = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - previous
        previous = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symbol and code length for every 12-bit window (length 0: no code starts so)."""
    codes = canonical_codes(lengths)
    symbol = np.zeros(1 << MAX_BITS, dtype=np.uint8)
    length = np.zeros(1 << MAX_BITS, dtype=np.uint8)
    for s in np.flatnonzero(lengths):
        shift = MAX_BITS - int(lengths[s])
        start = int(codes[s]) << shift
        symbol[start : start + (1 << shift)] = s
        length[start : start + (1 << shift)] = lengths[s]
    return symbol, length


def encode(symbols: np.ndarray, lengths: np.ndarray | None = None) -> Encoded:
    """Huffman-code a uint8 array (with its own code unless lengths are given)."""
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8).reshape(-1)
    if lengths is None:
        lengths = code_lengths(np.bincount(symbols, minlength=256))
    codes = canonical_codes(lengths)
    sym_lengths = lengths[symbols].astype(np.int64)
    ends = np.cumsum(sym_lengths)
    starts = ends - sym_lengths
    chunk_starts = starts[::CHUNK_SYMBOLS].astype(np.uint64)
    total = int(ends[-1]) if len(ends) else 0
    offsets = np.append(chunk_starts, np.uint64(total)).astype(np.uint64)
    columns = np.arange(MAX_BITS, dtype=np.uint32)
    pieces = []
    for i in range(0, len(symbols), _ENCODE_SLICE):
        part = symbols[i : i + _ENCODE_SLICE]
        n_bits = lengths[part].astype(np.uint32)
        aligned = codes[part] << (MAX_BITS - n_bits)  # left-aligned in 12 bits
        bits = ((aligned[:, None] >> (MAX_BITS - 1 - columns)) & 1).astype(np.uint8)
        pieces.append(bits[columns[None, :] < n_bits[:, None]])
    bits = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
    stream = np.concatenate([np.packbits(bits), np.zeros(3, dtype=np.uint8)])
    return Encoded(lengths, stream, offsets, len(symbols))


@cache
def _library() -> ctypes.CDLL | str:
    lib = compile_library(_SOURCE, ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC"))
    if isinstance(lib, str):
        return lib
    lib.unweight_huffman_decode.restype = ctypes.c_int
    lib.unweight_huffman_decode_bf16.restype = ctypes.c_int
    return lib


def decode(
    encoded: Encoded, name: str = "tensor", bf16_rest: np.ndarray | None = None
) -> np.ndarray:
    """The uint8 symbols or, given `bf16_rest` (one sign << 7 | mantissa byte per weight),
    the BF16 weights they are the exponents of, as uint16. CorruptStreamError naming
    `name` when the stream is damaged."""
    lengths, stream, offsets, n = encoded.lengths, encoded.stream, encoded.offsets, encoded.count
    num_chunks = (n + CHUNK_SYMBOLS - 1) // CHUNK_SYMBOLS
    total = int(offsets[-1]) if len(offsets) else 0
    if (
        len(offsets) != num_chunks + 1
        or np.any(np.diff(offsets.astype(np.int64)) < 0)
        or total > 8 * (len(stream) - 3)
    ):
        raise CorruptStreamError(f"{name}: chunk offsets do not fit the stream")
    if bf16_rest is not None and len(bf16_rest) != n:
        raise CorruptStreamError(f"{name}: {len(bf16_rest)} sign/mantissa bytes for {n} weights")
    out = np.empty(n, dtype=np.uint8 if bf16_rest is None else np.uint16)
    if n == 0:
        return out
    table_symbol, table_length = decode_table(lengths)
    ends = np.empty(num_chunks, dtype=np.uint64)
    lib = _library()
    stream = np.ascontiguousarray(stream)
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    if isinstance(lib, str):
        symbols = np.empty(n, dtype=np.uint8)
        bad = _decode_numpy(stream, offsets, n, table_symbol, table_length, symbols, ends)
        if bf16_rest is None:
            out = symbols
        else:
            rest = bf16_rest.astype(np.uint16)
            out = ((rest & 0x80) << 8) | (symbols.astype(np.uint16) << 7) | (rest & 0x7F)
    else:

        def ptr(a: np.ndarray) -> ctypes.c_void_p:
            return ctypes.c_void_p(a.ctypes.data)

        head = (ptr(stream), ctypes.c_uint64(total), ptr(offsets), ctypes.c_int64(num_chunks),
                ctypes.c_int64(CHUNK_SYMBOLS), ctypes.c_int64(n), ptr(table_symbol),
                ptr(table_length))  # fmt: skip
        if bf16_rest is None:
            bad = lib.unweight_huffman_decode(*head, ptr(out), ptr(ends))
        else:
            rest = np.ascontiguousarray(bf16_rest, dtype=np.uint8)
            bad = lib.unweight_huffman_decode_bf16(*head, ptr(rest), ptr(out), ptr(ends))
    if bad or not np.array_equal(ends, offsets[1:]):
        raise CorruptStreamError(f"{name}: the Huffman stream does not decode as recorded")
    return out


def _decode_numpy(
    stream: np.ndarray,
    offsets: np.ndarray,
    n: int,
    table_symbol: np.ndarray,
    table_length: np.ndarray,
    out: np.ndarray,
    ends: np.ndarray,
) -> bool:
    """All chunks a symbol at a time (the fallback without a C compiler)."""
    num_chunks = len(ends)
    total = int(offsets[-1])
    pos = offsets[:-1].astype(np.int64)
    grid = np.zeros((num_chunks, CHUNK_SYMBOLS), dtype=np.uint8)
    last = n - (num_chunks - 1) * CHUNK_SYMBOLS
    data = stream.astype(np.uint32)
    for i in range(CHUNK_SYMBOLS):
        m = num_chunks if i < last else num_chunks - 1
        if m == 0:
            break
        p = pos[:m]
        byte = p >> 3
        window = (data[byte] << 16) | (data[byte + 1] << 8) | data[byte + 2]
        peek = (window >> (24 - MAX_BITS - (p & 7)).astype(np.uint32)) & ((1 << MAX_BITS) - 1)
        length = table_length[peek].astype(np.int64)
        if np.any(length == 0) or np.any(p + length > total):
            return True
        grid[:m, i] = table_symbol[peek]
        pos[:m] = p + length
    out[:] = grid.reshape(-1)[:n]
    ends[:] = pos.astype(np.uint64)
    return False
