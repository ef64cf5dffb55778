"""Tensor-parallel linear layers (Megatron style), the identity wrappers at tp size 1.

ColumnParallelLinear splits the output features across ranks; RowParallelLinear splits
the input features and sums the partial products. Merged variants (QKV, gate+up) hold
several logical weights in one matrix so a layer runs one matmul instead of three.
QKVParallelLinear splits by heads: q heads evenly, KV heads evenly where there are at
least as many as ranks, else one KV head per rank, replicated (rank r takes KV head
r * kv_heads // tp). Each layer reads only its own slice of a checkpoint tensor from the
lazy weight source (models/weights.py), never the whole of it.

A layer may instead hold its slice of a quantized GGUF's blocks (`load_blocks`), memory-
mapped, never dequantized, and multiply through the fused CPU forward's kernel
(`quant_linear`): column slices take whole rows, row-parallel slices whole blocks of
every row (a cut inside a block is refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infire.parallel import SINGLE, TensorParallelGroup, kv_head_shard

if TYPE_CHECKING:
    from infire.kernels.cpu_forward import GGUFBlocks, QuantWeight
    from infire.kernels.triton_palette import GpuPalette, PaletteChoice
    from infire.models.weights import LazyTensor


class LinearBase(nn.Module):
    """Weight storage shared by the parallel linears: [out, in] as checkpoints have it, or,
    after loading, prepacked into oneDNN's blocked layout for CPU matmuls (on this class of
    CPU 1.5-2x faster than MKL's at the small batch sizes of decoding)."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    quant: QuantWeight | None = None  # the weight as GGUF blocks (then `weight` is empty)
    # the weight in Unweight's palette form for the Triton matmul (then `weight` is empty),
    # and how each batch size multiplies it (kernels/triton_palette.py)
    palette: GpuPalette | None = None
    palette_choice: PaletteChoice | None = None
    _block_parts: dict[int, GGUFBlocks] | None = None
    blocks_params = ("weight",)  # what load_blocks takes

    def pack_for_cpu(self) -> bool:
        """Replace the weight by a oneDNN-packed copy; False where oneDNN cannot pack it."""
        if self.quant is not None or self.palette is not None:
            return True  # the blocks, or the palette form, are their kernel's own layout
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
        except (RuntimeError, AttributeError):
            return False
        self.packed = packed
        self._drop_weight()
        return True

    def _drop_weight(self) -> None:
        """Leave an empty `weight` (of its dtype, on its device) where another form serves."""
        weight = self.weight
        self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                   requires_grad=False)  # fmt: skip

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for 2-D x, whatever the storage."""
        if self.quant is not None:
            from infire.kernels.cpu_forward import quant_linear

            y = quant_linear(self.quant, x).to(x.dtype)
            return y if bias is None else y + bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [None], "")
        if self.palette is not None:
            from infire.kernels.triton_palette import palette_decode, palette_matmul

            if self.palette_choice is not None and self.palette_choice.decodes(
                self.palette, x.shape[0]
            ):
                return F.linear(x, palette_decode(self.palette), bias)
            y = palette_matmul(x, self.palette).to(x.dtype)
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)

    def hold_palette(self, choice: PaletteChoice | None = None) -> bool:
        """Keep a bf16 weight in the palette form only (False where it does not take it)."""
        from infire.kernels.triton_palette import RUN, pack_palette

        weight = self.weight
        if self.quant is not None or weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return False
        if weight.shape[1] % RUN:
            return False
        self.palette, self.palette_choice = pack_palette(weight.data), choice
        self._drop_weight()
        return True

    def _hold_blocks(self, shard_index: int, part: GGUFBlocks, shards: int) -> None:
        """Keep one logical weight's blocks; with all `shards` of them, serve the weight so."""
        from infire.kernels.cpu_forward import QuantWeight

        self._block_parts = {**(self._block_parts or {}), shard_index: part}
        if len(self._block_parts) == shards:
            self.quant = QuantWeight([self._block_parts[i] for i in range(shards)])
            self._block_parts = None
            self._drop_weight()


def decode_blocks(part: GGUFBlocks, cols: int) -> torch.Tensor:
    """A weight's blocks decoded by the kernel, float32 [rows, cols]."""
    from infire.kernels.cpu_forward import QuantWeight, dequantize_rows

    weight = QuantWeight([part])
    return dequantize_rows(weight, 0, weight.rows, cols)


def check_blocks(part: GGUFBlocks, rows: int, cols: int) -> None:
    """A ValueError unless `part` holds a [rows, cols] weight."""
    from infire.kernels.cpu_forward import block_layout

    kind, data, index = part
    values, size = block_layout(kind)
    stored = (data.shape[0] if index is None else index.numel(), data.shape[1] // size * values)
    if stored != (rows, cols):
        raise ValueError(f"blocks: expected shape {[rows, cols]}, got {list(stored)}")


# oneDNN picks its blocking for this many rows; it stays fast from 1 to 512 rows.
PACK_BATCH_HINT = 32


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (output features) split across the tp group.

    `output_sizes` are the full sizes of the logical weights merged into this one; by
    default each is split evenly, `slices` gives each one's (start, length) explicitly."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
        slices: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.full_sizes = list(output_sizes)
        self.slices = slices or [tp.shard(size, "output size") for size in output_sizes]
        self.output_sizes = [length for _, length in self.slices]  # local, per logical weight
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """Read this rank's rows of logical weight `shard_index` (or of its bias)."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise KeyError(f"layer has no {name}")
        expected = (self.full_sizes[shard_index], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{name}: expected shape {list(expected)}, got {list(loaded.shape)}")
        start, length = self.slices[shard_index]
        offset = sum(self.output_sizes[:shard_index])
        loaded.read_into(param.data[offset : offset + length], 0, start, length)

    def load_blocks(self, name: str, part: GGUFBlocks, shard_index: int = 0) -> None:
        """Hold this rank's rows of logical weight `shard_index` as GGUF blocks (a view)."""
        from infire.kernels.cpu_forward import block_rows

        check_blocks(part, self.full_sizes[shard_index], self.input_size)
        start, length = self.slices[shard_index]
        self._hold_blocks(shard_index, block_rows(part, start, length), len(self.slices))

    def finish_blocks(self) -> None:
        """Where only some of a merged weight's parts came as blocks (another part's type
        the kernel does not read), decode those into the float weight."""
        for index, part in (self._block_parts or {}).items():
            offset = sum(self.output_sizes[:index])
            rows = decode_blocks(part, self.input_size)
            self.weight.data[offset : offset + rows.shape[0]] = rows
        self._block_parts = None


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection, split by heads (KV heads replicated where fewer than tp)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        q_first, q_count = tp.shard(num_heads, "num_attention_heads")
        kv_first, kv_count = kv_head_shard(num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = q_count, kv_count  # local
        q = (q_first * head_dim, q_count * head_dim)
        kv = (kv_first * head_dim, kv_count * head_dim)
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, full, bias, tp, slices=[q, kv, kv])


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's columns (input features) split; partial sums all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full_input_size = input_size
        self.input_start, self.input_size = tp.shard(input_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum over ranks.
        y = self.tp.all_reduce(self.matmul(x))
        return y + self.bias if self.bias is not None else y

    def load_shard(self, name: str, loaded: LazyTensor, shard_index: int = 0) -> None:
        """Read this rank's columns of the weight (or the whole bias)."""
        if name == "bias":
            if self.bias is None:
                raise KeyError("layer has no bias")
            if tuple(loaded.shape) != tuple(self.bias.shape):
                raise ValueError(f"bias: expected shape {list(self.bias.shape)}, got "
                                 f"{list(loaded.shape)}")  # fmt: skip
            loaded.read_into(self.bias.data)
            return
        expected = (self.weight.shape[0], self.full_input_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{name}: expected shape {list(expected)}, got {list(loaded.shape)}")
        loaded.read_into(self.weight.data, 1, self.input_start, self.input_size)

    def load_blocks(self, name: str, part: GGUFBlocks, shard_index: int = 0) -> None:
        """Hold this rank's columns of the weight as GGUF blocks: the same whole blocks of
        every row (a view); a ValueError where the rank's columns would split a block."""
        from infire.kernels.cpu_forward import block_columns

        check_blocks(part, self.weight.shape[0], self.full_input_size)
        self._hold_blocks(0, block_columns(part, self.input_start, self.input_size), 1)
