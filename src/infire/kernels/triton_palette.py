"""Unweight's palette form decoded inside the matmul, in Triton (the GPU half of Unweight).

A bf16 weight [N, K] is held as (`GpuPalette`, repacked once from the bf16 bits):
- `palette`: its 16 most common exponents (uint8, unweight/palette.py `choose`);
- `indices`: a 4-bit palette index per weight, [N, K / 2] uint8 (column 2j in the low
  nibble, 2j + 1 in the high one);
- `rest`: sign << 7 | mantissa per weight, [N, K] uint8;
- `chunk_offset`: per run of 64 columns of a row, [N, K / 64] int32: -1 where every
  exponent is in the palette, else where the run's 64 exponents start in `verbatim`.
12 bits a weight plus 0.5 for the offsets (and 8 per weight of the rare verbatim runs).

`palette_matmul(x, w)` = x @ W^T with W rebuilt in registers, tile by tile: a weight is
`(rest & 0x80) << 8 | exponent << 7 | (rest & 0x7F)`, its exponent the palette's entry of
its index, or the verbatim byte where its run has one. No dense copy of W exists. The same
kernel over the dense bf16 weight (`dense_matmul`, the "decode then multiply" reference)
runs the same products in the same order, so the two agree bit for bit (tested); both
accumulate in float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from infire.kernels.triton_lang import tl, triton
from infire.unweight import palette as palette_form

RUN = 64  # columns of a row that share a verbatim flag
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


@dataclass(frozen=True)
class GpuPalette:
    """A bf16 [rows, cols] weight in the GPU palette form (see the module's docstring)."""

    palette: torch.Tensor  # [16] uint8
    indices: torch.Tensor  # [rows, cols / 2] uint8
    rest: torch.Tensor  # [rows, cols] uint8
    chunk_offset: torch.Tensor  # [rows, cols / 64] int32
    verbatim: torch.Tensor  # [runs * 64] uint8 (at least one byte)
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.palette, self.indices, self.rest,
                                                          self.chunk_offset, self.verbatim))  # fmt: skip

    def to(self, device: torch.device | str) -> GpuPalette:
        moved = {f: getattr(self, f).to(device) for f in
                 ("palette", "indices", "rest", "chunk_offset", "verbatim")}  # fmt: skip
        return GpuPalette(**moved, rows=self.rows, cols=self.cols)


def pack_palette(weight: torch.Tensor) -> GpuPalette:
    """The GPU palette form of a bf16 [rows, cols] weight (cols a multiple of 64)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError("the palette form takes a 2-D bf16 weight")
    rows, cols = weight.shape
    if cols % RUN:
        raise ValueError(
            f"the palette matmul takes a number of columns that is a multiple of {RUN}"
        )
    bits = weight.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    chosen = palette_form.choose(exponent)
    lookup = np.full(256, 255, dtype=np.uint8)
    lookup[chosen] = np.arange(len(chosen), dtype=np.uint8)
    index = lookup[exponent]
    outside = (index == 255).reshape(rows, cols // RUN, RUN).any(axis=2)
    index[index == 255] = 0
    offsets = np.full(outside.shape, -1, dtype=np.int32)
    offsets[outside] = np.arange(int(outside.sum()), dtype=np.int32) * RUN
    verbatim = exponent.reshape(rows, cols // RUN, RUN)[outside].reshape(-1)
    arrays = {
        "palette": np.pad(chosen, (0, palette_form.PALETTE_SIZE - len(chosen))),
        "indices": (index[:, 0::2] | (index[:, 1::2] << 4)).astype(np.uint8),
        "rest": (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8),
        "chunk_offset": offsets,
        "verbatim": verbatim if verbatim.size else np.zeros(1, np.uint8),
    }
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    return GpuPalette(**tensors, rows=rows, cols=cols).to(weight.device)


if triton is not None:

    @triton.jit
    def _rebuild(palette, indices, rest, chunk_offset, verbatim, n, k, n_ok, K, RUN: tl.constexpr):
        """The bf16 weights [len(n), len(k)] of rows n, columns k, from the palette form."""
        pair = tl.load(
            indices + n[:, None] * (K // 2) + (k // 2)[None, :], mask=n_ok[:, None], other=0
        )
        nibble = (pair.to(tl.int32) >> ((k % 2) * 4)[None, :]) & 0xF
        exponent = tl.load(palette + nibble).to(tl.int32)
        run = tl.load(chunk_offset + n[:, None] * (K // RUN) + (k // RUN)[None, :],
                      mask=n_ok[:, None], other=-1)  # fmt: skip
        kept = tl.load(verbatim + tl.maximum(run, 0) + (k % RUN)[None, :], mask=run >= 0, other=0)
        exponent = tl.where(run >= 0, kept.to(tl.int32), exponent)
        low = tl.load(rest + n[:, None] * K + k[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        bits = ((low & 0x80) << 8) | (exponent << 7) | (low & 0x7F)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _decode(palette, indices, rest, chunk_offset, verbatim, out, N, K,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):  # fmt: skip
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = n < N
        ws = _rebuild(palette, indices, rest, chunk_offset, verbatim, n, k, n_ok, K, RUN)
        tl.store(out + n[:, None] * K + k[None, :], ws, mask=n_ok[:, None])

    @triton.jit
    def _matmul(
        x, w, palette, indices, rest, chunk_offset, verbatim, y, M, N, K,
        PALETTE: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr,
    ):  # fmt: skip
        pm, pn = tl.program_id(0), tl.program_id(1)
        m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x + m[:, None] * K + k[None, :], mask=m_ok[:, None], other=0.0)
            if PALETTE:
                ws = _rebuild(palette, indices, rest, chunk_offset, verbatim, n, k, n_ok, K, RUN)
            else:
                ws = tl.load(w + n[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(
                    xs.to(tl.float32), tl.trans(ws.to(tl.float32)), input_precision="ieee"
                )
            else:
                acc += tl.dot(xs.to(tl.bfloat16), tl.trans(ws))
        tl.store(y + m[:, None] * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _run(x: torch.Tensor, weight: torch.Tensor | None, packed: GpuPalette | None, rows: int,
         cols: int) -> torch.Tensor:  # fmt: skip
    lead = x.shape[:-1]
    x = x.reshape(-1, cols).contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    # float32 products where the activations are float32, and under the interpreter (its
    # dot of bf16 is not bf16 arithmetic); on a GPU with bf16 activations, bf16 products
    ieee = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(rows, BLOCK_N))
    p = packed
    dummy = weight if weight is not None else x
    _matmul[grid](
        x, dummy, *((p.palette, p.indices, p.rest, p.chunk_offset, p.verbatim) if p else (dummy,) * 5),
        y, x.shape[0], rows, cols, PALETTE=p is not None, IEEE=ieee,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, RUN=RUN,
    )  # fmt: skip
    return y.view(*lead, rows)


def palette_matmul(x: torch.Tensor, weight: GpuPalette) -> torch.Tensor:
    """x [..., cols] @ W^T with W rebuilt from the palette form in registers; float32
    sums and result [..., rows]."""
    return _run(x, None, weight, weight.rows, weight.cols)


def palette_decode(weight: GpuPalette) -> torch.Tensor:
    """The dense bf16 weight [rows, cols] rebuilt from the palette form (for "decode, then
    multiply" by cuBLAS, where that is faster at a batch size)."""
    out = torch.empty(weight.rows, weight.cols, dtype=torch.bfloat16, device=weight.rest.device)
    p = weight
    grid = (triton.cdiv(p.rows, BLOCK_N), p.cols // BLOCK_K)
    _decode[grid](p.palette, p.indices, p.rest, p.chunk_offset, p.verbatim, out, p.rows, p.cols,
                  BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, RUN=RUN)  # fmt: skip
    return out


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same kernel over a dense bf16 weight [rows, cols] ("decode, then multiply")."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % BLOCK_K:
        raise ValueError(
            f"dense_matmul takes a bf16 weight whose columns are a multiple of {BLOCK_K}"
        )
    return _run(x, weight.contiguous(), None, *weight.shape)


BUCKETS = (1, 8, 16, 32, 64, 128, 256)  # batch sizes the choice is measured at


def _cuda_time(run: Callable[[], object], repeat: int = 5) -> float:
    """Median seconds of `run` on the current CUDA stream, after a warm-up."""
    run()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


class PaletteChoice:
    """How a palette-form projection multiplies at a batch size: the fused kernel, or its
    weight decoded to bf16 then multiplied by cuBLAS (`F.linear`). `mode` "fused" or
    "decode" fixes it; "auto" takes, per projection shape and batch bucket (the smallest
    of BUCKETS at or above the batch), the one `measure` found faster (on CUDA at startup;
    cached), and the fused kernel where nothing was measured (as on CPU)."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "fused", "decode"):
            raise ValueError(f"the palette matmul is auto, fused or decode, not {mode!r}")
        self.mode = mode
        self.decode_faster: dict[tuple[int, int, int], bool] = {}

    def measure(self, weights: list[GpuPalette],
                timer: Callable[[Callable[[], object]], float] = _cuda_time) -> None:  # fmt: skip
        """Time both ways for every distinct shape of `weights` at every bucket."""
        if self.mode != "auto":
            return
        shapes = {(w.rows, w.cols): w for w in weights}
        for (rows, cols), weight in shapes.items():
            for bucket in BUCKETS:
                x = torch.randn(bucket, cols, dtype=torch.bfloat16, device=weight.rest.device)
                fused = timer(lambda x=x, w=weight: palette_matmul(x, w))
                decoded = timer(lambda x=x, w=weight: F.linear(x, palette_decode(w)))
                self.decode_faster[(rows, cols, bucket)] = decoded < fused

    def decodes(self, weight: GpuPalette, batch: int) -> bool:
        """Whether a batch of `batch` rows multiplies by the decoded weight."""
        if self.mode != "auto":
            return self.mode == "decode"
        bucket = next((b for b in BUCKETS if b >= batch), BUCKETS[-1])
        return self.decode_faster.get((weight.rows, weight.cols, bucket), False)
