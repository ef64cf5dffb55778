"""GGUF files of the Llama-shaped families beyond Llama (Qwen3, Qwen3-MoE, Mixtral), written
as llama.cpp's converter writes them, load into the same model as their HF folders.

Each tiny model is written to GGUF with llama.cpp's names and transforms (q/k rows
permuted for Mixtral, which llama.cpp stores as "llama" with experts; experts stacked
into one [experts, out, in] tensor per projection; one expert tensor in Q8_0 for
Mixtral), then both the folder and the file generate 32 greedy tokens for three prompts
through the real scheduler: the tokens must be equal and the logits within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from family_harness import engine_run, prompts_for
from gguf_writer import common_metadata, hf_config, hf_tensors, llama_like_tensors, write_gguf
from infire.models.loader import load_model
from tiny_models import write_tiny_model

NEW_TOKENS = 32


def _qwen3(config: dict) -> tuple[str, dict, bool]:
    return "qwen3", {}, False


def _qwen3moe(config: dict) -> tuple[str, dict, bool]:
    return (
        "qwen3moe",
        {
            "qwen3moe.expert_count": config["num_local_experts"],
            "qwen3moe.expert_used_count": config["num_experts_per_tok"],
            "qwen3moe.expert_feed_forward_length": config["moe_intermediate_size"],
        },
        False,
    )


def _mixtral(config: dict) -> tuple[str, dict, bool]:
    return (
        "llama",
        {
            "llama.expert_count": config["num_local_experts"],
            "llama.expert_used_count": config["num_experts_per_tok"],
        },
        True,
    )


CASES = {
    "qwen3": (_qwen3, {}),
    # llama.cpp's qwen3moe has no dense layers: every layer sparse
    "qwen3_moe": (_qwen3moe, {"mlp_only_layers": []}),
    "mixtral": (_mixtral, {}),
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_gguf_generates_as_the_hf_folder(tmp_path: Path, model_type: str):
    convert, overrides = CASES[model_type]
    folder = write_tiny_model(tmp_path / model_type, model_type, seed=11, **overrides)
    config = hf_config(folder)
    arch, extra, permute = convert(config)
    tensors = llama_like_tensors(hf_tensors(folder), config, permute)
    quantize = ("blk.0.ffn_down_exps.weight",) if model_type == "mixtral" else ()
    path = write_gguf(
        folder, tmp_path / f"{model_type}.gguf", arch,
        common_metadata(config, arch) | extra, tensors, quantize,
    )  # fmt: skip

    loaded = load_model(path, torch.float32)
    assert loaded.config.architecture == load_model(folder, torch.float32).config.architecture
    prompts = prompts_for(loaded.config.vocab_size)
    if quantize:  # the folder's reference gets the same Q8_0 rounding of that tensor
        folder = _with_gguf_weights(folder, path, tmp_path / "dequantized")
    want = engine_run(folder, prompts, NEW_TOKENS)
    got = engine_run(path, prompts, NEW_TOKENS)
    assert got.tokens == want.tokens
    for ours, theirs in zip(got.logits, want.logits, strict=True):
        assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-4


def _with_gguf_weights(folder: Path, gguf_path: Path, out: Path) -> Path:
    """A copy of the HF folder whose layer-0 expert down projections are the GGUF's Q8_0
    values, dequantized (every other tensor stays the folder's own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights = load_model(gguf_path, torch.float32).weights
    (file,) = out.glob("*.safetensors")
    tensors = load_file(file)
    for name in list(tensors):
        if name.startswith("model.layers.0.block_sparse_moe.experts.") and ".w2." in name:
            expert = name.split(".")[5]
            tensors[name] = weights[f"model.layers.0.mlp.experts.{expert}.down_proj.weight"]
    save_file(tensors, str(file))
    return out
