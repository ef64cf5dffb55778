"""Lazy weight sources: a checkpoint's tensors by Hugging Face name, read one at a time.

A `WeightSource` is what `load_model` hands to the model: it knows every tensor's name
and shape but reads nothing until a layer asks, and then only the rows or columns that
layer keeps (a tensor-parallel rank reads its slice, a pipeline stage only its layers).
So loading never holds a second copy of the model: `read_into` copies into the model's
own parameters a bounded piece at a time, so the peak is the model plus a few MB (plus
one whole tensor for a format that decodes only whole tensors). Formats plug in by implementing `names`, `shape` and `_read`: safetensors here,
GGUF in gguf.py, Unweight folders in unweight/container.py. A source is also a read-only
Mapping (`source[name]` reads the whole tensor), so code that wants a dict still can.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from infire.errors import ModelLoadError

# Values `read_into` reads at once: bounds the scratch of a load to ~16 MB of float32
PIECE_VALUES = 1 << 22


class WeightSource(Mapping[str, torch.Tensor]):
    """Checkpoint tensors by Hugging Face name, each read from disk when asked for."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # tensors are returned as this dtype (None: as stored)

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor's name, in the order reading them is cheapest (file order)."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name` (nothing is read)."""

    @abstractmethod
    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Indices [start, start + length) of dimension `dim` of `name`, in any float dtype."""

    def read(
        self, name: str, dim: int = 0, start: int = 0, length: int | None = None
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of `name`, as `dtype`."""
        length = self._checked_length(name, dim, start, length)
        tensor = self._read(name, dim, start, length)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def read_into(
        self, out: torch.Tensor, name: str, dim: int = 0, start: int = 0, length: int | None = None
    ) -> None:
        """Copy what `read` returns into `out` (any dtype), a piece of rows at a time where
        the format can read pieces: loading then needs no whole-tensor scratch copy."""
        length = self._checked_length(name, dim, start, length)
        shape = self.shape(name)
        rows = shape[0] if shape else 1
        piece = self._rows_per_piece(name)
        if dim == 0 and piece < length:
            for first in range(start, start + length, piece):
                last = min(first + piece, start + length)
                out[first - start : last - start].copy_(self._read(name, 0, first, last - first))
        elif dim == 1 and piece < rows:
            for first in range(0, rows, piece):
                last = min(first + piece, rows)
                part = self._read(name, 0, first, last - first)
                out[first:last].copy_(part.narrow(1, start, length))
        else:
            out.copy_(self._read(name, dim, start, length))

    def _rows_per_piece(self, name: str) -> int:
        """Rows `read_into` reads at once: ~16 MB of float32 (a source that can only read
        whole tensors says all of them)."""
        shape = self.shape(name)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        return max(1, PIECE_VALUES // row)

    def _checked_length(self, name: str, dim: int, start: int, length: int | None) -> int:
        shape = self.shape(name)
        size = shape[dim] if shape else 1
        length = size - start if length is None else length
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{name}: [{start}, {start + length}) is outside dimension {dim} "
                             f"of shape {list(shape)}")  # fmt: skip
        return length

    def get_slice(self, name: str) -> LazyTensor:
        """A handle on one tensor that reads it (or a slice of it) on demand."""
        if name not in self:
            raise KeyError(name)
        return LazyTensor(self, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self.read(name)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read the tensor to answer
        return name in self._name_set()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def _name_set(self) -> frozenset[str]:
        names = getattr(self, "_names_cache", None)
        if names is None:
            names = frozenset(self.names())
            self._names_cache = names
        return names


@dataclass(frozen=True, slots=True)
class LazyTensor:
    """One checkpoint tensor, not read yet: what a layer's `load_shard` receives."""

    source: WeightSource
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The full tensor's shape."""
        return self.source.shape(self.name)

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Indices [start, start + length) along `dim` (the whole tensor by default)."""
        return self.source.read(self.name, dim, start, length)

    def read_into(
        self, out: torch.Tensor, dim: int = 0, start: int = 0, length: int | None = None
    ) -> None:
        """The same, copied into `out` a bounded piece at a time."""
        self.source.read_into(out, self.name, dim, start, length)


def _narrow(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    if tensor.dim() == 0 or (start == 0 and length == tensor.shape[dim]):
        return tensor
    return tensor.narrow(dim, start, length)


class DictSource(WeightSource):
    """Tensors already in memory (tests, conversions) behind the same interface."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
        super().__init__(dtype)
        self._weights = weights

    def names(self) -> list[str]:
        """The dict's keys."""
        return list(self._weights)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self._weights[name].shape)

    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        return _narrow(self._weights[name], dim, start, length)


def as_source(weights: Mapping[str, torch.Tensor]) -> WeightSource:
    """`weights` itself if it is a WeightSource, else a DictSource over it."""
    return weights if isinstance(weights, WeightSource) else DictSource(weights)


class SafetensorsSource(WeightSource):
    """The *.safetensors files of a folder, read with `get_slice`: a rank reads its slice.

    A file is opened (memory-mapped) per read and closed after it, so the mapped pages of
    tensors already read never add up in this process's resident memory.
    """

    def __init__(self, files: list[Path], dtype: torch.dtype | None) -> None:
        super().__init__(dtype)
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with self._open(file) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._file_of[name] = file
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())

    def names(self) -> list[str]:
        """Tensor names, file by file."""
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape from the file header."""
        return self._shapes[name]

    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        file = self._file_of[name]
        with self._open(file) as f:
            index = (slice(None),) * dim + (slice(start, start + length),)
            try:
                if not self._shapes[name]:
                    return f.get_tensor(name)
                return f.get_slice(name)[index]
            except (SafetensorError, RuntimeError, ValueError) as e:
                raise ModelLoadError(f"{file}: cannot read {name}: {e}") from None

    @staticmethod
    def _open(file: Path):  # noqa: ANN205 (safetensors' handle has no public type)
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{file}: cannot read safetensors (truncated or corrupt?): {e}"
            ) from None
