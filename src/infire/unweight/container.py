"""The compressed model folder: the original's config and tokenizer files, plus weights in
`unweight.safetensors`, a safetensors file of uint8 tensors any safetensors reader opens.

Each compressed tensor NAME contributes tensors `NAME::ARRAY` (its arrays, as raw bytes);
the header's `__metadata__["unweight"]` is a JSON object with the format version and, per
tensor, its form, original dtype and shape, SHA-256 and CRC32, form metadata (symbol
frequencies, palette stats, ...) and each array's numpy dtype and shape. docs/unweight-format.md has
every byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from infire.config import ModelConfig
from infire.kernels.triton_support import use_triton
from infire.models.checkpoint import open_checkpoint
from infire.models.hf_export import hf_config, write_hf_files
from infire.models.weights import WeightSource
from infire.tokenizer import Tokenizer
from infire.unweight import (
    CompressedTensor,
    UnweightError,
    compress_tensor,
    decompress_tensor,
    rans,
    rans_encoded,
)

WEIGHTS_FILE = "unweight.safetensors"
FORMAT = "unweight"
VERSION = 2
TENSOR_SETS = ("all", "linear", "mlp")
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Files of an HF folder that describe the model rather than hold weights.
_KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip


def is_unweight_folder(path: Path) -> bool:
    """Whether path is a folder holding an Unweight weights file."""
    return path.is_dir() and (path / WEIGHTS_FILE).is_file()


def selected(name: str, tensors: str) -> bool:
    """Whether a tensor belongs to the --tensors set (all / linear layers / MLP only)."""
    if tensors == "all":
        return True
    parts = _MLP if tensors == "mlp" else _LINEAR
    return name.endswith(".weight") and any(f".{p}." in f".{name}" for p in parts)


def save(tensors: dict[str, CompressedTensor], folder: Path) -> Path:
    """Write the weights file of a compressed model into folder."""
    arrays: dict[str, np.ndarray] = {}
    index = {}
    for name, c in tensors.items():
        entry = {"form": c.form, "dtype": c.dtype, "shape": list(c.shape), "sha256": c.sha256,
                 "crc32": c.crc32, "meta": c.meta, "arrays": {}}  # fmt: skip
        for key, array in c.arrays.items():
            array = np.ascontiguousarray(array)
            entry["arrays"][key] = {"dtype": array.dtype.str, "shape": list(array.shape)}
            arrays[f"{name}::{key}"] = array.reshape(-1).view(np.uint8)
        index[name] = entry
    header = {"format": FORMAT, "version": VERSION, "tensors": index}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHTS_FILE
    save_file(arrays, str(path), metadata={FORMAT: json.dumps(header)})
    return path


def load(folder: Path) -> dict[str, CompressedTensor]:
    """The compressed tensors of a folder (nothing decoded yet); UnweightError if damaged."""
    path = folder / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="numpy") as f:
            index = _read_index(f, path)
            return {name: _compressed(f, name, entry) for name, entry in index.items()}
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UnweightError(f"{path}: cannot read: {type(e).__name__}: {e}") from None


def _read_index(f: Any, path: Path) -> dict[str, dict]:
    """The header's per-tensor entries, checked: format, version, every array present."""
    header = json.loads((f.metadata() or {}).get(FORMAT, "null"))
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UnweightError(f"{path}: not an Unweight weights file (no '{FORMAT}' header)")
    if header.get("version") != VERSION:
        raise UnweightError(f"{path}: format version {header.get('version')} is not "
                            f"supported (this infire reads {VERSION})")  # fmt: skip
    stored = set(f.keys())
    for name, entry in header["tensors"].items():
        for key in entry["arrays"]:
            if f"{name}::{key}" not in stored:
                raise UnweightError(f"{path}: tensor {name}: array {key!r} is missing")
    return header["tensors"]


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """[begin, end) file offsets of every stored array, from the safetensors header."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    return {key: (start + spec["data_offsets"][0], start + spec["data_offsets"][1])
            for key, spec in header.items() if key != "__metadata__"}  # fmt: skip


def _compressed(f: Any, name: str, entry: dict) -> CompressedTensor:
    """Tensor `name` in compressed form, its arrays read from the open file `f`."""
    arrays = {}
    for key, spec in entry["arrays"].items():
        raw = f.get_tensor(f"{name}::{key}")
        arrays[key] = raw.view(np.dtype(spec["dtype"])).reshape(spec["shape"])
    return CompressedTensor(entry["form"], entry["dtype"], tuple(entry["shape"]),
                            entry["sha256"], int(entry["crc32"]), arrays,
                            entry["meta"])  # fmt: skip


class UnweightSource(WeightSource):
    """An Unweight folder's tensors, each read and decoded when the model asks for it.

    A tensor's arrays are read with pread at the offsets in the file's header (parsed
    once), not through a memory map, so only that tensor's compressed arrays and its
    decoded copy are in memory at once (a rank keeps its slice of the decoded tensor).
    """

    def __init__(self, folder: Path, dtype: torch.dtype | None,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__(dtype)
        self._path = folder / WEIGHTS_FILE
        # where bf16 `rans` tensors are decoded by the Triton kernel (kernels/triton_rans.py):
        # the device the weights go to, where the kernels serve it; else the CPU decoder
        self.decode_device = device if device is not None and use_triton(device) else None
        try:
            with safe_open(str(self._path), framework="numpy") as f:
                self._index = _read_index(f, self._path)
            self._offsets = _data_offsets(self._path)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            raise UnweightError(f"{self._path}: cannot read: {type(e).__name__}: {e}") from None

    def names(self) -> list[str]:
        """Tensor names, in header order."""
        return list(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        """The original tensor's shape (from the header)."""
        return tuple(self._index[name]["shape"])

    def compressed(self, name: str) -> CompressedTensor:
        """Tensor `name` as stored, not decoded."""
        entry = self._index[name]
        arrays = {}
        try:
            with self._path.open("rb") as f:
                for key, spec in entry["arrays"].items():
                    begin, end = self._offsets[f"{name}::{key}"]
                    raw = np.empty(end - begin, dtype=np.uint8)
                    if os.preadv(f.fileno(), [raw], begin) != raw.size:
                        raise ValueError(f"{name}::{key} is cut short")
                    arrays[key] = raw.view(np.dtype(spec["dtype"])).reshape(spec["shape"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UnweightError(f"{self._path}: cannot read: {type(e).__name__}: {e}") from None
        return CompressedTensor(entry["form"], entry["dtype"], tuple(entry["shape"]),
                                entry["sha256"], int(entry["crc32"]), arrays,
                                entry["meta"])  # fmt: skip

    def decode(self, name: str, check: str = "crc32") -> torch.Tensor:
        """The whole original tensor, checked (UnweightError naming it if damaged). A bf16
        `rans` tensor going to a `decode_device` is decoded there, checked by its rANS
        states' ends (the CRC-32 is the CPU decoder's)."""
        c = self.compressed(name)
        if self.decode_device is None or c.form != "rans" or c.dtype != "BF16":
            return decompress_tensor(c, name, check)
        from infire.kernels.triton_rans import decode_bf16

        try:
            flat = decode_bf16(rans_encoded(c, name), c.arrays["rest"], self.decode_device, name)
        except (rans.CorruptStreamError, KeyError, ValueError) as e:
            raise UnweightError(str(e)) from None
        return flat.view(c.shape)

    def check(self, progress: bool = False) -> None:
        """Decode every tensor once and drop it: damage is refused before anything is served."""
        names = self.names()
        with ThreadPoolExecutor(max_workers=2) as pool:
            done = pool.map(lambda n: self.decode(n).numel(), names)
            for _ in tqdm(done, total=len(names), desc="checking", disable=not progress,
                          unit="tensor"):  # fmt: skip
                pass

    def _rows_per_piece(self, name: str) -> int:
        return self.shape(name)[0] if self.shape(name) else 1  # a tensor decodes as a whole

    def _read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        tensor = self.decode(name)
        if tensor.dim() == 0 or (start == 0 and length == tensor.shape[dim]):
            return tensor
        return tensor.narrow(dim, start, length).contiguous()


def open_weights(folder: Path, dtype: torch.dtype | None, check: bool = True,
                 device: torch.device | str | None = None) -> UnweightSource:  # fmt: skip
    """The folder's weights as a lazy source; with `check`, every tensor is decoded once
    first (and dropped), so a damaged file is refused when it is opened (not where the
    weights are decoded on their device: each decode there refuses damage as it loads)."""
    source = UnweightSource(folder, dtype, device)
    if check and source.decode_device is None:
        source.check()
    return source


def decompress_all(
    tensors: dict[str, CompressedTensor], progress: bool = True, desc: str = "decompressing"
) -> dict[str, torch.Tensor]:
    """Every tensor decoded and checked against its CRC32 (in parallel threads; the C
    decoder and zlib release the GIL)."""
    names = list(tensors)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda n: decompress_tensor(tensors[n], n), names)
        decoded = dict(zip(names, tqdm(results, total=len(names), desc=desc,
                                       disable=not progress, unit="tensor"), strict=True))  # fmt: skip
    return decoded


def compress_model(
    src: Path,
    dst: Path,
    form: str = "rans",
    tensors: str = "all",
    progress: bool = True,
    report: Callable[[str], None] | None = None,
) -> dict[str, CompressedTensor]:
    """Compress an HF folder, a GGUF (dequantized to BF16) or a Whisper folder (Hugging
    Face or CTranslate2: its tensors in Hugging Face's names and the file's dtype, with a
    Hugging Face config.json) into the folder dst."""
    if tensors not in TENSOR_SETS:
        raise UnweightError(f"--tensors {tensors!r}: expected one of {', '.join(TENSOR_SETS)}")
    if dst.exists() and any(dst.iterdir()):
        raise UnweightError(f"{dst}: the destination exists and is not empty")
    from infire.models.whisper import is_whisper_folder

    if is_whisper_folder(src):
        return _compress_whisper(src, dst, form, tensors, progress, report)
    config, weights, tokenizer = _open_original(src)
    if not src.is_dir():
        hf_config(config, "bfloat16")  # refuses a family it cannot write, before dst exists
    dst.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        for name in _KEEP:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
    else:
        write_hf_files(config, tokenizer, dst, "bfloat16")
    compressed = {}
    original = 0
    # one original tensor in memory at a time; the compressed ones are kept for `save`
    for name, weight in tqdm(weights.items(), total=len(weights), desc=f"compressing ({form})",
                             disable=not progress, unit="tensor"):  # fmt: skip
        compressed[name] = compress_tensor(weight, form if selected(name, tensors) else "raw")
        original += weight.numel() * weight.element_size()
    save(compressed, dst)
    if report:
        report(_summary(compressed, original))
    return compressed


def _summary(compressed: dict[str, CompressedTensor], original: int) -> str:
    size = sum(c.nbytes for c in compressed.values())
    return (f"{len(compressed)} tensors: {original / 1e6:.1f} MB -> {size / 1e6:.1f} MB "
            f"({size / original:.4f} of the original)")  # fmt: skip


def _compress_whisper(src: Path, dst: Path, form: str, tensors: str, progress: bool,
                      report: Callable[[str], None] | None) -> dict[str, CompressedTensor]:  # fmt: skip
    """compress_model for a Whisper folder (load_whisper reads the result)."""
    from infire.models.whisper import hf_whisper_files, read_whisper

    _refuse_compressed(src)
    checkpoint = read_whisper(src)
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*_KEEP, "preprocessor_config.json", "vocabulary.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    for name, content in hf_whisper_files(checkpoint).items():  # over a CTranslate2 config
        (dst / name).write_text(json.dumps(content, indent=2))
    compressed = {}
    for name, weight in tqdm(checkpoint.weights.items(), desc=f"compressing ({form})",
                             disable=not progress, unit="tensor"):  # fmt: skip
        compressed[name] = compress_tensor(weight, form if selected(name, tensors) else "raw")
    save(compressed, dst)
    if report:
        report(
            _summary(
                compressed, sum(w.numel() * w.element_size() for w in checkpoint.weights.values())
            )
        )
    return compressed


def verify(dst: Path, against: Path | None = None, progress: bool = True) -> list[str]:
    """Problems found (empty: every tensor decodes to its recorded SHA-256, and, with
    `against`, the recorded SHA-256s are those of the original's tensors)."""
    problems = []
    tensors = load(dst)
    for name, c in tqdm(tensors.items(), desc="verifying", disable=not progress, unit="tensor"):
        try:
            decompress_tensor(c, name, check="sha256")
        except UnweightError as e:
            problems.append(str(e))
    if against is not None:
        from infire.models.whisper import is_whisper_folder, read_whisper

        if is_whisper_folder(against):
            weights: Any = read_whisper(against).weights
        else:
            _, weights, _ = _open_original(against)
        for name in sorted(set(weights) - set(tensors)):
            problems.append(f"{name}: in {against} but missing from {dst}")
        for name in sorted(set(tensors) - set(weights)):
            problems.append(f"{name}: in {dst} but not in {against}")
        for name in sorted(set(weights) & set(tensors)):
            data = weights[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if hashlib.sha256(data).hexdigest() != tensors[name].sha256:
                problems.append(f"{name}: differs from {against}")
    return problems


def _open_original(path: Path) -> tuple[ModelConfig, WeightSource, Tokenizer]:
    """An original (not compressed) model as stored, lazily: a GGUF dequantized to BF16."""
    _refuse_compressed(path)
    return open_checkpoint(path, None)


def _refuse_compressed(path: Path) -> None:
    if is_unweight_folder(path):
        raise UnweightError(f"{path}: already an Unweight folder (give the original model)")


def inspect_rows(tensors: dict[str, CompressedTensor]) -> Iterator[dict]:
    """Per tensor: form, weights, bits/weight, ratio, entropy bound, palette stats."""
    for name, c in tensors.items():
        count = int(np.prod(c.shape, dtype=np.int64))
        itemsize = torch.empty(0, dtype=getattr(torch, c.dtype)).element_size()
        bits = c.nbytes * 8 / max(1, count)
        entropy = c.meta.get("exponent_entropy")
        raw_bits = {"bfloat16": 8, "float16": 11, "float32": 24}.get(c.dtype)
        yield {
            "name": name, "form": c.form, "dtype": c.dtype, "shape": c.shape, "weights": count,
            "bytes": c.nbytes, "original_bytes": count * itemsize, "bits_per_weight": bits,
            "ratio": c.nbytes / max(1, count * itemsize),
            "bound_bits_per_weight": raw_bits + entropy if entropy is not None else None,
            "palette_coverage": c.meta.get("palette_coverage"),
            "verbatim_row_share": c.meta.get("verbatim_row_share"),
        }  # fmt: skip


def forms(folder: Path) -> set[str]:
    """The forms of a compressed folder's tensors (from the header; nothing is read)."""
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="numpy") as f:
            header = json.loads((f.metadata() or {}).get(FORMAT, "null"))
        return {entry["form"] for entry in header["tensors"].values()}
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UnweightError(
            f"{folder / WEIGHTS_FILE}: cannot read: {type(e).__name__}: {e}"
        ) from None
