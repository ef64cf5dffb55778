"""Interleaved rANS coding of byte symbols with 12-bit probabilities, in chunks.

`encode(symbols)` quantizes the symbol counts to frequencies summing to 4096 and codes
the symbols in chunks of at most CHUNK_SYMBOLS (chunk_size), each an independent stream of 8 interleaved
32-bit states (symbol i uses state i % 8) renormalized in 16-bit words, so chunks decode
in parallel (threads here, GPU blocks later) and each thread has 8 independent
dependency chains. A decode step is one lookup in a packed 4096-entry table, a multiply
and a branchless refill (with AVX2: the 8 states as one vector, two chunks at a time).
rans.c (built on first use) encodes and decodes; without a C compiler NumPy does both,
all chunks and states a step at a time, to the same bytes.
docs/unweight-format.md has the layout.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from infire.errors import InfireError
from infire.native import compile_library

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS  # frequencies sum to this
STATES = 8  # interleaved states per chunk
STATE_LOW = 1 << 16  # states live in [STATE_LOW, 2^32); every encoder state starts here
CHUNK_SYMBOLS = 1 << 16
HEADER_BYTES = 4 * STATES  # a chunk opens with its 8 decoder start states (uint32)
_SOURCE = Path(__file__).with_name("rans.c")


class CorruptStreamError(InfireError):
    """A rANS stream that does not decode to what its metadata says."""


@dataclass(slots=True)
class Encoded:
    """A chunked rANS stream and what decoding it needs."""

    frequencies: np.ndarray  # [256] uint32, sum 4096; one symbol at 4096: no stream
    stream: np.ndarray  # uint8: every chunk's states and words, back to back
    offsets: np.ndarray  # [num_chunks + 1] uint64: byte where each chunk starts, then the end
    count: int  # symbols
    chunk: int = CHUNK_SYMBOLS  # symbols per chunk (the last chunk may have fewer)


def quantize(counts: np.ndarray) -> np.ndarray:
    """[256] uint32 frequencies summing to 4096, at least 1 for every present symbol,
    that code the counts in the fewest bits (from rounding, by single +-1 moves)."""
    counts = np.asarray(counts, dtype=np.int64)
    present = counts > 0
    freq = np.zeros(256, dtype=np.int64)
    if not present.any():
        return freq.astype(np.uint32)
    freq[present] = np.maximum(1, np.rint(counts[present] * PROB_SCALE / counts.sum()))
    weight = counts.astype(np.float64)
    for _ in range(4 * PROB_SCALE):  # each move lowers the cost; far fewer are needed
        # bits saved by one more for s, bits lost by one less
        gain = np.where(present, weight * np.log2((freq + 1) / np.maximum(freq, 1)), -np.inf)
        loss = np.where(
            freq > 1, weight * np.log2(np.maximum(freq, 2) / np.maximum(freq - 1, 1)), np.inf
        )
        up, down = int(np.argmax(gain)), int(np.argmin(loss))
        surplus = int(freq.sum()) - PROB_SCALE
        if surplus > 0:
            freq[down] -= 1
        elif surplus < 0:
            freq[up] += 1
        elif up != down and gain[up] > loss[down] * (1 + 1e-12):
            freq[up] += 1
            freq[down] -= 1
        else:
            break
    return freq.astype(np.uint32)


def cumulative(frequencies: np.ndarray) -> np.ndarray:
    """[256] uint32: the sum of the frequencies of the smaller symbols."""
    return (np.cumsum(frequencies, dtype=np.uint32) - frequencies).astype(np.uint32)


def decode_table(frequencies: np.ndarray) -> np.ndarray:
    """[4096] uint32 per slot: symbol | frequency << 8 | (slot - cumulative) << 20."""
    freq = frequencies.astype(np.uint32)
    symbols = np.repeat(np.arange(256, dtype=np.uint32), freq)
    within = np.arange(PROB_SCALE, dtype=np.uint32) - cumulative(freq)[symbols]
    return symbols | (freq[symbols] << 8) | (within << 20)


def single_symbol(frequencies: np.ndarray) -> int | None:
    """The only symbol of a table that gives one symbol all 4096 (no stream), else None."""
    top = int(np.argmax(frequencies))
    return top if int(frequencies[top]) == PROB_SCALE else None


def chunk_size(n: int) -> int:
    """Symbols per chunk for n symbols: at most CHUNK_SYMBOLS, a multiple of 64, and, for
    more than one chunk, about a multiple of 4 chunks (two threads, each decoding two
    chunks side by side), so that no thread is left with one more chunk than the other."""
    chunks = -(-n // CHUNK_SYMBOLS)
    if chunks <= 1:
        return CHUNK_SYMBOLS
    chunks = -(-chunks // 4) * 4
    return -(-n // (chunks * 64)) * 64


def encode(symbols: np.ndarray, frequencies: np.ndarray | None = None,
           chunk: int | None = None) -> Encoded:  # fmt: skip
    """rANS-code a uint8 array (with its own quantized frequencies unless given; in chunks
    of chunk_size's symbols unless given: a multiple of 8 up to CHUNK_SYMBOLS)."""
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8).reshape(-1)
    chunk = chunk or chunk_size(len(symbols))
    if not (STATES <= chunk <= CHUNK_SYMBOLS and chunk % STATES == 0):
        raise ValueError(f"chunk size {chunk} is not a multiple of {STATES} up to {CHUNK_SYMBOLS}")
    if frequencies is None:
        frequencies = quantize(np.bincount(symbols, minlength=256))
    frequencies = np.ascontiguousarray(frequencies, dtype=np.uint32)
    if single_symbol(frequencies) is not None or len(symbols) == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return Encoded(frequencies, np.zeros(0, dtype=np.uint8), empty, len(symbols), chunk)
    lib = _library()
    if isinstance(lib, str):
        if np.any(frequencies[np.bincount(symbols, minlength=256) > 0] == 0):
            raise ValueError("a symbol to encode has frequency 0")
        chunks = _encode_numpy(symbols, frequencies, chunk)
    else:
        chunks = _encode_c(lib, symbols, frequencies, chunk)
    sizes = np.array([len(c) for c in chunks], dtype=np.uint64)
    offsets = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(sizes, dtype=np.uint64)])
    return Encoded(frequencies, np.concatenate(chunks), offsets, len(symbols), chunk)


def _num_chunks(n: int, chunk: int) -> int:
    return (n + chunk - 1) // chunk


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _encode_c(
    lib: ctypes.CDLL, symbols: np.ndarray, freq: np.ndarray, chunk: int
) -> list[np.ndarray]:
    num_chunks = _num_chunks(len(symbols), chunk)
    region = HEADER_BYTES + 2 * chunk
    scratch = np.empty(num_chunks * region, dtype=np.uint8)
    sizes = np.empty(num_chunks, dtype=np.int64)
    cum = cumulative(freq)
    if lib.unweight_rans_encode(_ptr(symbols), ctypes.c_int64(len(symbols)),
                                ctypes.c_int64(chunk), _ptr(freq), _ptr(cum),
                                _ptr(scratch), _ptr(sizes)):  # fmt: skip
        raise ValueError("a symbol to encode has frequency 0")
    return [scratch[(c + 1) * region - int(sizes[c]) : (c + 1) * region] for c in range(num_chunks)]


def _encode_numpy(symbols: np.ndarray, freq: np.ndarray, chunk: int) -> list[np.ndarray]:
    """All chunks and states a group of 8 symbols at a time, backwards (as rans.c does)."""
    n, num_chunks = len(symbols), _num_chunks(len(symbols), chunk)
    counts = np.minimum(chunk, n - np.arange(num_chunks) * chunk)
    grid = np.zeros(num_chunks * chunk, dtype=np.uint8)
    grid[:n] = symbols
    grid = grid.reshape(num_chunks, chunk // STATES, STATES)
    freq64, cum64 = freq.astype(np.uint64), cumulative(freq).astype(np.uint64)
    x = np.full((num_chunks, STATES), STATE_LOW, dtype=np.uint64)
    words = np.zeros((num_chunks, chunk), dtype=np.uint16)  # filled from the end
    pos = np.full(num_chunks, chunk, dtype=np.int64)
    lane = np.arange(STATES)
    for g in range(-(-int(counts.max()) // STATES) - 1, -1, -1):
        active = g * STATES + lane[None, :] < counts[:, None]
        s = grid[:, g, :]
        f = np.where(active, freq64[s], 1)
        need = active & (x >= f << np.uint64(32 - PROB_BITS))
        # The encoder emits lane 7's word first, each word below the last: lane j's word
        # lies below those of the needy lanes j+1..7.
        below = np.cumsum(need[:, ::-1], axis=1)[:, ::-1]
        rows, lanes = np.nonzero(need)
        words[rows, pos[rows] - below[rows, lanes]] = (x[rows, lanes] & 0xFFFF).astype(np.uint16)
        pos -= need.sum(axis=1)
        x = np.where(need, x >> np.uint64(16), x)
        coded = ((x // f) << np.uint64(PROB_BITS)) + x % f + cum64[s]
        x = np.where(active, coded, x)
    states = x.astype("<u4")
    return [np.concatenate([states[c].view(np.uint8), words[c, pos[c] :].astype("<u2").view(np.uint8)])
            for c in range(num_chunks)]  # fmt: skip


@cache
def _library() -> ctypes.CDLL | str:
    if sys.byteorder != "little":
        return "the C rANS coder assumes a little-endian machine"
    lib = compile_library(_SOURCE, ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC"))
    if isinstance(lib, str):
        return lib
    lib.unweight_rans_encode.restype = ctypes.c_int
    lib.unweight_rans_decode.restype = ctypes.c_int64
    return lib


def decode(encoded: Encoded, name: str = "tensor", *, simd: bool = True) -> np.ndarray:
    """The uint8 symbols; CorruptStreamError naming `name` when the stream or the
    frequencies are damaged. simd=False keeps the C decoder to its portable scalar code
    (else it uses AVX2 where the CPU has it; the tests compare the two)."""
    return _decode(encoded, name, None, simd)[0]


def decode_bf16(
    encoded: Encoded, rest: np.ndarray, name: str = "tensor", *, simd: bool = True
) -> tuple[np.ndarray, int]:
    """The BF16 weights (as uint16) whose exponents the symbols are, given `rest` (one
    sign << 7 | mantissa byte per weight), and the CRC-32 of their bytes (the C decoder
    computes it as it goes)."""
    if len(rest) != encoded.count:
        raise CorruptStreamError(
            f"{name}: {len(rest)} sign/mantissa bytes for {encoded.count} weights"
        )
    weights, crc = _decode(encoded, name, np.ascontiguousarray(rest, dtype=np.uint8), simd)
    return weights, zlib.crc32(weights) if crc is None else crc


def _decode(
    encoded: Encoded, name: str, rest: np.ndarray | None, simd: bool
) -> tuple[np.ndarray, int | None]:
    freq, stream, offsets, n = encoded.frequencies, encoded.stream, encoded.offsets, encoded.count
    chunk = encoded.chunk
    if not (STATES <= chunk <= CHUNK_SYMBOLS and chunk % STATES == 0):
        raise CorruptStreamError(f"{name}: chunk size {chunk} is not supported")
    freq = np.ascontiguousarray(freq, dtype=np.uint32)
    if len(freq) != 256 or int(freq.sum()) != PROB_SCALE:
        raise CorruptStreamError(f"{name}: the symbol frequencies do not sum to {PROB_SCALE}")
    only = single_symbol(freq)
    if only is not None:
        if len(stream) or len(offsets):
            raise CorruptStreamError(f"{name}: a one-symbol tensor has a stream")
        symbols = np.full(n, only, dtype=np.uint8)
        return (symbols if rest is None else _merge_bf16(symbols, rest)), None
    bounds = offsets.tolist()  # Python ints: cheaper than NumPy calls for a few chunks
    if (
        len(bounds) != _num_chunks(n, chunk) + 1
        or n == 0
        or bounds[0] != 0
        or bounds[-1] != len(stream)
        or any(b - a < HEADER_BYTES or (b - a) % 2 for a, b in itertools.pairwise(bounds))
    ):
        raise CorruptStreamError(f"{name}: chunk offsets do not fit the stream")
    stream = np.ascontiguousarray(stream, dtype=np.uint8)
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    lib = _library()
    crc = None
    if isinstance(lib, str):
        symbols = np.empty(n, dtype=np.uint8)
        bad = _decode_numpy(stream, offsets, n, chunk, decode_table(freq), symbols)
        out = symbols if rest is None else _merge_bf16(symbols, rest)
    else:
        out = np.empty(n, dtype=np.uint8 if rest is None else np.uint16)
        crc_out = ctypes.c_uint32(0)
        bad = lib.unweight_rans_decode(_ptr(stream), _ptr(offsets), ctypes.c_int64(n),
                                       ctypes.c_int64(chunk), _ptr(freq),
                                       None if rest is None else _ptr(rest), _ptr(out),
                                       ctypes.byref(crc_out), ctypes.c_int(simd))  # fmt: skip
        crc = None if rest is None else crc_out.value
    if bad:
        raise CorruptStreamError(f"{name}: the rANS stream does not decode as recorded")
    return out, crc


def _merge_bf16(symbols: np.ndarray, rest: np.ndarray) -> np.ndarray:
    rest = rest.astype(np.uint16)
    return ((rest & 0x80) << 8) | (symbols.astype(np.uint16) << 7) | (rest & 0x7F)


def _decode_numpy(
    stream: np.ndarray,
    offsets: np.ndarray,
    n: int,
    chunk: int,
    table: np.ndarray,
    out: np.ndarray,
) -> bool:
    """All chunks and states a group of 8 symbols at a time (without a C compiler);
    True when some chunk does not decode exactly to its end."""
    num_chunks = len(offsets) - 1
    counts = np.minimum(chunk, n - np.arange(num_chunks) * chunk)
    begin, end = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
    heads = stream[begin[:, None] + np.arange(HEADER_BYTES)]
    x = np.ascontiguousarray(heads).view("<u4").astype(np.uint64)  # [chunks, 8]
    if np.any(x < STATE_LOW):
        return True
    pos = begin + HEADER_BYTES
    grid = np.zeros((num_chunks, chunk // STATES, STATES), dtype=np.uint8)
    lane = np.arange(STATES)
    padded = np.concatenate([stream, np.zeros(2, dtype=np.uint8)]).astype(np.uint64)
    for g in range(-(-int(counts.max()) // STATES)):
        active = g * STATES + lane[None, :] < counts[:, None]
        entry = table[x & (PROB_SCALE - 1)].astype(np.uint64)
        coded = ((entry >> 8) & (PROB_SCALE - 1)) * (x >> np.uint64(PROB_BITS)) + (entry >> 20)
        x = np.where(active, coded, x)
        need = active & (x < STATE_LOW)
        at = pos[:, None] + 2 * (np.cumsum(need, axis=1) - need)  # lanes read in order
        if np.any(need & (at + 2 > end[:, None])):
            return True
        at = np.where(need, at, 0)
        word = padded[at] | (padded[at + 1] << np.uint64(8))
        x = np.where(need, (x << np.uint64(16)) | word, x)
        pos += 2 * need.sum(axis=1)
        grid[:, g, :] = (entry & 0xFF).astype(np.uint8)
    out[:] = grid.reshape(-1)[:n]
    return bool(np.any(x != STATE_LOW) or np.any(pos != end))
