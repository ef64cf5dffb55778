"""Lazy weight sources: names and shapes without reading, slices equal to the whole
tensor's, and a model loaded from one never holding a second copy of its weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infire.models import weights as weights_module
from infire.models.loader import load_model
from infire.models.weights import DictSource, SafetensorsSource, WeightSource
from infire.unweight.container import compress_model


def _check_slices(source: WeightSource, full: dict[str, torch.Tensor]) -> None:
    assert set(source) == set(full) and len(source) == len(full)
    for name, tensor in full.items():
        assert source.shape(name) == tuple(tensor.shape)
        rows = tensor.shape[0]
        want = tensor[rows // 4 : rows // 4 + rows // 2]
        assert torch.equal(source.read(name, 0, rows // 4, rows // 2), want)
        out = torch.empty_like(want)
        source.read_into(out, name, 0, rows // 4, rows // 2)
        assert torch.equal(out, want)
        if tensor.dim() == 2:
            assert torch.equal(source.read(name, 1, 3, 5), tensor[:, 3:8])
            out = torch.empty(rows, 5)
            source.read_into(out, name, 1, 3, 5)
            assert torch.equal(out, tensor[:, 3:8])
        assert torch.equal(source[name], tensor)


@pytest.fixture(params=[None, 100], ids=["whole", "pieces"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_into in one piece, or in pieces of 100 values (a few rows)."""
    if request.param:
        monkeypatch.setattr(weights_module, "PIECE_VALUES", request.param)


def test_safetensors_source_reads_slices(tiny_llama: Path, pieces: None):
    loaded = load_model(tiny_llama, torch.float32)
    assert isinstance(loaded.weights, SafetensorsSource)
    _check_slices(loaded.weights, load_file(tiny_llama / "model.safetensors"))


def test_unweight_source_decodes_one_tensor_at_a_time(
    tiny_llama: Path, tmp_path: Path, pieces: None
):
    compress_model(tiny_llama, tmp_path / "rans", "rans", progress=False)
    weights = load_model(tmp_path / "rans", torch.float32).weights
    _check_slices(weights, load_file(tiny_llama / "model.safetensors"))


def test_names_and_membership_read_nothing(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    weights = load_model(tiny_llama, torch.float32).weights
    monkeypatch.setattr(weights, "_read", lambda *a: pytest.fail("read a tensor"))
    assert "model.norm.weight" in weights and "nope" not in weights
    assert len(list(weights)) == len(weights.names())
    assert weights.shape("model.norm.weight") == (64,)


def test_out_of_range_slices_are_refused():
    source = DictSource({"w": torch.zeros(4, 6)}, torch.bfloat16)
    assert source.read("w", 1, 2, 4).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="outside dimension 1"):
        source.read("w", 1, 4, 4)
    with pytest.raises(KeyError):
        source.get_slice("v")


# Runs in a fresh process so that its peak resident memory is the loading's alone.
_MEASURE = """
import gc, json, sys, torch
from infire.config import CacheConfig
from infire.engine.runner import ModelRunner
from infire.models.loader import load_model

def rss(field="VmRSS"):  # VmHWM: the peak; ru_maxrss would count the parent's before exec
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field)) * 1024

torch.set_num_threads(1)
loaded = load_model(sys.argv[1], torch.float32)
gc.collect()
base = rss()
runner = ModelRunner(loaded.config, loaded.weights, CacheConfig(num_blocks=4),
                     torch.float32, cpu_kernels=False)
del loaded
gc.collect()
print(json.dumps({"base": base, "final": rss(), "peak": rss("VmHWM")}))
"""


def test_loading_peaks_at_the_model_plus_one_tensor(tmp_path: Path, tiny_llama: Path):
    """~70 MB of float32 weights in tensors of at most 4 MB: loading may add the largest
    tensor or so to the model's final size, never a second copy of the weights (the
    dict-of-everything loader peaked at twice the weights)."""
    from tiny_models import write_tiny_model

    folder = write_tiny_model(
        tmp_path / "wide", "llama", hidden_size=512, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=2048,
    )  # fmt: skip
    weights = load_file(folder / "model.safetensors")
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    largest = max(w.numel() * w.element_size() for w in weights.values())
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    held = m["final"] - m["base"]
    assert held > 0.9 * nbytes  # the model is in memory once
    assert m["peak"] - m["base"] < held + 2 * largest + 8 * 1024**2, (m, nbytes)
