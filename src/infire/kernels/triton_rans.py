"""Unweight's distribution form (rANS-coded exponents, docs/unweight-format.md) decoded to
bf16 by a Triton kernel, on the device the weights will live on.

A chunk's 8 states read one stream of 16-bit words in order, so a chunk is sequential;
chunks are independent. A program takes BLOCK chunks, one a row, and steps all of them
a group of 8 symbols at a time: the 8 states each take a step (a lookup in the tensor's
packed 4096-entry table: symbol | frequency << 8 | (slot - cumulative) << 20), the states
that fall under 2^16 refill from the chunk's next words in lane order (a cumulative sum
says which word each takes), and the 8 weights are written, each `(rest & 0x80) << 8 |
exponent << 7 | (rest & 0x7F)`. A chunk whose states do not end at 2^16 with every word
read, or that would read past its end, is damaged: its flag is set and the decode fails
(the CPU decoder's check; the CRC-32 of the CPU path is not computed here).
"""

from __future__ import annotations

import numpy as np
import torch

from infire.kernels.triton_lang import tl, triton
from infire.unweight import rans

BLOCK = 16  # chunks a program decodes side by side

if triton is not None:

    @triton.jit
    def _decode_chunks(
        stream, offsets, table, rest, out, bad, num_chunks, count, chunk,
        BLOCK: tl.constexpr, STATES: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, STATES)
        c_ok = c < num_chunks
        begin = tl.load(offsets + c, mask=c_ok, other=0)
        end = tl.load(offsets + c + 1, mask=c_ok, other=0)
        symbols = tl.where(c_ok, tl.minimum(chunk, count - c.to(tl.int64) * chunk), 0)
        # the 8 start states, little-endian uint32 after the chunk's start
        head = begin[:, None] + 4 * lane[None, :]
        x = tl.zeros([BLOCK, STATES], tl.int64)
        for byte in range(4):
            b = tl.load(stream + head + byte, mask=c_ok[:, None], other=0).to(tl.int64)
            x = x | (b << (8 * byte))
        broken = tl.sum((x < 65536).to(tl.int32), axis=1) > 0
        pos = begin + 32
        for group in range(0, tl.cdiv(chunk, STATES)):
            i = group * STATES + lane  # symbol of each lane within its chunk
            active = c_ok[:, None] & (i[None, :] < symbols[:, None])
            entry = tl.load(table + (x & 4095), mask=active, other=0).to(tl.int64)
            coded = ((entry >> 8) & 4095) * (x >> 12) + (entry >> 20)
            x = tl.where(active, coded, x)
            need = active & (x < 65536)
            taken = need.to(tl.int64)
            at = pos[:, None] + 2 * (tl.cumsum(taken, axis=1) - taken)
            broken = broken | (tl.sum((need & (at + 2 > end[:, None])).to(tl.int32), axis=1) > 0)
            readable = need & (at + 2 <= end[:, None])
            low = tl.load(stream + at, mask=readable, other=0).to(tl.int64)
            high = tl.load(stream + at + 1, mask=readable, other=0).to(tl.int64)
            x = tl.where(need, (x << 16) | low | (high << 8), x)
            pos = pos + 2 * tl.sum(taken, axis=1)
            weight = c.to(tl.int64)[:, None] * chunk + i[None, :]
            r = tl.load(rest + weight, mask=active, other=0).to(tl.int32)
            bits = ((r & 0x80) << 8) | ((entry & 0xFF).to(tl.int32) << 7) | (r & 0x7F)
            tl.store(out + weight, bits.to(tl.int16), mask=active)
        ended = (tl.sum((x != 65536).to(tl.int32), axis=1) == 0) & (pos == end)
        tl.store(bad + c, (broken | ~ended).to(tl.int32), mask=c_ok)


def decode_bf16(encoded: rans.Encoded, rest: np.ndarray | torch.Tensor,
                device: torch.device | str, name: str = "tensor") -> torch.Tensor:  # fmt: skip
    """The BF16 weights (a flat bf16 tensor on `device`) whose exponents `encoded` codes,
    given `rest` (a sign << 7 | mantissa byte per weight). CorruptStreamError naming
    `name` where a chunk does not decode as recorded."""
    n, chunk = encoded.count, encoded.chunk
    if len(rest) != n:
        raise rans.CorruptStreamError(f"{name}: {len(rest)} sign/mantissa bytes for {n} weights")
    rest_t = torch.as_tensor(np.asarray(rest, dtype=np.uint8)).to(device)
    freq = np.ascontiguousarray(encoded.frequencies, dtype=np.uint32)
    only = rans.single_symbol(freq)
    if only is not None or n == 0:  # one exponent: no stream
        r = rest_t.to(torch.int32)
        bits = ((r & 0x80) << 8) | ((only or 0) << 7) | (r & 0x7F)
        return bits.to(torch.int16).view(torch.bfloat16)  # the low 16 bits, as the CPU's
    offsets = np.asarray(encoded.offsets, dtype=np.int64)
    num_chunks = len(offsets) - 1
    if num_chunks != -(-n // chunk) or offsets[-1] != len(encoded.stream) or chunk % 8:
        raise rans.CorruptStreamError(f"{name}: chunk offsets do not fit the stream")
    stream = torch.from_numpy(np.ascontiguousarray(encoded.stream, dtype=np.uint8)).to(device)
    table = torch.from_numpy(rans.decode_table(freq).astype(np.int64)).to(device)
    out = torch.empty(n, dtype=torch.int16, device=device)
    bad = torch.zeros(num_chunks, dtype=torch.int32, device=device)
    _decode_chunks[(triton.cdiv(num_chunks, BLOCK),)](
        stream, torch.from_numpy(offsets).to(device), table, rest_t, out, bad, num_chunks, n,
        chunk, BLOCK=BLOCK, STATES=rans.STATES,
    )  # fmt: skip
    if bool(bad.any()):
        raise rans.CorruptStreamError(f"{name}: the rANS stream does not decode as recorded")
    return out.view(torch.bfloat16)
