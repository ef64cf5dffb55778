"""DeepSeek-V3 beyond the shared parity test: what MLA keeps in the cache, YaRN against
transformers, the routing with a real correction bias, the plain-q_proj / rotate-half
variant, the multi-token-prediction layers real checkpoints carry, what cannot be split
or read, and GGUF files written the way llama.cpp's converter writes deepseek2.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from family_harness import assert_matches_transformers, engine_run, load_runner, prompts_for
from gguf_writer import common_metadata, hf_config, hf_tensors, llama_like_tensors, write_gguf
from infire.config import SchedulerConfig
from infire.errors import ModelLoadError, UnsupportedModelError
from infire.layers.moe import grouped_topk
from infire.layers.rotary import attention_factor, inverse_frequencies
from infire.models.checkpoint import config_from_hf
from infire.models.deepseek_v3 import DeepseekV3ForCausalLM, softmax_scale
from infire.models.loader import load_model
from tiny_models import write_tiny_model

TOLERANCE = 1e-4
CONFIG_FIELDS = (  # what a GGUF file must give back of the config (not its MQA view)
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "rope_interleave",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "sparse_layers", "vocab_size", "intermediate_size", "num_hidden_layers",
)  # fmt: skip
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
    "beta_fast": 32.0, "beta_slow": 1.0,
}  # fmt: skip
# as the released models have it (DeepSeek-V3, Kimi K2: mscale == mscale_all_dim), which is
# all a GGUF file can say
YARN_RELEASED = YARN | {"mscale": 0.707}


def with_router_bias(folder: Path, seed: int = 0) -> Path:
    """Give every layer's e_score_correction_bias random values (the tiny model's are
    zeros), some negative, so that the bias changes which experts and groups win."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensor.shape, generator=g) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


def _matches_transformers(folder: Path, new_tokens: int, lengths=(37, 20, 5)) -> None:
    """The engine equals transformers on `folder` (logits and greedy tokens)."""
    vocab = load_model(folder, torch.float32).config.vocab_size
    assert_matches_transformers(folder, prompts_for(vocab, lengths), new_tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", seed=7)
    return with_router_bias(folder)


def test_cache_holds_only_the_latent_and_rope_key(tiny: Path):
    runner = load_runner(tiny, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    c = runner.config
    per_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
    assert runner.kv_bytes_per_token == per_token * torch.float32.itemsize
    held = sum(cache.numel() for cache in runner.kv_caches)
    assert held == per_token * runner.num_blocks * runner.block_size


def test_biased_routing_matches_transformers(tiny: Path):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    router = reference.model.layers[1].mlp.gate
    g = torch.Generator().manual_seed(1)
    # mostly negative biased scores: the experts outside the chosen groups must still lose
    router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.5 - 1)
    x = torch.randn(64, router.hidden_dim, generator=g)
    _, want_weights, want_ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    weights, ids = grouped_topk(
        logits, router.top_k, router.e_score_correction_bias, router.num_group,
        router.topk_group, router.norm_topk_prob, router.routed_scaling_factor,
    )  # fmt: skip
    ours = {(t, int(e)): w for t in range(64) for e, w in zip(ids[t], weights[t], strict=True)}
    theirs = {
        (t, int(e)): w for t in range(64) for e, w in zip(want_ids[t], want_weights[t], strict=True)
    }
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_logits_and_greedy_tokens_with_router_bias(tiny: Path):
    _matches_transformers(tiny, new_tokens=8)


def test_yarn_frequencies_and_scales_equal_transformers(tmp_path: Path):
    import transformers
    from transformers.modeling_rope_utils import yarn_apply_mscale

    folder = write_tiny_model(tmp_path, "deepseek_v3", seed=7, rope_parameters=YARN)
    config = load_model(folder, torch.float32).config
    reference = transformers.AutoConfig.from_pretrained(folder)
    want_inv_freq, want_factor = transformers.modeling_rope_utils._compute_yarn_parameters(
        reference
    )
    scaling = config.rope_scaling
    assert scaling is not None and scaling.kind == "yarn"
    assert torch.equal(inverse_frequencies(config.qk_rope_head_dim, config.rope_theta, scaling),
                       want_inv_freq)  # fmt: skip
    assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert want_factor != 1.0  # mscale != mscale_all_dim: cos and sin are scaled
    plain = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    want_scale = yarn_apply_mscale(reference.rope_parameters, plain)
    assert softmax_scale(config) == pytest.approx(want_scale, rel=1e-12)
    assert want_scale != plain


def test_yarn_logits_match_transformers(tmp_path: Path):
    folder = write_tiny_model(tmp_path, "deepseek_v3", seed=5, rope_parameters=YARN)
    # prompts past original_max_position_embeddings (64), where YaRN's ramp matters
    _matches_transformers(with_router_bias(folder, seed=5), 4, lengths=(90, 20))


def test_plain_q_proj_and_rotate_half_rope_match_transformers(tmp_path: Path):
    folder = write_tiny_model(
        tmp_path, "deepseek_v3", seed=11, q_lora_rank=None, rope_interleave=False
    )
    config = load_model(folder, torch.float32).config
    assert config.q_lora_rank is None and not config.rope_interleave
    _matches_transformers(with_router_bias(folder, seed=11), new_tokens=8)


def test_multi_token_prediction_layers_are_skipped(tiny: Path):
    loaded = load_model(tiny, torch.float32)
    weights = dict(loaded.weights)
    layers = loaded.config.num_hidden_layers
    mtp = f"model.layers.{layers}"  # DeepSeek-V3's layer 61: eh_proj, norms, its own MoE
    weights[f"{mtp}.eh_proj.weight"] = torch.zeros(4, 4)
    weights[f"{mtp}.mlp.experts.0.gate_proj.weight"] = torch.zeros(4, 4)
    weights[f"{mtp}.mlp.gate.e_score_correction_bias"] = torch.zeros(4)
    model = DeepseekV3ForCausalLM(loaded.config)
    model.load_weights(weights)  # neither refused nor loaded anywhere


def test_refuses_what_it_cannot_split_or_read(tiny: Path, tmp_path: Path):
    config = load_model(tiny, torch.float32).config
    DeepseekV3ForCausalLM.check_parallel(config, 4)
    with pytest.raises(ModelLoadError, match="num_attention_heads 4"):
        DeepseekV3ForCausalLM.check_parallel(config, 3)
    with pytest.raises(ModelLoadError, match="intermediate size 30"):
        DeepseekV3ForCausalLM.check_parallel(replace(config, moe_intermediate_size=30), 4)
    raw = hf_config(tiny) | {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ModelLoadError, match="fp8"):
        config_from_hf(raw, {}, tmp_path)
    # a deepseek2 GGUF without expert_gating_func routes by softmax in llama.cpp (V2, V2.5)
    with pytest.raises(UnsupportedModelError, match="softmax"):
        DeepseekV3ForCausalLM.gguf_config_fields({"deepseek2.block_count": 3}, "deepseek2")


# --- GGUF, as llama.cpp's DeepseekV2Model converter writes it --------------------------


def deepseek2_gguf(folder: Path, out: Path, split_kv_b: bool = True) -> Path:
    """The folder as a deepseek2 GGUF: MLA as MQA (one KV head of kv_lora + rope), kv_b
    split into k_b (transposed per head) and v_b, experts stacked, the bias as exp_probs_b;
    split_kv_b False: as converters before that split wrote it (kv_b whole, per-head
    key/value lengths)."""
    config, hf = hf_config(folder), hf_tensors(folder)
    arch = "deepseek2"
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    rope, latent, value = config["qk_rope_head_dim"], config["kv_lora_rank"], config["v_head_dim"]
    metadata = common_metadata(config, arch)
    metadata.update({
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.attention.key_length": latent + rope,
        f"{arch}.attention.value_length": latent,
        f"{arch}.attention.key_length_mla": nope + rope,
        f"{arch}.attention.value_length_mla": value,
        f"{arch}.attention.kv_lora_rank": latent,
        f"{arch}.rope.dimension_count": rope,
        f"{arch}.leading_dense_block_count": config["first_k_dense_replace"],
        f"{arch}.expert_feed_forward_length": config["moe_intermediate_size"],
        f"{arch}.expert_count": config["n_routed_experts"],
        f"{arch}.expert_used_count": config["num_experts_per_tok"],
        f"{arch}.expert_shared_count": config["n_shared_experts"],
        f"{arch}.expert_weights_scale": float(config["routed_scaling_factor"]),
        f"{arch}.expert_weights_norm": bool(config["norm_topk_prob"]),
        f"{arch}.expert_group_count": config["n_group"],
        f"{arch}.expert_group_used_count": config["topk_group"],
        f"{arch}.expert_gating_func": 2,  # sigmoid (the released configs' scoring_func)
    })  # fmt: skip
    if not split_kv_b:
        for key in ("key_length_mla", "value_length_mla"):
            del metadata[f"{arch}.attention.{key}"]
        metadata.update({
            f"{arch}.attention.head_count_kv": heads,
            f"{arch}.attention.key_length": nope + rope,
            f"{arch}.attention.value_length": value,
        })  # fmt: skip
    if config.get("q_lora_rank") is not None:
        metadata[f"{arch}.attention.q_lora_rank"] = config["q_lora_rank"]
    scaling = config.get("rope_parameters") or {}
    if scaling.get("rope_type") == "yarn":
        metadata.update({
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": float(scaling["factor"]),
            f"{arch}.rope.scaling.original_context_length":
                scaling["original_max_position_embeddings"],
            f"{arch}.rope.scaling.yarn_beta_fast": float(scaling["beta_fast"]),
            f"{arch}.rope.scaling.yarn_beta_slow": float(scaling["beta_slow"]),
            # the deepseek2 converter's own convention (not mscale_all_dim itself)
            f"{arch}.rope.scaling.yarn_log_multiplier": 0.1 * scaling["mscale_all_dim"],
        })  # fmt: skip
    tensors = llama_like_tensors(hf, config, permute=False)
    renames = {
        "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for hf_name, gguf_name in renames.items():
            if f"{prefix}.{hf_name}.weight" in hf:
                tensors[f"blk.{layer}.{gguf_name}.weight"] = hf[f"{prefix}.{hf_name}.weight"]
        kv_b = hf[f"{prefix}.self_attn.kv_b_proj.weight"]
        if split_kv_b:
            per_head = kv_b.reshape(heads, nope + value, latent)
            tensors[f"blk.{layer}.attn_k_b.weight"] = per_head[:, :nope].transpose(0, 2, 1)
            tensors[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(per_head[:, nope:])
        else:
            tensors[f"blk.{layer}.attn_kv_b.weight"] = kv_b
        bias = f"{prefix}.mlp.gate.e_score_correction_bias"
        if bias in hf:  # llama_like_tensors took it for a parameter of ffn_gate_inp
            tensors.pop(f"blk.{layer}.ffn_gate_inp.e_score_correction_bias")
            tensors[f"blk.{layer}.exp_probs_b.bias"] = hf[bias]
    return write_gguf(folder, out, arch, metadata, tensors)


@pytest.mark.parametrize(
    ("split_kv_b", "yarn"), [(True, False), (False, False), (True, True)],
    ids=["k_b-v_b", "kv_b", "yarn"],
)  # fmt: skip
def test_gguf_round_trip_gives_the_same_tokens(
    tiny: Path, tmp_path: Path, split_kv_b: bool, yarn: bool
):
    folder = tiny
    if yarn:
        folder = write_tiny_model(tmp_path / "hf", "deepseek_v3", 5, rope_parameters=YARN_RELEASED)
        folder = with_router_bias(folder, seed=5)
    gguf_file = deepseek2_gguf(folder, tmp_path / "tiny-deepseek2.gguf", split_kv_b)
    from_gguf, from_folder = load_model(gguf_file, torch.float32), load_model(folder, torch.float32)
    for field in CONFIG_FIELDS:
        assert getattr(from_gguf.config, field) == getattr(from_folder.config, field), field
    scaling, want_scaling = from_gguf.config.rope_scaling, from_folder.config.rope_scaling
    assert (scaling is None) == (want_scaling is None) == (not yarn)
    if yarn:  # the multiplier went through float32
        for field in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            assert getattr(scaling, field) == getattr(want_scaling, field), field
        assert scaling.mscale == pytest.approx(want_scaling.mscale, rel=1e-6)
        assert scaling.mscale_all_dim == pytest.approx(want_scaling.mscale_all_dim, rel=1e-6)
    prompts = prompts_for(from_folder.config.vocab_size, (90, 20, 5) if yarn else (37, 20, 5))
    ours, want = engine_run(gguf_file, prompts, 8), engine_run(folder, prompts, 8)
    assert ours.tokens == want.tokens
    for rows, want_rows in zip(ours.logits, want.logits, strict=True):
        for row, want_row in zip(rows, want_rows, strict=True):
            assert (row - want_row).abs().max().item() < TOLERANCE
