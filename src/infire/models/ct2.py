"""CTranslate2's `model.bin`: the weights of a converted model, read as they are stored.

The file (binary version 6, written by ctranslate2.specs.ModelSpec) is little-endian:

    u32 version, string spec name, u32 spec revision, u32 variable count,
    per variable: string name, u8 rank, u32 x rank dims, u8 dtype, u32 byte count, bytes
    u32 alias count, per alias: string alias, string variable name

where a string is a u16 length (the terminating NUL included), the UTF-8 bytes and a NUL,
and dtype indexes (float32, int8, int16, int32, float16, bfloat16). Names are scopes
joined by "/" (`decoder/layer_0/self_attention/linear_0/weight`). A model may be split
into parts (`model.bin.part1`, `model.bin.part2`, ...: packages that cap a file's size);
they are read as one stream. Scalars (rank 0) are the spec's settings (`num_heads`,
`pre_norm`). Weights quantized to int8/int16 come with a `.../weight_scale`; the files
infire reads are float, and an integer weight is refused by the model that asks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infire.errors import ModelLoadError

DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")


@dataclass(frozen=True, slots=True)
class CT2Model:
    """A model.bin: its spec's name and revision, and every variable by name (aliases
    resolved to the tensor they name)."""

    spec: str
    revision: int
    variables: dict[str, torch.Tensor]

    def scalar(self, name: str) -> int:
        return int(self.variables[name].item())


def model_parts(folder: Path) -> list[Path]:
    """model.bin, or its parts in order (model.bin.part1, part2, ...)."""
    whole = folder / "model.bin"
    if whole.is_file():
        return [whole]
    parts = sorted(folder.glob("model.bin.part*"), key=lambda p: int(p.suffix[5:] or 0))
    if not parts:
        raise ModelLoadError(f"{folder}: no model.bin (nor model.bin.part1, ...)")
    return parts


def is_ct2_folder(folder: Path) -> bool:
    folder = Path(folder)
    return folder.is_dir() and (
        (folder / "model.bin").is_file() or (folder / "model.bin.part1").is_file()
    )


def read_model_bin(parts: list[Path]) -> CT2Model:
    """Every variable of a model.bin (the parts joined), as torch tensors over one buffer."""
    data = (
        b"".join(part.read_bytes() for part in parts) if len(parts) > 1 else parts[0].read_bytes()
    )
    buffer = bytearray(data)  # writable: torch.frombuffer shares it without a copy
    reader = _Reader(buffer, str(parts[0]))
    version = reader.unpack("<I")
    if version < 5 or version > 6:
        raise ModelLoadError(f"{parts[0]}: CTranslate2 binary version {version} (read: 5, 6)")
    spec, revision = reader.string(), reader.unpack("<I")
    variables: dict[str, torch.Tensor] = {}
    for name, tensor in reader.variables(reader.unpack("<I")):
        variables[name] = tensor
    for _ in range(reader.unpack("<I")):
        alias, target = reader.string(), reader.string()
        if target not in variables:
            raise ModelLoadError(f"{parts[0]}: alias {alias!r} names no variable {target!r}")
        variables[alias] = variables[target]
    if reader.at != len(buffer):
        raise ModelLoadError(f"{parts[0]}: {len(buffer) - reader.at} bytes after the aliases")
    return CT2Model(spec, revision, variables)


class _Reader:
    def __init__(self, buffer: bytearray, where: str) -> None:
        self.buffer, self.at, self.where = buffer, 0, where

    def unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            raise ModelLoadError(f"{self.where}: truncated at byte {self.at}")
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.unpack("<H")
        raw = bytes(self.buffer[self.at : self.at + length - 1])
        self.at += length
        return raw.decode("utf-8")

    def variables(self, count: int) -> Iterator[tuple[str, torch.Tensor]]:
        for _ in range(count):
            name = self.string()
            shape = [self.unpack("<I") for _ in range(self.unpack("<B"))]
            kind, size = self.unpack("<B"), self.unpack("<I")
            if kind >= len(DTYPES) or self.at + size > len(self.buffer):
                raise ModelLoadError(f"{self.where}: variable {name!r} is malformed")
            if DTYPES[kind] == "bfloat16":
                flat = torch.frombuffer(self.buffer, dtype=torch.bfloat16, count=size // 2,
                                        offset=self.at)  # fmt: skip
            else:
                dtype = np.dtype(DTYPES[kind])
                flat = torch.from_numpy(np.frombuffer(self.buffer, dtype, size // dtype.itemsize,
                                                      self.at))  # fmt: skip
            self.at += size
            yield name, flat.reshape(shape)


def variable_shapes(parts: list[Path]) -> dict[str, tuple[list[int], str]]:
    """Every variable's shape and dtype name, the data skipped (nothing large is read)."""
    stream = _Joined(parts)
    stream.unpack("<I")
    stream.string(), stream.unpack("<I")
    out = {}
    for _ in range(stream.unpack("<I")):
        name = stream.string()
        shape = [stream.unpack("<I") for _ in range(stream.unpack("<B"))]
        kind, size = stream.unpack("<B"), stream.unpack("<I")
        out[name] = (shape, str(np.dtype(DTYPES[kind])) if kind != 5 else "bfloat16")
        stream.skip(size)
    return out


class _Joined:
    """The parts as one stream that reads small fields and skips data."""

    def __init__(self, parts: list[Path]) -> None:
        self.files = [part.open("rb") for part in parts]
        self.index = 0

    def read(self, size: int) -> bytes:
        out = b""
        while len(out) < size and self.index < len(self.files):
            chunk = self.files[self.index].read(size - len(out))
            if not chunk:
                self.files[self.index].close()
                self.index += 1
            out += chunk
        if len(out) < size:
            raise ModelLoadError(f"{self.files[0].name}: truncated")
        return out

    def skip(self, size: int) -> None:
        while size > 0 and self.index < len(self.files):
            f = self.files[self.index]
            here, end = f.tell(), f.seek(0, 2)
            step = min(size, end - here)
            f.seek(here + step)
            size -= step
            if size > 0:
                f.close()
                self.index += 1

    def unpack(self, fmt: str) -> int:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<H"))[:-1].decode("utf-8")
