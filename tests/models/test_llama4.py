"""Llama 4 (text) beyond the family parity test (tests/models/test_families.py).

Variants of the tiny model (temperature tuning that really scales within the prompts,
Llama 3 RoPE scaling without the QK norm, Scout's degenerate Llama 3 scaling, every layer
global with top-1 experts) match transformers logit for logit (1e-4, float32) and token
for token through the real scheduler; a long generation keeps the chunked layers' pool
bounded by one chunk while matching transformers; GGUF files written as llama.cpp's
converter writes them generate as their folders; the text model of a multimodal
(Llama4ForConditionalGeneration) checkpoint loads; uneven tensor-parallel splits are
refused. The reference decodes greedily through EOS, as `engine_run` does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from family_harness import assert_matches_transformers, engine_run, prompts_for
from gguf_writer import common_metadata, hf_config, hf_tensors, llama_like_tensors, write_gguf
from infire.errors import ModelLoadError
from infire.layers.kv_spec import AttentionWindow
from infire.models.llama4 import Llama4ForCausalLM
from infire.models.loader import load_model
from tiny_models import write_tiny_model

NEW_TOKENS = 32
TOLERANCE = 1e-4


def _llama3(low: float, high: float, original: int) -> dict[str, object]:
    return {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }  # fmt: skip


VARIANTS: dict[str, dict[str, object]] = {
    # floor_scale 4: the NoPE layer's query scale steps up every 4 positions
    "temperature_tuning": {"floor_scale": 4, "attn_scale": 0.5},
    "llama3_rope_without_qk_norm": {
        "use_qk_norm": False, "rope_parameters": _llama3(1.0, 4.0, 32),
    },
    # Scout's scaling: low_freq_factor == high_freq_factor, no smoothed band
    "scout_rope": {"rope_parameters": _llama3(1.0, 1.0, 64)},
    "global_top1_every_layer_moe": {
        "attention_chunk_size": None, "interleave_moe_layer_step": 1, "num_experts_per_tok": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_transformers(tmp_path: Path, variant: str):
    folder = write_tiny_model(tmp_path / variant, "llama4_text", seed=5, **VARIANTS[variant])
    vocab = load_model(folder, torch.float32).config.vocab_size
    run = assert_matches_transformers(folder, prompts_for(vocab), NEW_TOKENS)
    if variant == "temperature_tuning":  # the scales really vary over these positions
        scales = run.runner.model.position_inputs(torch.arange(69), torch.float32).attn_scales
        assert scales is not None and scales.min() == 1.0 and scales.max() > 2.0


def test_kv_groups_put_chunked_layers_in_a_window_and_nope_layers_in_group_0(tmp_path: Path):
    config = load_model(write_tiny_model(tmp_path, "llama4_text"), torch.float32).config
    spec = Llama4ForCausalLM.kv_cache_spec(config)
    assert [g.layers for g in spec.groups] == [(3,), (0, 1, 2)]
    assert spec.windows == (AttentionWindow("chunked", 8),)
    # a chunk as long as the context never cuts: every layer is full attention
    long_chunk = dataclasses.replace(config, attention_chunk_size=256)
    assert [g.layers for g in Llama4ForCausalLM.kv_cache_spec(long_chunk).groups] == [(0, 1, 2, 3)]


def test_a_long_generation_keeps_the_chunked_pool_bounded(tmp_path: Path):
    folder = write_tiny_model(tmp_path, "llama4_text", seed=7)
    vocab = load_model(folder, torch.float32).config.vocab_size
    prompts = prompts_for(vocab, (37,))
    new_tokens = 150  # 187 tokens: 23 chunks of 8, 47 blocks of 4 in the full pool
    run = assert_matches_transformers(folder, prompts, new_tokens)
    (window,) = run.runner.windows
    bound = window.max_blocks(16, run.runner.block_size)  # engine_run's budget
    assert 0 < run.window_blocks_peak[0] <= bound < 47


# --- GGUF --------------------------------------------------------------------------------

# llama.cpp assumes chunks of 8192 and temperature tuning from 8192 tokens (it stores
# neither), so a tiny model round-trips when it uses those; sliding_window 0 marks one
# without chunks or NoPE layers.
_LLAMA_CPP_TUNING = {"floor_scale": 8192, "attn_scale": 0.1}
_CHUNKED = {"attention_chunk_size": 8192, **_LLAMA_CPP_TUNING}
GGUF_CASES: dict[str, dict[str, object]] = {
    "chunked": _CHUNKED,
    "global": {"attention_chunk_size": None, "no_rope_layers": [1, 1, 1, 1], **_LLAMA_CPP_TUNING},
    # llama.cpp's converter reads the original context from the top level: 8192 here
    "llama3_rope": {**_CHUNKED, "rope_parameters": _llama3(1.0, 4.0, 8192)},
    "scout_rope": {**_CHUNKED, "rope_parameters": _llama3(1.0, 1.0, 8192)},
}
# models/gguf.py fits Llama 3 parameters to rope_freqs assuming a smoothed band, which
# Scout's (low_freq_factor == high_freq_factor) has not


def _llama4_gguf_tensors(folder: Path, config: dict) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of a Llama 4 folder: q/k not permuted, stacked experts split
    into gate and up and transposed to [experts, out, in], the shared expert as *_shexp."""
    plain, out = {}, {}
    for name, tensor in hf_tensors(folder).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".feed_forward.experts.gate_up_proj"):
            gate, up = np.split(tensor.swapaxes(1, 2), 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            out[f"blk.{layer}.ffn_up_exps.weight"] = up
        elif name.endswith(".feed_forward.experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = tensor.swapaxes(1, 2)
        elif ".feed_forward.shared_expert." in name:
            part = name.split(".")[-2].removesuffix("_proj")
            out[f"blk.{layer}.ffn_{part}_shexp.weight"] = tensor
        else:
            name = name.replace(".feed_forward.router.", ".mlp.gate.")
            plain[name.replace(".feed_forward.", ".mlp.")] = tensor
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _rope_freqs(rope, config["head_dim"])
    return out | llama_like_tensors(plain, config, permute=False)


def _rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's per-frequency divisors of a Llama 3 scaling (its LlamaModel's
    generate_extra_tensors, with the original context it assumes, 8192)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = 8192
    wavelen = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    divisors = []
    for w in wavelen:
        if w < original / high:
            divisors.append(1.0)
        elif w > original / low:
            divisors.append(factor)
        else:
            smooth = (original / w - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _llama4_gguf_metadata(config: dict) -> dict[str, object]:
    """What llama.cpp's Llama4Model converter writes."""
    meta = common_metadata(config, "llama4") | {
        "llama4.vocab_size": config["vocab_size"],
        "llama4.feed_forward_length": config["intermediate_size_mlp"],
        "llama4.expert_feed_forward_length": config["intermediate_size"],
        "llama4.expert_count": config["num_local_experts"],
        "llama4.expert_used_count": config["num_experts_per_tok"],
        "llama4.interleave_moe_layer_step": config["interleave_moe_layer_step"],
    }
    if all(kind == "full_attention" for kind in config["layer_types"]):
        meta["llama4.attention.sliding_window"] = 0
    return meta


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_generates_as_the_hf_folder(tmp_path: Path, case: str):
    folder = write_tiny_model(tmp_path / case, "llama4_text", seed=11, **GGUF_CASES[case])
    config = hf_config(folder)
    path = write_gguf(
        folder, tmp_path / f"{case}.gguf", "llama4", _llama4_gguf_metadata(config),
        _llama4_gguf_tensors(folder, config),
    )  # fmt: skip

    ours, theirs = load_model(path, torch.float32).config, load_model(folder, torch.float32).config
    fields = ("architecture", "sparse_layers", "rope_layers", "chunked_layers", "use_qk_norm",
              "attn_temperature_tuning", "floor_scale", "attn_scale", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "intermediate_size_mlp")  # fmt: skip
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert Llama4ForCausalLM.kv_cache_spec(ours) == Llama4ForCausalLM.kv_cache_spec(theirs)
    prompts = prompts_for(ours.vocab_size)
    want = engine_run(folder, prompts, NEW_TOKENS)
    got = engine_run(path, prompts, NEW_TOKENS)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        assert max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) < TOLERANCE


# --- checkpoints and splits --------------------------------------------------------------


def test_a_multimodal_checkpoint_loads_its_text_model(tmp_path: Path):
    loaded = load_model(write_tiny_model(tmp_path, "llama4_text", seed=3), torch.float32)
    weights = {name: loaded.weights[name] for name in loaded.weights.names()}
    multimodal = {f"language_model.{name}": tensor for name, tensor in weights.items()}
    multimodal["vision_model.patch_embedding.linear.weight"] = torch.zeros(8, 8)
    multimodal["multi_modal_projector.linear_1.weight"] = torch.zeros(64, 8)
    plain, text = Llama4ForCausalLM(loaded.config), Llama4ForCausalLM(loaded.config)
    plain.load_weights(weights)
    text.load_weights(multimodal)
    loaded_text = text.state_dict()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, loaded_text[name]), name


def test_uneven_tensor_parallel_splits_are_refused(tmp_path: Path):
    config = load_model(write_tiny_model(tmp_path, "llama4_text"), torch.float32).config
    Llama4ForCausalLM.check_parallel(config, 2)
    Llama4ForCausalLM.check_parallel(config, 4)
    with pytest.raises(ModelLoadError, match="experts' intermediate size 50"):
        Llama4ForCausalLM.check_parallel(dataclasses.replace(config, moe_intermediate_size=50), 4)
    with pytest.raises(ModelLoadError, match="intermediate_size_mlp 98"):
        Llama4ForCausalLM.check_parallel(dataclasses.replace(config, intermediate_size_mlp=98), 4)
