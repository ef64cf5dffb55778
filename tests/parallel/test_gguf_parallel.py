"""Quantized GGUF blocks on tensor- and pipeline-parallel ranks (gloo, real processes):
each rank's linears hold their slice of the file's blocks (whole rows for column-parallel
layers, whole blocks of every row for row-parallel ones), nothing is dequantized, the
greedy tokens are one rank's up to near-ties, and a tensor-parallel size whose cut would
split a block is refused, naming the tensor, with no process left behind. Routed experts
hold their slices too; a merged weight with a part of a type the kernel does not read is
decoded to float."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_writer import (
    common_metadata,
    hf_config,
    hf_tensors,
    llama_like_tensors,
    write_gguf,
    write_tiny_k_quant,
    write_tiny_mixtral_q8,
)
from greedy_verdicts import compare_greedy
from infire import LLM, SamplingParams
from infire.errors import ModelLoadError
from infire.kernels.cpu_forward import available
from infire.layers.embedding import VocabParallelEmbedding
from infire.layers.linear import LinearBase
from infire.layers.moe import FusedMoE
from processes import child_pids
from tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="no fused CPU kernel here")

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Call me at", "Is water wet?"]


def _greedy(model: str | None, tp: int, pp: int, prompts: list, tokens: int) -> tuple[list, LLM]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    llm = LLM(model, dtype="float32", num_blocks=64, tensor_parallel_size=tp,
              pipeline_parallel_size=pp)  # fmt: skip
    return [o.outputs[0] for o in llm.generate(prompts, params)], llm


def _held_blocks(llm: LLM) -> dict[str, tuple[int, int]]:
    """Rank 0's linears and embedding: (rows, bytes per row) of the blocks each holds;
    asserts that none holds a float weight."""
    held = {}
    for name, module in llm.engine.runner.model.named_modules():
        if isinstance(module, LinearBase | VocabParallelEmbedding):
            assert module.quant is not None and module.weight.numel() == 0, name
            _, data, index = module.quant.parts_blocks[0]
            held[name] = (module.quant.rows, data.shape[1])
    return held


def test_smollm2_blocks_on_tensor_and_pipeline_ranks() -> None:
    reference, llm = _greedy(None, 1, 1, PROMPTS, 12)
    with llm:
        # every matmul weight and the head: Q4_1/Q8_0 rows in groups of 16
        assert llm.engine.runner.fused_status == (
            "active, GGUF blocks (211 tensors in groups of 16 rows)"
        )
    outputs = {}
    for tp, pp in [(3, 1), (3, 2), (1, 2)]:
        got, llm = _greedy(None, tp, pp, PROMPTS, 12)
        with llm:
            assert "GGUF blocks in the PyTorch path's linears" in llm.engine.runner.fused_status
            held = _held_blocks(llm)
        outputs[tp, pp] = [o.token_ids for o in got]
        print((tp, pp), "per prompt:", compare_greedy(got, reference))
        if tp == 3:  # 9 heads, 3 KV heads, 576 hidden, 1536 intermediate: a third each
            layer = "layers.0."
            assert held[layer + "self_attn.qkv_proj"][0] == (3 + 1 + 1) * 64
            assert held[layer + "self_attn.o_proj"] == (576, 192 // 32 * 20)  # Q4_1
            assert held[layer + "mlp.gate_up_proj"][0] == 2 * 512
            assert held[layer + "mlp.down_proj"] == (576, 512 // 32 * 20)
            assert held["embed_tokens"][0] == 49152 // 3
    # the same shards on a pipeline: the same arithmetic, token for token
    assert outputs[3, 2] == outputs[3, 1]


@pytest.fixture(scope="module")
def tiny_k_quant(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama in K-quants (Q4_K, Q5_K o_proj, Q6_K v/down/head, Q8_0
    embedding) of a given hidden size."""
    return lambda hidden: write_tiny_k_quant(tmp_path_factory.mktemp(f"tiny-k-{hidden}"), hidden)


def test_k_quant_blocks_on_two_ranks(tiny_k_quant) -> None:
    """Hidden 512: each rank's o_proj and down_proj take whole 256-value blocks."""
    path = str(tiny_k_quant(512))
    prompts = [[(5 * i + 11 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([4, 17, 40])]
    reference, llm = _greedy(path, 1, 1, prompts, 16)
    llm.shutdown()
    got, llm = _greedy(path, 2, 1, prompts, 16)
    with llm:
        held = _held_blocks(llm)
    assert held["layers.0.self_attn.o_proj"] == (512, 176)  # one Q5_K block a row
    assert held["layers.0.mlp.down_proj"] == (512, 2 * 210)  # two Q6_K blocks a row
    print("per prompt:", compare_greedy(got, reference))


def test_a_cut_inside_a_block_is_refused(tiny_k_quant) -> None:
    """Hidden 256 on two ranks: o_proj's 128 columns a rank would split its Q5_K blocks."""
    path = str(tiny_k_quant(256))
    before = child_pids()
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight: columns 0\.\.128 split its "
                       r"Q5_K blocks of 256 values.*--quantization none"):  # fmt: skip
        LLM(path, dtype="float32", num_blocks=64, tensor_parallel_size=2)
    assert child_pids() <= before
    with LLM(path, dtype="float32", num_blocks=64, tensor_parallel_size=2,
             quantization="none") as llm:  # fmt: skip
        assert "GGUF blocks" not in llm.engine.runner.fused_status


def test_mixtral_experts_as_blocks_on_two_ranks(tmp_path: Path) -> None:
    """Each rank holds its slice of every expert's gate|up rows and down columns."""
    path = str(write_tiny_mixtral_q8(tmp_path))  # hidden 64, intermediate 128
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([5, 23])]
    reference, llm = _greedy(path, 1, 1, prompts, 12)
    llm.shutdown()
    got, llm = _greedy(path, 2, 1, prompts, 12)
    with llm:
        moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE))
        assert moe.quant_w13 is not None and moe.w13.numel() == 0 and moe.w2.numel() == 0
        assert moe.quant_w13[0].rows == 2 * 64  # gate and up: half of 128 rows each
        assert moe.quant_w2[0].parts_blocks[0][1].shape == (64, 64 // 32 * 34)
    print("per prompt:", compare_greedy(got, reference))


def test_a_merged_weight_with_a_part_the_kernel_does_not_read(tmp_path: Path) -> None:
    """Layer 0's v in Q3_K, the rest Q8_0: that q|k|v is decoded to float (q and k from
    their blocks), every other weight stays blocks; the tokens are the dequantized
    model's up to near-ties."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    folder = write_tiny_model(tmp_path / "q3", "llama", seed=4, hidden_size=256,
                              intermediate_size=256)  # fmt: skip
    config = hf_config(folder)
    tensors = llama_like_tensors(hf_tensors(folder), config, permute=True)
    types = {name: T.Q8_0 for name, value in tensors.items() if value.ndim == 2}
    v = tensors["blk.0.attn_v.weight"]  # random Q3_K blocks (110 bytes), a small float16 d
    blocks = np.random.default_rng(0).integers(0, 256, (v.shape[0], 110), dtype=np.uint8)
    blocks[:, 108:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    tensors["blk.0.attn_v.weight"], types["blk.0.attn_v.weight"] = blocks, T.Q3_K
    path = str(write_gguf(folder, tmp_path / "q3.gguf", "llama",
                          common_metadata(config, "llama"), tensors, types))  # fmt: skip
    prompts = [[(5 * i + 11 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([4, 17])]
    reference, llm = _greedy(path, 1, 1, prompts, 12)
    with llm:
        assert "GGUF blocks dequantized" in llm.engine.runner.fused_status
    got, llm = _greedy(path, 2, 1, prompts, 12)
    with llm:
        attention = [layer.self_attn for layer in llm.engine.runner.model.layers]
        assert attention[0].qkv_proj.quant is None  # float, packed for oneDNN
        assert attention[0].qkv_proj.packed is not None
        assert attention[1].qkv_proj.quant is not None and attention[0].o_proj.quant is not None
    print("per prompt:", compare_greedy(got, reference))
