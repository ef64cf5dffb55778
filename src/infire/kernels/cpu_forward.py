"""The fused CPU forward (cpu_forward.c): built on first use, driven through ctypes.

The C source ships inside the package and is compiled once per machine with the system C
compiler into infire's cache folder (keyed by a hash of the source and flags), then loaded
into this process, where it shares PyTorch's OpenMP runtime and thread pool. Where it
cannot apply (no AVX2/FMA, no compiler, a GPU, tensor parallelism, a dtype or shape it does
not handle) `CpuForward.build` says why and the engine stays on the PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import torch

from infire.config import ModelConfig
from infire.layers.rotary import RotaryEmbedding
from infire.native import compile_library
from infire.unweight import palette

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_forward.c")
# no contraction into FMAs beyond the explicit ones: GGUF blocks decode to exactly the
# values of the `gguf` package's dequantize
CFLAGS = ["-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp",
          "-shared", "-fPIC"]  # fmt: skip
TILE_ROWS, TILE_COLS = 4, 16
HUGE_PAGE = 2 << 20
MAX_HEAD_DIM = 256

_ptr = ctypes.c_void_p


class _Model(ctypes.Structure):
    """Mirror of InfireModel in cpu_forward.c."""

    _fields_ = [
        *((name, ctypes.c_int32) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "vocab", "block_size", "weight_bf16", "kv_bf16", "weight_palette", "weight_quant",
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("num_blocks", ctypes.c_int64),
        *((name, ctypes.POINTER(_ptr)) for name in (
            "qkv", "qkv_bias", "o_proj", "gate_up", "down", "norm1", "norm2",
        )),
        ("final_norm", _ptr),
        ("embed", _ptr),
        ("lm_head", _ptr),
        ("kv_cache", _ptr),
        ("num_experts", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        *((name, ctypes.POINTER(_ptr)) for name in ("router", "expert_gate_up", "expert_down")),
        ("norm_topk", ctypes.c_int32),
        ("expert_intermediate", ctypes.c_int32),
        *((name, ctypes.POINTER(_ptr)) for name in ("q_norm", "k_norm")),
    ]  # fmt: skip


class _PaletteWeight(ctypes.Structure):
    """Mirror of PaletteWeight in cpu_forward.c."""

    _fields_ = [
        (name, _ptr) for name in ("palette", "chunks", "flags", "verbatim", "tile_verbatim")
    ]


MAX_QUANT_PARTS = 4


class _QuantPart(ctypes.Structure):
    """Mirror of QuantPart in cpu_forward.c: rows of one GGML type, blocks along a row."""

    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int32), ("row_bytes", ctypes.c_int64),
                ("row_stride", ctypes.c_int64), ("data", _ptr), ("row_index", _ptr),
                ("interleaved", ctypes.c_int32), ("unused", ctypes.c_int32)]  # fmt: skip


class QuantWeight(ctypes.Structure):
    """Mirror of QuantWeight in cpu_forward.c: a matmul weight of GGUF blocks, in parts of
    whole rows (a fused q|k|v whose pieces have different types). `parts` are GGUFBlocks:
    GGML type id, [rows, row_bytes] uint8 tensor (its rows may be further apart than
    row_bytes: a column slice), and the stored row of each row (None: in order); the
    tensors stay referenced here. `interleaved` marks the parts that interleave_rows
    copied into groups of 16 rows."""

    _fields_ = [("num_parts", ctypes.c_int32), ("parts", _QuantPart * MAX_QUANT_PARTS)]

    def __init__(self, parts: list[GGUFBlocks], interleaved: list[bool] | None = None) -> None:
        if not 0 < len(parts) <= MAX_QUANT_PARTS:
            raise ValueError(f"a QuantWeight has 1 to {MAX_QUANT_PARTS} parts, not {len(parts)}")
        interleaved = interleaved or [False] * len(parts)
        for _, data, index in parts:
            if data.dtype != torch.uint8 or data.dim() != 2 or data.stride(1) != 1:
                raise ValueError("GGUF blocks are [rows, row_bytes] uint8 with bytes in order")
            if index is not None and (index.dtype != torch.int32 or not index.is_contiguous()):
                raise ValueError("a row index is contiguous int32")
        structs = [_QuantPart(kind, index.numel() if index is not None else data.shape[0],
                              data.shape[1], data.stride(0), data.data_ptr(),
                              None if index is None else index.data_ptr(), grouped, 0)
                   for (kind, data, index), grouped in zip(parts, interleaved, strict=True)]  # fmt: skip
        super().__init__(len(parts), (_QuantPart * MAX_QUANT_PARTS)(*structs))
        self.tensors = [t for _, data, index in parts for t in (data, index) if t is not None]
        self.rows = sum(part.rows for part in structs)
        self.parts_blocks = parts
        self.interleaved = interleaved


# GGML types whose rows the products take in groups of 16: Q4_0, Q4_1, Q8_0, and Q4_K
# where the products in use are not AVX512-VNNI's (whose K-quant products keep the rows)
INTERLEAVED_TYPES = (2, 3, 8, 12)
GROUP_ROWS = 16


def interleaves() -> bool:
    """Whether the fused forward copies the parts that can be into groups of 16 rows (the
    products of every instruction set take them); INFIRE_NO_REPACK=1 keeps the rows where
    the file maps them (llama.cpp's --no-repack)."""
    return os.environ.get("INFIRE_NO_REPACK", "0") in ("", "0")


def can_interleave(part: GGUFBlocks) -> bool:
    """Whether the forward takes this part in groups of 16 rows: Q4_0, Q4_1, Q8_0 (or Q4_K,
    see INTERLEAVED_TYPES), whole rows (not a tensor-parallel rank's column slice), a
    multiple of 16 of them."""
    if part[0] == 12 and _library().infire_quant_isa(-1) == 2:
        return False
    return _groups_fit(part)


def _groups_fit(part: GGUFBlocks) -> bool:
    rows, row_bytes = _shape(part)
    return (
        part[0] in INTERLEAVED_TYPES and rows % GROUP_ROWS == 0 and part[1].stride(0) == row_bytes
    )


def _shape(part: GGUFBlocks) -> tuple[int, int]:
    """[rows, row_bytes] of a part's blocks in row order."""
    _, data, index = part
    return (index.numel() if index is not None else data.shape[0]), data.shape[1]


def interleave_rows(part: GGUFBlocks, out: torch.Tensor | None = None) -> GGUFBlocks:
    """A part's rows copied once (in the row index's order) into groups of 16 rows, the
    layout of the group kernels (infire_repack_rows16 in cpu_forward.c): the same bytes,
    reordered. `out`: the [rows, row_bytes] uint8 tensor to write (new by default)."""
    if not _groups_fit(part):
        raise ValueError("only whole Q4_0, Q4_1, Q8_0 or Q4_K rows, a multiple of 16, interleave")
    kind, data, index = part
    rows, row_bytes = _shape(part)
    out = torch.empty(rows, row_bytes, dtype=torch.uint8) if out is None else out
    _library().infire_repack_rows16(
        kind, rows, ctypes.c_long(data.shape[1]), _ptr(data.data_ptr()),
        ctypes.c_long(data.stride(0)), None if index is None else _ptr(index.data_ptr()),
        _ptr(out.data_ptr()),
    )  # fmt: skip
    return kind, out, None


class Arena:
    """Memory for the interleaved copies, carved 64-byte aligned from chunks of 64 MiB
    (a larger copy gets its own; a chunk's last huge page is resident whole however
    little of it is used: with 8 MiB chunks that took the 0.54B Q4_K_M's peak RSS from
    475 to 512 MB, with 64 MiB 477). Each chunk is its own mapping (_chunk), so the copies,
    a few hundred KB each, do not sit in the C heap between a batch's scratch allocations,
    where they would keep freed pages from being returned."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.used = self.CHUNK

    @staticmethod
    def _chunk(size: int) -> torch.Tensor:
        """size bytes of their own private mapping, 2 MiB-aligned and advised to the
        kernel's transparent huge pages where it has them: the batch kernels stream these
        copies once a step, and on 4 KiB pages that crosses a page (its TLB walk, the
        hardware prefetchers' stop) every 4 KiB."""
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        if not flags:
            return torch.empty(size, dtype=torch.uint8)
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)
        with contextlib.suppress(AttributeError, OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        whole = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
        start = -whole.ctypes.data % HUGE_PAGE
        return torch.from_numpy(whole[start : start + size])

    def take(self, rows: int, row_bytes: int) -> torch.Tensor:
        """An uninitialized [rows, row_bytes] uint8 tensor."""
        size = rows * row_bytes
        if size > self.CHUNK:
            self.chunks.append(self._chunk(size))
            return self.chunks[-1].view(rows, row_bytes)
        if self.used + size > self.CHUNK:
            self.chunks.append(self._chunk(self.CHUNK))
            self.used = 0
        out = self.chunks[-1][self.used : self.used + size].view(rows, row_bytes)
        self.used += -(-size // 64) * 64
        return out


def _library() -> ctypes.CDLL:
    lib = load_library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib


# A weight as a GGUF file stores it: GGML type id, [rows, row_bytes] uint8 blocks, and
# int32 [rows] (row r is stored at index[r]) or None (in order)
GGUFBlocks = tuple[int, torch.Tensor, "torch.Tensor | None"]
# A checkpoint's tensor as its GGUFBlocks, or None (models/gguf.py GGUFSource.blocks)
Blocks = Callable[[str], "GGUFBlocks | None"]


def block_layout(kind: int) -> tuple[int, int]:
    """(values, bytes) of one block of a GGML type the kernel reads (a float type: one
    value)."""
    return _BLOCK_LAYOUT[kind]


def block_rows(part: GGUFBlocks, start: int, count: int) -> GGUFBlocks:
    """Rows [start, start + count) of a weight's blocks: a view (or the row index's slice)."""
    kind, data, index = part
    if index is None:
        return kind, data[start : start + count], None
    return kind, data, index[start : start + count]


def block_columns(part: GGUFBlocks, start: int, count: int) -> GGUFBlocks:
    """Columns [start, start + count) of every row of a weight's blocks, a view; a
    ValueError where the cut would split a block."""
    kind, data, index = part
    values, size = block_layout(kind)
    if start % values or count % values:
        raise ValueError(
            f"columns {start}..{start + count} split its {READ_TYPES[kind]} blocks of {values} "
            f"values: choose a tensor parallel size whose share of the columns is a multiple "
            f"of {values}, or --quantization none"
        )
    return kind, data[:, start // values * size : (start + count) // values * size], index


_LAYER = "model.layers.{}."


def gguf_weight_names(config: ModelConfig, names: list[str]) -> list[str] | str:
    """The checkpoint tensors a fused forward over GGUF blocks holds as QuantWeights (every
    matmul weight, the embedding and the head), or why it cannot run this model so."""
    present = set(names)
    wanted = ["model.embed_tokens.weight"]
    if "lm_head.weight" in present:
        wanted.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = _LAYER.format(i)
        wanted += [f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"]
        if f"{layer}mlp.gate_proj.weight" in present:
            wanted += [f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        else:
            experts = getattr(config, "num_experts", 0)
            wanted.append(f"{layer}mlp.gate.weight")
            wanted += [f"{layer}mlp.experts.{e}.{p}_proj.weight"
                       for e in range(experts) for p in ("gate", "up", "down")]  # fmt: skip
    missing = [name for name in wanted if name not in present]
    if missing:
        return f"no tensor {missing[0]} in the file"
    return wanted


# GGML types the kernel reads: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
READ_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
              8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}  # fmt: skip
_BLOCK_LAYOUT = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22),
                 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}  # fmt: skip


def gguf_blocks_reason(config: ModelConfig, names: list[str], blocks: Blocks) -> str | None:
    """Why this model's GGUF blocks cannot be served by the kernel (a tensor it needs is
    missing, or of a type it does not read), or None."""
    wanted = gguf_weight_names(config, names)
    if isinstance(wanted, str):
        return wanted
    for name in wanted:
        stored = blocks(name)
        if stored is None or stored[0] not in READ_TYPES:
            kind = "1-D" if stored is None else f"GGML type {stored[0]}"
            return f"{name} is {kind}, which the kernel does not read"
    return None


def dequantize_rows(weight: QuantWeight, first: int, count: int, cols: int) -> torch.Tensor:
    """Rows [first, first + count) of a QuantWeight decoded by the kernel, as float32."""
    lib = _library()
    out = torch.empty(count, cols)
    lib.infire_dequantize_rows(ctypes.byref(weight), first, count, cols, _ptr(out.data_ptr()))
    return out


def dequantize_gather(weight: QuantWeight, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows `ids` (int64) of a QuantWeight decoded by the kernel, as float32 [len(ids), cols]."""
    lib = _library()
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), cols)
    lib.infire_dequantize_gather(ctypes.byref(weight), _ptr(ids.data_ptr()), ids.numel(), cols,
                                 _ptr(out.data_ptr()))  # fmt: skip
    return out


# "avx-vnni": the 256-bit products with VNNI (AVX-VNNI's instructions, or the same in
# AVX512-VNNI's 256-bit form on a CPU that has that instead); equal to AVX2's bit for bit
QUANT_ISAS = {1: "avx2", 2: "avx512-vnni", 3: "avx-vnni"}


def dense_linear(tiles: torch.Tensor, rows: int, x: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [n, cols] float32 times a float32 or bf16 weight of `rows` rows in the kernel's
    tiles (tile_weight), plus `bias`: float32 activations, float32 sums."""
    lib = _library()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], rows)
    bias_ptr = None if bias is None else _ptr(bias.data_ptr())
    lib.infire_dense_linear(_ptr(tiles.data_ptr()), int(tiles.dtype == torch.bfloat16), bias_ptr,
                            _ptr(x.data_ptr()), x.shape[0], x.shape[1], _ptr(y.data_ptr()), rows)  # fmt: skip
    return y


def _check_heads(q: torch.Tensor, *kv: torch.Tensor) -> None:
    if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"the kernel's attention takes a head dim a multiple of 8, at most {MAX_HEAD_DIM}"
        )
    if len({t.dtype for t in kv}) != 1 or kv[0].dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            "the kernel's attention takes keys and values of one dtype, float32 or bf16"
        )


def dense_addresses(k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    """int64 [2, S]: the addresses of S sequences' keys and values ([heads, keys, head_dim]
    each, contiguous, float32 or bf16, one dtype), checked, for attend_dense (which reads
    them while the tensors live: keep them)."""
    _check_heads(k[0], *k, *v)
    heads, _, head_dim = k[0].shape
    for t, u in zip(k, v, strict=True):
        if t.shape != u.shape or (t.shape[0], t.shape[2]) != (heads, head_dim):
            raise ValueError("attend_dense takes [heads, keys, head_dim] keys and values")
        if not (t.is_contiguous() and u.is_contiguous()):
            raise ValueError("attend_dense takes contiguous keys and values")
    return torch.tensor([[t.data_ptr() for t in k], [t.data_ptr() for t in v]], dtype=torch.int64)


def attend_dense(q: torch.Tensor, addresses: torch.Tensor, keys: torch.Tensor, bf16: bool,
                 seq: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T scale) v of each query q[i] ([n, heads, head_dim] float32) over the
    keys[seq[i]] keys and values of its sequence seq[i] (`addresses` from dense_addresses,
    `bf16` their dtype): float32 scores, sums and result [n, heads, head_dim]."""
    n, heads, head_dim = q.shape
    q, seq = q.float().contiguous(), seq.to(torch.int32).contiguous()
    keys, addresses = keys.to(torch.int32).contiguous(), addresses.contiguous()
    out = torch.empty(n, heads, head_dim)
    _library().infire_attend_dense(
        _ptr(q.data_ptr()), _ptr(addresses[0].data_ptr()), _ptr(addresses[1].data_ptr()),
        int(bf16), _ptr(seq.data_ptr()), _ptr(keys.data_ptr()), n, heads, head_dim,
        ctypes.c_float(scale), _ptr(out.data_ptr()),
    )  # fmt: skip
    return out


def attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                 seq: torch.Tensor, context: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Attention over a paged cache: k and v [blocks, block_size, heads, head_dim] (float32
    or bf16); query i (q [n, heads, head_dim] float32) over the first context[i] keys of
    sequence seq[i], whose blocks are tables[seq[i]] (int32 [sequences, max_blocks]).
    Float32 result [n, heads, head_dim]."""
    _check_heads(q, k, v)
    n, heads, head_dim = q.shape
    if (
        k.shape != v.shape
        or k.shape[2:] != (heads, head_dim)
        or not (k.is_contiguous() and v.is_contiguous())
    ):
        raise ValueError(
            "attend_paged takes contiguous [blocks, block_size, heads, head_dim] k and v"
        )
    q, tables = q.float().contiguous(), tables.to(torch.int32).contiguous()
    seq, context = seq.to(torch.int32).contiguous(), context.to(torch.int32).contiguous()
    out = torch.empty(n, heads, head_dim)
    _library().infire_attend_paged(
        _ptr(q.data_ptr()), _ptr(k.data_ptr()), _ptr(v.data_ptr()), int(k.dtype == torch.bfloat16),
        heads, head_dim, k.shape[1], _ptr(tables.data_ptr()), tables.shape[1], _ptr(seq.data_ptr()),
        _ptr(context.data_ptr()), n, ctypes.c_float(scale), _ptr(out.data_ptr()),
    )  # fmt: skip
    return out


def quant_isa(wanted: str | None = None) -> str:
    """The instruction set of the GGUF products ("avx2", "avx512-vnni" or "avx-vnni"): the
    best this CPU has, or `wanted` where it has that (for tests and benchmarks)."""
    lib = _library()
    code = {name: number for number, name in QUANT_ISAS.items()}.get(wanted or "", 0)
    return QUANT_ISAS[lib.infire_quant_isa(code)]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first index of each row's largest, NaN the largest) of a 2-D
    float32 CPU tensor through the kernel library, else through torch. Torch's took 0.8-1.2
    ms on a batch's 32 rows of a 49152-token vocabulary on 2 threads, ~0.7% of a batch-32
    decode step of the 0.54B Q4_K_M."""
    usable = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
    if not usable or not x.is_contiguous() or x.shape[1] == 0:
        return x.argmax(dim=-1)
    lib = load_library()
    if isinstance(lib, str):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.infire_argmax_rows(_ptr(x.data_ptr()), x.shape[0], x.shape[1], _ptr(out.data_ptr()))
    return out


def quant_linear(
    weight: QuantWeight,
    x: torch.Tensor,
    runs: list[int] | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, cols] float32 times a QuantWeight's transpose (+ bias [rows]), through the
    forward's kernel: a new tensor, or added into `out` [n, rows] (as o_proj and down add
    into the residual). `runs` (for the tests): the weight's units (groups of 16
    interleaved rows, pairs of others) cut into runs [runs[i - 1], runs[i]) (runs[0] = 0,
    the last all the units), taken on one thread, the last run first, as a thread taking
    another's from their back does."""
    lib = _library()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.rows) if out is None else out
    if y.shape != (x.shape[0], weight.rows) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError("out is a contiguous float32 [n, rows] tensor")
    if bias is not None and bias.numel() != weight.rows:
        raise ValueError(f"a bias of {weight.rows} values, not {bias.numel()}")
    b = None if bias is None else bias.float().contiguous()
    args = (ctypes.byref(weight), None if b is None else _ptr(b.data_ptr()), _ptr(x.data_ptr()),
            x.shape[0], x.shape[1], _ptr(y.data_ptr()), weight.rows, int(out is not None))  # fmt: skip
    if runs is None:
        lib.infire_quant_linear(*args)
    else:
        cuts = (ctypes.c_int * len(runs))(*runs)
        lib.infire_quant_linear_runs(*args, cuts, len(runs))
    return y


@cache
def load_library() -> ctypes.CDLL | str:
    """The compiled kernel library, or why it is unavailable (compiled on first call)."""
    return declare(compile_library(SOURCE, tuple(CFLAGS)))


def declare(lib: ctypes.CDLL | str) -> ctypes.CDLL | str:
    """A build of cpu_forward.c with its functions' return types declared (a reason string
    passes through)."""
    if isinstance(lib, str):
        return lib
    lib.infire_forward.restype = ctypes.c_int
    lib.infire_forward_workspace.restype = ctypes.c_long
    lib.infire_forward_workspace.argtypes = [ctypes.POINTER(_Model), ctypes.c_int]
    return lib


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> the kernel's layout [rows/4, cols/16, 4, 16], rows zero-padded to 4.

    bf16 16-chunks are stored as (w0-3, w8-11, w4-7, w12-15), so unpacking the low and high
    halves of each 128-bit lane under zeros gives columns 0-7 and 8-15 as fp32.
    """
    rows, cols = weight.shape
    pad = -rows % TILE_ROWS
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, cols)])
    tiles = weight.reshape(-1, TILE_ROWS, cols // TILE_COLS, TILE_COLS).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        tiles = tiles.reshape(*tiles.shape[:-1], 2, 2, 4).transpose(-2, -3)
    return tiles.contiguous()


def _palette_order() -> np.ndarray:
    """Where each of a 4x16 tile chunk's 64 weights is stored in its palette chunk: two
    halves (rows 0-1, rows 2-3) of 32, ordered so that unpacking the low and high bytes of
    a half (low, high 128-bit lane pairs) gives its two rows in the bf16 tile layout."""
    order = []
    for half in range(2):
        a, b = 2 * half, 2 * half + 1
        for row, cols in ((a, 0), (a, 8), (b, 0), (b, 8), (a, 4), (a, 12), (b, 4), (b, 12)):
            order += [row * TILE_COLS + cols + i for i in range(4)]
    return np.array(order)


_PALETTE_ORDER = _palette_order()


def palette_tile_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A bf16 [rows, cols] weight in the kernel's palette form (PaletteWeight in
    cpu_forward.c): the 16 most common exponents, per 4x16 tile chunk 32 index bytes and 64
    sign|mantissa bytes, and the exponents of chunks that leave the palette verbatim."""
    rows, cols = weight.shape
    bits = weight.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
    bits = np.concatenate([bits, np.zeros((-rows % TILE_ROWS, cols), dtype=np.uint16)])
    tiles = len(bits) // TILE_ROWS
    chunks = bits.reshape(tiles, TILE_ROWS, cols // TILE_COLS, TILE_COLS).transpose(0, 2, 1, 3)
    stored = chunks.reshape(-1, TILE_ROWS * TILE_COLS)[:, _PALETTE_ORDER]
    exponent = ((stored >> 7) & 0xFF).astype(np.uint8)
    chosen = palette.choose(exponent)
    lookup = np.full(256, 255, dtype=np.uint8)
    lookup[chosen] = np.arange(len(chosen), dtype=np.uint8)
    index = lookup[exponent]
    outside = index == 255
    flags = outside.any(axis=1)
    index[outside] = 0
    halves = index.reshape(-1, 2, 32)
    packed = (halves[:, :, :16] | (halves[:, :, 16:] << 4)).reshape(-1, 32)
    rest = (((stored >> 8) & 0x80) | (stored & 0x7F)).astype(np.uint8)
    per_tile = flags.reshape(tiles, -1).sum(axis=1)
    arrays = {
        "palette": np.pad(chosen, (0, palette.PALETTE_SIZE - len(chosen))),
        "chunks": np.concatenate([packed, rest], axis=1),
        "flags": flags.astype(np.uint8),
        "verbatim": exponent[flags],
        "tile_verbatim": (np.cumsum(per_tile) - per_tile).astype(np.uint32),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def available() -> bool:
    """Whether this CPU runs the kernel and the library builds (cached after the first call)."""
    return _cpu_reason() is None and not isinstance(load_library(), str)


def _cpu_reason() -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"CPU capability is {capability}, the kernel needs AVX2 and FMA"
    return None


def unsupported_reason(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the fused forward cannot run this model here, or None if it can."""
    if device.type != "cpu":
        return f"device is {device.type}"
    if _cpu_reason() is not None:
        return _cpu_reason()
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (the kernel handles float32 and bfloat16)"
    q_size = config.num_attention_heads * config.head_dim
    for name, size in (
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("num_attention_heads * head_dim", q_size),
    ):
        if size % TILE_COLS:
            return f"{name} {size} is not a multiple of {TILE_COLS}"
    if config.head_dim % 8 or config.head_dim > MAX_HEAD_DIM:
        return f"head_dim {config.head_dim} (needs a multiple of 8, at most {MAX_HEAD_DIM})"
    expert_size = getattr(config, "moe_intermediate_size", 0)
    if expert_size % TILE_COLS:
        return f"moe_intermediate_size {expert_size} is not a multiple of {TILE_COLS}"
    return None


class CpuForward:
    """A step's tokens, embedding to logits, in one C call.

    Holds its own tiled copies of the weights (the PyTorch model keeps its own for the
    work this does not take: fp32 prefill, where oneDNN's GEMM is faster). With `palette`
    (bf16 only) the matmul weights and the embedding are held in Unweight's palette form
    instead, 12 bits a weight plus the chunks that need verbatim exponents. With `blocks`
    they are held as GGUF blocks: the parts that can (can_interleave) are copied once
    into groups of 16 rows (interleave_rows; not with INFIRE_NO_REPACK=1), and
    `release(name)` drops the file's pages of each copied tensor from the process (again
    once all are copied: a later read of a neighbour may have mapped some back).
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        palette: bool,
        blocks: Blocks | None = None,
        release: Callable[[str], None] | None = None,
    ) -> None:
        self.lib = lib
        config: ModelConfig = model.config
        self.vocab = config.vocab_size
        self.quantized = blocks is not None
        bf16 = model.embed_tokens.weight.dtype == torch.bfloat16 and not self.quantized
        self.palette = palette and bf16
        # In fp32 PyTorch's GEMM beats the kernel on prefill; in bf16 (no bf16 instructions
        # on AVX2 CPUs) the kernel is ~5x faster than PyTorch, so it takes prefill too. GGUF
        # blocks are held here only: the kernel takes every step.
        self.takes_prefill = bf16 or self.quantized
        # fp32 RoPE tables even when the model's buffers were cast to bf16
        rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.cos, self.sin = rope.tables()
        layers = model.layers
        keep: list[torch.Tensor] = []  # every weight tensor the struct points into
        structs: list[_PaletteWeight] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            keep.append(t)
            return t.data_ptr()

        def array(tensors: list[torch.Tensor | None]) -> ctypes.Array:
            return (_ptr * len(tensors))(*(ptr(t) for t in tensors))

        quant: list[QuantWeight] = []
        group = self.quantized and interleaves()
        arena = Arena()
        copied: list[str] = []  # tensors held as interleaved copies

        def weight(w: torch.Tensor | list[str]) -> int | None:
            """A matmul weight in the kernel's form: tiled, a PaletteWeight, or (given the
            names of its row parts) a QuantWeight of their GGUF blocks."""
            if isinstance(w, list):
                parts = [blocks(name) for name in w]
                grouped = [group and can_interleave(part) for part in parts]
                parts = [interleave_rows(p, arena.take(*_shape(p))) if g else p
                         for p, g in zip(parts, grouped, strict=True)]  # fmt: skip
                for name in (name for name, g in zip(w, grouped, strict=True) if g):
                    copied.append(name)
                    if release is not None:
                        release(name)
                quant.append(QuantWeight(parts, grouped))
                keep.extend(quant[-1].tensors)
                return ctypes.addressof(quant[-1])
            if not self.palette:
                return ptr(tile_weight(w.data))
            arrays = palette_tile_weight(w.data)
            structs.append(
                _PaletteWeight(*(ptr(arrays[name]) for name, _ in _PaletteWeight._fields_))
            )
            return ctypes.addressof(structs[-1])

        def tiled(layer_weights: list[torch.Tensor]) -> ctypes.Array:
            return (_ptr * len(layer_weights))(*(weight(w) for w in layer_weights))

        def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.data.float().contiguous()

        def tiled_or_none(layer_weights: list[torch.Tensor | None]) -> ctypes.Array:
            return (_ptr * len(layer_weights))(
                *(None if w is None else weight(w) for w in layer_weights)
            )

        # the head first: its copy (the largest) is made while no other copy is held,
        # so the load's peak is the final size plus one of the layers' tensors
        tied = model.lm_head.weight is model.embed_tokens.weight
        if self.quantized:  # tokens are embedded from their row of blocks
            lm_head = weight(["model.embed_tokens.weight" if tied else "lm_head.weight"])
            embed = lm_head if tied else weight(["model.embed_tokens.weight"])
        else:
            lm_head = weight(model.lm_head.weight)
            if not self.palette:
                embed = ptr(model.embed_tokens.weight.data)
            elif tied:  # tokens are embedded from the lm_head's palette tiles
                embed = lm_head
            else:
                embed = weight(model.embed_tokens.weight)
        attn = [layer.self_attn for layer in layers]
        mlp = [layer.mlp for layer in layers]
        moe = [getattr(m, "experts", None) for m in mlp]  # Mixtral's SparseMoeBlock
        dense = [None if e is not None else m for m, e in zip(mlp, moe, strict=True)]
        num_experts = getattr(config, "num_experts", 0)
        # each matmul weight: the module's tensor, or with GGUF blocks the names of its parts
        quantized = self.quantized
        at = [_LAYER.format(i) for i in range(len(layers))]
        attn_names = [[f"{p}self_attn.{x}_proj.weight" for x in "qkv"] for p in at]
        self._arrays = [
            tiled(attn_names if quantized else [a.qkv_proj.weight for a in attn]),
            array([fp32(a.qkv_proj.bias) for a in attn]),
            tiled(
                [[f"{p}self_attn.o_proj.weight"] for p in at]
                if quantized
                else [a.o_proj.weight for a in attn]
            ),  # fmt: skip
            tiled_or_none(
                [
                    None
                    if m is None
                    else [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
                    if quantized
                    else m.gate_up_proj.weight
                    for m, p in zip(dense, at, strict=True)
                ]
            ),  # fmt: skip
            tiled_or_none(
                [
                    None
                    if m is None
                    else [f"{p}mlp.down_proj.weight"]
                    if quantized
                    else m.down_proj.weight
                    for m, p in zip(dense, at, strict=True)
                ]
            ),  # fmt: skip
            array([fp32(layer.input_layernorm.weight) for layer in layers]),
            array([fp32(layer.post_attention_layernorm.weight) for layer in layers]),
        ]
        routers, gate_ups, downs = [], [], []
        for block, experts, p in zip(mlp, moe, at, strict=True):
            if experts is None:
                routers.append(None)
                gate_ups += [None] * num_experts
                downs += [None] * num_experts
            elif quantized:
                routers.append([f"{p}mlp.gate.weight"])
                named = [f"{p}mlp.experts.{e}." for e in range(num_experts)]
                gate_ups += [[f"{e}gate_proj.weight", f"{e}up_proj.weight"] for e in named]
                downs += [[f"{e}down_proj.weight"] for e in named]
            else:
                routers.append(block.gate.weight)
                gate_ups += list(experts.w13)
                downs += list(experts.w2)
        self._expert_arrays = [tiled_or_none(w) for w in (routers, gate_ups, downs)]
        top_k = getattr(config, "num_experts_per_tok", 0) if num_experts else 0
        expert_size = getattr(config, "moe_intermediate_size", 0) or config.intermediate_size
        norm_topk = bool(getattr(config, "norm_topk_prob", True))
        # Qwen3's per-head q/k RMSNorm (fp32 [head_dim] per layer), NULL arrays where none
        qk_norms = [
            array([fp32(a.q_norm.weight) for a in attn]) if attn[0].q_norm is not None else None,
            array([fp32(a.k_norm.weight) for a in attn]) if attn[0].k_norm is not None else None,
        ]
        self._norm_arrays = qk_norms
        self.struct = _Model(
            config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size, kv_cache.shape[3], bf16, kv_cache.dtype == torch.bfloat16,
            self.palette, quantized, config.rms_norm_eps, config.head_dim**-0.5, kv_cache.shape[2],
            *self._arrays, ptr(fp32(model.norm.weight)), embed, lm_head, kv_cache.data_ptr(),
            num_experts, top_k, *self._expert_arrays, norm_topk, expert_size,
            *(ctypes.cast(a, ctypes.POINTER(_ptr)) if a is not None else None for a in qk_norms),
        )  # fmt: skip
        self._keep = [*keep, kv_cache]
        self._structs = structs
        self._quant = quant
        self.interleaved = len(copied)  # tensors held in groups of 16 rows
        for name in copied if release is not None else ():
            release(name)
        # bytes of the weights this forward holds (each storage once)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in keep}
        self.weight_bytes = sum(storages.values())
        self._workspace = torch.empty(0)
        self._logits = torch.empty(0)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        dtype: torch.dtype,
        palette: bool = False,
        blocks: Blocks | None = None,
        release: Callable[[str], None] | None = None,
    ) -> CpuForward | str:
        """A fused forward for this model and pool (with `palette`, bf16 weights held in the
        palette form; with `blocks`, the matmul weights and embedding held as GGUF blocks,
        `release` dropping a copied tensor's file pages), or the reason there cannot be
        one."""
        reason = unsupported_reason(model.config, dtype, kv_cache.device)
        if reason is not None:
            return reason
        lib = load_library()
        if isinstance(lib, str):
            return lib
        return cls(lib, model, kv_cache, palette, blocks, release)

    def forward(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_of_token: list[int],
        block_tables: list[list[int]],
        logit_rows: list[int],
    ) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] (float32) after running the tokens; writes their KV.

        Token i is at positions[i] of sequence seq_of_token[i] (whose block table is
        block_tables[seq_of_token[i]]); its earlier context is in the pool or among the tokens.
        The logits live in a buffer the next forward overwrites (the step's sampler reads
        them first), sized by the largest batch so far: a batch's fresh 6 MB, above glibc's
        fixed mmap threshold, was mapped and zeroed every step (4 ms of a 130 ms step alone).
        """
        n, num_logits = len(token_ids), len(logit_rows)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        ints = torch.tensor(positions + seq_of_token + logit_rows, dtype=torch.int32)
        longs = torch.tensor(token_ids + slots, dtype=torch.int64)
        pos, seqs, rows = ints[:n], ints[n : 2 * n], ints[2 * n :]
        cos, sin = self.cos[pos], self.sin[pos]
        need = self.lib.infire_forward_workspace(ctypes.byref(self.struct), n)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need)
        if self._logits.numel() < num_logits * self.vocab:
            self._logits = torch.empty(num_logits * self.vocab)
        logits = self._logits[: num_logits * self.vocab].view(num_logits, self.vocab)
        args = (longs[:n], pos, cos, sin, longs[n:], seqs, tables)
        self.lib.infire_forward(
            ctypes.byref(self.struct), ctypes.c_int(n), *(_ptr(t.data_ptr()) for t in args),
            ctypes.c_int(width), ctypes.c_int(num_logits), _ptr(rows.data_ptr()),
            _ptr(self._workspace.data_ptr()), _ptr(logits.data_ptr()),
        )  # fmt: skip
        return logits
