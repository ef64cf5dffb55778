"""Gemma 3 beyond the shared parity test: config variants, the sliding window's bounded KV,
GGUF files as llama.cpp writes them, and the text half of a multimodal checkpoint.

Every run compares against transformers on tiny random models in float32 (logits within
1e-4, greedy tokens equal), through the real scheduler with a 16-token budget and
4-token blocks, so prompts longer than the 8-token window prefill in chunks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import family_harness
from family_harness import assert_matches_transformers, engine_run, prompts_for
from gguf_writer import common_metadata, hf_config, hf_tensors, write_gguf
from infire.engine.kv_cache import BlockManager
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.layers.kv_spec import AttentionWindow
from infire.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM
from infire.models.loader import load_model
from tiny_models import write_tiny_model

TOLERANCE = 1e-4


def _legacy_config(folder: Path) -> None:
    """Rewrite a saved config.json as transformers 4 wrote Gemma 3's (the Hub's files): no
    layer_types, a sliding_window_pattern, top-level RoPE keys, no tie_word_embeddings."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern", "tie_word_embeddings"):
        raw.pop(key, None)
    raw.update(
        sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )  # fmt: skip
    path.write_text(json.dumps(raw))


def _variant(name: str) -> dict:
    """write_tiny_model's overrides for a variant."""
    if name == "legacy_config":  # layer types and RoPE rewritten by _legacy_config
        return dict(tie_word_embeddings=True, num_hidden_layers=5, layer_types=None)
    # Gemma's defaults: a tied head; soft-capped logits; the global RoPE scaled; an odd scalar
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return dict(
        tie_word_embeddings=True, final_logit_softcapping=3.0, rope_parameters=rope,
        query_pre_attn_scalar=24,
    )  # fmt: skip


@pytest.mark.parametrize("variant", ["tied_softcap_linear_rope", "legacy_config"])
def test_config_variants_match_transformers(tmp_path: Path, variant: str):
    folder = write_tiny_model(tmp_path / variant, "gemma3_text", seed=5, **_variant(variant))
    if variant == "legacy_config":
        _legacy_config(folder)
    config = load_model(folder, torch.float32).config
    assert config.tie_word_embeddings
    if variant == "legacy_config":
        assert config.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING)
        assert config.rope_scaling is not None and config.rope_scaling.factor == 2.0
    else:
        assert config.final_logit_softcapping == 3.0 and config.global_rope_scaling.factor == 4.0
    assert_matches_transformers(folder, prompts_for(config.vocab_size), 16)


def test_sliding_window_is_transformers_mask():
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    window = AttentionWindow("sliding", 8)
    overlay = sliding_window_overlay(8)
    for query in range(30):
        seen = [k for k in range(30) if causal_mask_function(0, 0, query, k)]
        seen = [k for k in seen if overlay(0, 0, query, k)]
        assert seen == list(range(window.first_visible(query), query + 1))


def test_kv_spec_groups_the_sliding_layers(tmp_path: Path):
    folder = write_tiny_model(tmp_path / "m", "gemma3_text", seed=1)
    config = load_model(folder, torch.float32).config
    spec = Gemma3ForCausalLM.kv_cache_spec(config)
    assert spec.groups[0].layers == (1, 3) and spec.groups[0].window is None
    assert spec.groups[1].layers == (0, 2)
    assert spec.windows == (AttentionWindow("sliding", 8),)


def test_long_generation_keeps_the_window_bounded(tmp_path: Path, monkeypatch):
    folder = write_tiny_model(tmp_path / "m", "gemma3_text", seed=7)
    held = {}  # per sequence, when it finishes: (tokens computed, full blocks, window blocks)

    class Recording(BlockManager):
        def free(self, seq):
            live = sum(block >= 0 for block in seq.window_block_tables[0])
            held[seq.seq_id] = (seq.num_computed_tokens, len(seq.block_table), live)
            super().free(seq)

    monkeypatch.setattr(family_harness, "BlockManager", Recording)
    new_tokens = 60
    prompts = prompts_for(load_model(folder, torch.float32).config.vocab_size, (40, 30))
    run = assert_matches_transformers(folder, prompts, new_tokens)
    per_sequence = run.runner.windows[0].max_blocks(16, run.runner.block_size)
    assert 0 < run.window_blocks_peak[0] <= per_sequence * len(prompts)
    for seq_id, prompt in enumerate(prompts):
        tokens, full, live = held[seq_id]
        assert tokens == len(prompt) + new_tokens - 1  # the last sampled token is not fed
        assert full == run.blocks.blocks_needed(tokens)  # the global layers keep every token
        assert live <= per_sequence < full


def test_attention_softcapping_is_refused(tmp_path: Path):
    folder = write_tiny_model(tmp_path / "m", "gemma3_text", attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        load_model(folder, torch.float32)


def test_check_parallel_refuses_what_cannot_split(tmp_path: Path):
    config = load_model(write_tiny_model(tmp_path / "m", "gemma3_text"), torch.float32).config
    Gemma3ForCausalLM.check_parallel(config, 2)
    Gemma3ForCausalLM.check_parallel(config, 4)  # 2 KV heads, each on two ranks
    with pytest.raises(ModelLoadError, match="num_attention_heads 4"):
        Gemma3ForCausalLM.check_parallel(config, 3)


# --- GGUF --------------------------------------------------------------------------------

_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _gemma3_gguf_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's Gemma3Model conversion: its names, every norm weight plus one, no
    output.weight for the tied head."""
    out = {}
    for name, tensor in hf.items():
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = tensor
        elif name == "model.norm.weight":
            out["output_norm.weight"] = tensor
        elif name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            base, _, kind = rest.rpartition(".")
            out[f"blk.{layer}.{_GGUF_LAYER[base]}.{kind}"] = tensor
    return out


def _gemma3_gguf_metadata(config: dict) -> dict:
    """What llama.cpp's converter writes for gemma3: the global RoPE base as freq_base,
    the local one as freq_base_swa, the window and the logit cap (no layer pattern)."""
    rope = config["rope_parameters"]
    return common_metadata(config, "gemma3") | {
        "gemma3.rope.freq_base": float(rope["full_attention"]["rope_theta"]),
        "gemma3.rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
        "gemma3.attention.sliding_window": config["sliding_window"],
        "gemma3.final_logit_softcapping": float(config["final_logit_softcapping"]),
    }


def test_gguf_generates_as_transformers(tmp_path: Path):
    # six layers in llama.cpp's fixed pattern (the sixth global), as transformers derives
    # them for a config without layer_types
    folder = write_tiny_model(
        tmp_path / "hf", "gemma3_text", seed=11, num_hidden_layers=6, layer_types=None,
        tie_word_embeddings=True, final_logit_softcapping=5.0,
    )  # fmt: skip
    config = hf_config(folder)
    tensors = _gemma3_gguf_tensors(hf_tensors(folder))
    metadata = _gemma3_gguf_metadata(config)
    path = write_gguf(folder, tmp_path / "gemma3.gguf", "gemma3", metadata, tensors)

    from_gguf = load_model(path, torch.float32).config
    from_hf = load_model(folder, torch.float32).config
    assert from_gguf.layer_types == from_hf.layer_types == (SLIDING,) * 5 + (FULL,)
    for field in ("sliding_window", "global_rope_theta", "local_rope_theta", "tie_word_embeddings",
                  "query_pre_attn_scalar", "final_logit_softcapping", "rope_theta"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    prompts = prompts_for(from_gguf.vocab_size)
    run = assert_matches_transformers(path, prompts, 32, reference=folder)
    assert run.tokens == engine_run(folder, prompts, 32).tokens


# --- Gemma3ForConditionalGeneration's language model ----------------------------------------


def test_multimodal_checkpoint_text_part(tmp_path: Path):
    """The 4B-27B checkpoints: language_model.model.* weights beside a vision tower. Their
    language model loads from those names and runs as transformers' text model."""
    import transformers

    ref = write_tiny_model(tmp_path / "text", "gemma3_text", seed=3, tie_word_embeddings=True)
    text = transformers.AutoConfig.from_pretrained(ref)
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=262
    )
    multimodal = transformers.Gemma3ForConditionalGeneration(config)
    multimodal.model.language_model.load_state_dict(
        transformers.AutoModelForCausalLM.from_pretrained(ref).model.state_dict()
    )
    multimodal.save_pretrained(tmp_path / "multimodal")
    # the text model's config with the multimodal checkpoint's weights
    folder = tmp_path / "mixed"
    shutil.copytree(ref, folder)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    for file in (tmp_path / "multimodal").glob("*.safetensors"):
        shutil.copy(file, folder / file.name)
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)

    assert_matches_transformers(folder, prompts_for(text.vocab_size), 16, reference=ref)
