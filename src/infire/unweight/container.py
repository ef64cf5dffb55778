"""The compressed model folder: the original's config and tokenizer files, plus weights in
`unweight.safetensors`, a safetensors file of uint8 tensors any safetensors reader opens.

Each compressed tensor NAME contributes tensors `NAME::ARRAY` (its arrays, as raw bytes);
the header's `__metadata__["unweight"]` is a JSON object with the format version and, per
tensor, its form, original dtype and shape, SHA-256 and CRC32, form metadata (symbol
frequencies, palette stats, ...) and each array's numpy dtype and shape. docs/unweight-format.md has
every byte.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from infire.unweight import CompressedTensor, UnweightError, compress_tensor, decompress_tensor

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
            header = json.loads((f.metadata() or {}).get(FORMAT, "null"))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise UnweightError(f"{path}: not an Unweight weights file (no '{FORMAT}' header)")
            if header.get("version") != VERSION:
                raise UnweightError(f"{path}: format version {header.get('version')} is not "
                                    f"supported (this infire reads {VERSION})")  # fmt: skip
            stored = set(f.keys())
            tensors = {}
            for name, entry in header["tensors"].items():
                arrays = {}
                for key, spec in entry["arrays"].items():
                    if f"{name}::{key}" not in stored:
                        raise UnweightError(f"{path}: tensor {name}: array {key!r} is missing")
                    raw = f.get_tensor(f"{name}::{key}")
                    arrays[key] = raw.view(np.dtype(spec["dtype"])).reshape(spec["shape"])
                tensors[name] = CompressedTensor(entry["form"], entry["dtype"],
                                                 tuple(entry["shape"]), entry["sha256"],
                                                 int(entry["crc32"]), arrays,
                                                 entry["meta"])  # fmt: skip
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UnweightError(f"{path}: cannot read: {type(e).__name__}: {e}") from None
    return tensors


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
    """Compress an HF folder or a GGUF (dequantized to BF16) into the folder dst."""
    from infire.models.hf_export import write_hf_files
    from infire.models.loader import load_original

    if tensors not in TENSOR_SETS:
        raise UnweightError(f"--tensors {tensors!r}: expected one of {', '.join(TENSOR_SETS)}")
    if dst.exists() and any(dst.iterdir()):
        raise UnweightError(f"{dst}: the destination exists and is not empty")
    config, weights, tokenizer = load_original(src)
    dst.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        for name in _KEEP:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
    else:
        write_hf_files(config, tokenizer, dst, "bfloat16")
    compressed = {}
    for name, weight in tqdm(weights.items(), desc=f"compressing ({form})", disable=not progress,
                             unit="tensor"):  # fmt: skip
        compressed[name] = compress_tensor(weight, form if selected(name, tensors) else "raw")
    save(compressed, dst)
    if report:
        original = sum(w.numel() * w.element_size() for w in weights.values())
        size = sum(c.nbytes for c in compressed.values())
        report(f"{len(compressed)} tensors: {original / 1e6:.1f} MB -> {size / 1e6:.1f} MB "
               f"({size / original:.4f} of the original)")  # fmt: skip
    return compressed


def verify(dst: Path, against: Path | None = None, progress: bool = True) -> list[str]:
    """Problems found (empty: every tensor decodes to its recorded SHA-256, and, with
    `against`, the recorded SHA-256s are those of the original's tensors)."""
    import hashlib

    from infire.models.loader import load_original

    problems = []
    tensors = load(dst)
    for name, c in tqdm(tensors.items(), desc="verifying", disable=not progress, unit="tensor"):
        try:
            decompress_tensor(c, name, check="sha256")
        except UnweightError as e:
            problems.append(str(e))
    if against is not None:
        _, weights, _ = load_original(against)
        for name in sorted(set(weights) - set(tensors)):
            problems.append(f"{name}: in {against} but missing from {dst}")
        for name in sorted(set(tensors) - set(weights)):
            problems.append(f"{name}: in {dst} but not in {against}")
        for name in sorted(set(weights) & set(tensors)):
            data = weights[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if hashlib.sha256(data).hexdigest() != tensors[name].sha256:
                problems.append(f"{name}: differs from {against}")
    return problems


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
