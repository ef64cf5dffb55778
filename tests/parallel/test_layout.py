"""How models are cut: balanced layer ranges, KV head shares, and refusals that name the
constraint a model breaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infire.config import ModelConfig
from infire.errors import ModelLoadError
from infire.models.llama import LlamaForCausalLM
from infire.parallel import TensorParallelGroup, check_parallel, kv_head_shard, layer_ranges

# SmolLM2-135M's shape
SMOLLM2 = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=8192,
)  # fmt: skip


def test_layer_ranges_are_contiguous_and_balanced():
    assert layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert layer_ranges(2, 2) == [(0, 1), (1, 2)]
    assert layer_ranges(5, 1) == [(0, 5)]
    for layers in range(1, 12):
        for stages in range(1, layers + 1):
            ranges = layer_ranges(layers, stages)
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            sizes = [end - start for start, end in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_kv_heads_split_or_replicated():
    def shares(kv: int, tp: int) -> list[tuple[int, int]]:
        return [kv_head_shard(kv, TensorParallelGroup(r, tp)) for r in range(tp)]

    assert shares(8, 2) == [(0, 4), (4, 4)]
    assert shares(2, 4) == [(0, 1), (0, 1), (1, 1), (1, 1)]  # rank r: head r * kv // tp
    assert shares(1, 2) == [(0, 1), (0, 1)]
    assert shares(3, 3) == [(0, 1), (1, 1), (2, 1)]


def test_smollm2_splits_three_ways_not_two():
    check_parallel(SMOLLM2, 3, 2)
    check_parallel(SMOLLM2, 1, 30)
    with pytest.raises(ModelLoadError, match="num_attention_heads 9 is not divisible by "
                       "tensor_parallel_size 2"):  # fmt: skip
        check_parallel(SMOLLM2, 2, 1)


@pytest.mark.parametrize(
    ("change", "tp", "pp", "named"),
    [
        ({"num_attention_heads": 12, "num_key_value_heads": 4}, 8, 1,
         "num_attention_heads 12 is not divisible by tensor_parallel_size 8"),
        ({"num_attention_heads": 12, "num_key_value_heads": 4}, 3, 1,
         "num_key_value_heads 4 is neither a multiple nor a divisor of tensor_parallel_size 3"),
        ({"intermediate_size": 1534}, 3, 1,
         "intermediate_size 1534 is not divisible by tensor_parallel_size 3"),
        ({"num_hidden_layers": 2}, 1, 3,
         "pipeline_parallel_size 3 is more than the model's 2 layers"),
        ({}, 0, 1, "must be at least 1"),
    ],
)  # fmt: skip
def test_refusals_name_the_constraint(change: dict, tp: int, pp: int, named: str):
    config = dataclasses.replace(SMOLLM2, **change)
    with pytest.raises(ModelLoadError, match=named) as info:
        check_parallel(config, tp, pp)
    assert f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}" in str(info.value)


def test_the_model_refuses_a_tp_group_it_cannot_split():
    refused = pytest.raises(ModelLoadError, match="num_attention_heads 9 is not divisible")
    with refused, torch.device("meta"):
        LlamaForCausalLM(SMOLLM2, TensorParallelGroup(0, 2))


def test_a_stage_builds_only_its_layers():
    with torch.device("meta"):
        first = LlamaForCausalLM(SMOLLM2, layer_range=(0, 8))
        last = LlamaForCausalLM(SMOLLM2, layer_range=(23, 30))
    assert len(first.layers) == 8 and first.embed_tokens is not None
    assert first.norm is None and first.lm_head is None and not first.is_last_stage
    assert len(last.layers) == 7 and last.embed_tokens is None and last.lm_head is not None
    with pytest.raises(RuntimeError, match="last pipeline stage"):
        first.compute_logits(torch.zeros(1, 576, device="meta"))
    with pytest.raises(ValueError, match="layer_range"):
        LlamaForCausalLM(SMOLLM2, layer_range=(8, 31))


def test_experts_that_cannot_split_are_refused_before_any_rank_starts():
    from infire.models.mixtral import MoEConfig
    from infire.models.registry import check_split

    moe = MoEConfig(
        architecture="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=50, sparse_layers=(0, 1),
    )  # fmt: skip
    check_split(moe, 2, 2)  # 50 splits in two
    with pytest.raises(ModelLoadError, match="experts' intermediate size 50 is not divisible"):
        check_split(moe, 4, 1)
    mixtral = dataclasses.replace(  # Mixtral's experts are intermediate_size wide
        moe, architecture="mixtral", moe_intermediate_size=0, intermediate_size=102
    )
    with pytest.raises(ModelLoadError, match="intermediate_size 102 is not divisible"):
        check_split(mixtral, 4, 1)
