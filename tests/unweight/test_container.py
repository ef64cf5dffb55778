"""Compressed model folders: `infire compress / verify / inspect`, loading and serving them,
and damage to the weights file always named, never served."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from infire import LLM, SamplingParams
from infire.errors import ModelLoadError
from infire.models.loader import load_model
from infire.unweight.container import WEIGHTS_FILE, compress_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "2 + 2 ="]  # fmt: skip


def infire(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infire.cli", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def served(model: str, prompts: list[str], tokens: int = 32) -> tuple[list[list[int]], LLM]:
    """Greedy tokens from `model` served in bfloat16 (a GGUF dequantized: what Unweight
    compresses), and the LLM that made them."""
    llm = LLM(model, dtype="bfloat16", num_blocks=128, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path: Path) -> tuple[list[list[int]], int]:
    """The GGUF's greedy tokens in bfloat16, and the weight bytes its fused forward holds."""
    tokens, llm = served(str(smollm2_path), PROMPTS)
    return tokens, llm.engine.runner.fused.weight_bytes


def test_compressed_smollm2_generates_the_same_tokens(
    smollm2_path: Path, smollm2_bf16: tuple[list[list[int]], int], tmp_path: Path
):
    smollm2_bf16_tokens, bf16_bytes = smollm2_bf16
    rans_dir = tmp_path / "smol-rans"
    done = infire("compress", str(smollm2_path), str(rans_dir))
    assert done.returncode == 0, done.stderr
    assert "0.66" in done.stderr  # the ratio line: 179 of 269 MB (0.6635)
    palette_dir = tmp_path / "smol-palette"
    compress_model(smollm2_path, palette_dir, "palette", progress=False)
    for folder in (rans_dir, palette_dir):
        assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
        tokens, llm = served(str(folder), PROMPTS)
        assert tokens == smollm2_bf16_tokens
        runner = llm.engine.runner
        if folder == palette_dir:  # held compressed: 205 of the bf16 forward's 326 MB
            assert runner.fused_status == "active, palette weights"
            assert runner.fused.weight_bytes < 0.65 * bf16_bytes
        else:
            assert runner.fused_status == "active"
            assert runner.fused.weight_bytes == bf16_bytes
        del llm, runner
    done = infire("verify", str(palette_dir), "--against", str(smollm2_path))
    assert done.returncode == 0, done.stderr
    assert "every tensor decodes" in done.stdout
    done = infire("inspect", str(palette_dir))
    assert done.returncode == 0, done.stderr
    assert "model.layers.0.mlp.down_proj.weight" in done.stdout and "palette" in done.stdout
    total = done.stdout.strip().splitlines()[-1]
    assert total.startswith("total: 272 tensors") and "ratio 0.75" in total


@pytest.fixture()
def tiny_compressed(tiny_llama: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-unweight"
    compress_model(tiny_llama, folder, "rans", progress=False)
    return folder


def test_any_safetensors_reader_opens_it(tiny_compressed: Path, tiny_llama: Path):
    with safe_open(str(tiny_compressed / WEIGHTS_FILE), framework="numpy") as f:
        keys = list(f.keys())
        header = json.loads(f.metadata()["unweight"])
        assert all(f.get_tensor(k).dtype.name == "uint8" for k in keys)
    assert header["format"] == "unweight" and header["version"] == 2
    original = load_model(tiny_llama, torch.float32).weights
    assert set(header["tensors"]) == set(original)
    entry = header["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert entry["form"] == "rans" and entry["dtype"] == "float32"
    assert isinstance(entry["crc32"], int) and len(entry["sha256"]) == 64
    assert "model.layers.0.mlp.down_proj.weight::stream" in keys


def test_tiny_folder_loads_to_the_same_weights_and_tokens(tiny_compressed: Path, tiny_llama: Path):
    a = load_model(tiny_compressed, torch.float32).weights
    b = load_model(tiny_llama, torch.float32).weights
    assert all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in b)
    params = SamplingParams(temperature=0, max_tokens=8)
    got = LLM(str(tiny_compressed), dtype="float32", num_blocks=16).generate("the cat", params)
    want = LLM(str(tiny_llama), dtype="float32", num_blocks=16).generate("the cat", params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_mlp_only(tiny_llama: Path, tmp_path: Path):
    folder = tmp_path / "mlp"
    compressed = compress_model(tiny_llama, folder, "rans", tensors="mlp", progress=False)
    forms = {name: c.form for name, c in compressed.items()}
    assert forms["model.layers.1.mlp.up_proj.weight"] == "rans"
    assert forms["model.layers.1.self_attn.q_proj.weight"] == "raw"
    assert forms["model.embed_tokens.weight"] == "raw"
    assert infire("verify", str(folder), "--against", str(tiny_llama)).returncode == 0


def _tensor_bytes(path: Path, key: str) -> tuple[int, int]:
    """File offsets [begin, end) of one stored tensor's bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


NAME = "model.layers.1.mlp.gate_proj.weight"


@pytest.mark.parametrize("array", ["stream", "rest", "offsets"])
def test_flipped_byte_is_named(tiny_compressed: Path, tiny_llama: Path, array: str):
    path = tiny_compressed / WEIGHTS_FILE
    begin, end = _tensor_bytes(path, f"{NAME}::{array}")
    _flip(path, (begin + end) // 2)
    done = infire("verify", str(tiny_compressed))
    assert done.returncode == 1 and NAME in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ModelLoadError, match=NAME):
        load_model(tiny_compressed, torch.float32)
    done = infire("generate", "hi", "--model", str(tiny_compressed))
    assert done.returncode == 2 and NAME in done.stderr and "Traceback" not in done.stderr


def _rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    meta = json.loads(header["__metadata__"]["unweight"])
    change(header, meta)
    header["__metadata__"]["unweight"] = json.dumps(meta)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def test_wrong_metadata_is_named(tiny_compressed: Path):
    def change(header: dict, meta: dict) -> None:
        frequencies = meta["tensors"][NAME]["meta"]["frequencies"]
        first = next(iter(frequencies))
        frequencies[first] += 1

    _rewrite_header(tiny_compressed / WEIGHTS_FILE, change)
    with pytest.raises(ModelLoadError, match=NAME):
        load_model(tiny_compressed, torch.float32)


def test_wrong_crc_is_named(tiny_compressed: Path):
    def change(header: dict, meta: dict) -> None:
        meta["tensors"][NAME]["crc32"] ^= 1

    _rewrite_header(tiny_compressed / WEIGHTS_FILE, change)
    with pytest.raises(ModelLoadError, match=f"{NAME}: .* CRC32"):
        load_model(tiny_compressed, torch.float32)
    done = infire("verify", str(tiny_compressed))  # verifying checks SHA-256s instead
    assert done.returncode == 0, done.stderr


def test_version_1_files_are_refused(tiny_compressed: Path):
    def change(header: dict, meta: dict) -> None:
        meta["version"] = 1

    _rewrite_header(tiny_compressed / WEIGHTS_FILE, change)
    with pytest.raises(ModelLoadError, match="format version 1 is not supported"):
        load_model(tiny_compressed, torch.float32)
    done = infire("verify", str(tiny_compressed))
    assert done.returncode != 0 and "format version 1 is not supported" in done.stderr


def test_missing_tensor_is_named(tiny_compressed: Path, tiny_llama: Path):
    def drop_array(header: dict, meta: dict) -> None:
        del header[f"{NAME}::rest"]  # the data stays; the header no longer lists it

    _rewrite_header(tiny_compressed / WEIGHTS_FILE, drop_array)
    with pytest.raises(ModelLoadError, match=NAME):
        load_model(tiny_compressed, torch.float32)

    def drop_entry(header: dict, meta: dict) -> None:
        del meta["tensors"]["model.norm.weight"]

    folder = tiny_compressed.parent / "again"
    compress_model(tiny_llama, folder, "rans", progress=False)
    _rewrite_header(folder / WEIGHTS_FILE, drop_entry)
    done = infire("verify", str(folder), "--against", str(tiny_llama))
    assert done.returncode == 1 and "model.norm.weight: in" in done.stderr


def test_destination_must_be_new(tiny_llama: Path, tmp_path: Path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    done = infire("compress", str(tiny_llama), str(tmp_path / "full"))
    assert done.returncode == 2 and "not empty" in done.stderr


def test_a_gguf_of_a_family_it_cannot_write_as_a_folder_is_refused_first(tmp_path: Path):
    from gguf_writer import common_metadata, hf_config, hf_tensors, llama_like_tensors, write_gguf
    from infire.errors import UnsupportedModelError
    from tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "qwen3", "qwen3")
    config = hf_config(folder)
    tensors = llama_like_tensors(hf_tensors(folder), config, permute=False)
    path = write_gguf(folder, tmp_path / "qwen3.gguf", "qwen3",
                      common_metadata(config, "qwen3"), tensors)  # fmt: skip
    dst = tmp_path / "compressed"
    with pytest.raises(UnsupportedModelError, match="qwen3 model as a Hugging Face folder"):
        compress_model(path, dst, "rans", progress=False)
    assert not dst.exists()  # refused before anything is written
