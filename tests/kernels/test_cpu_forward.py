"""The fused CPU forward (infire.kernels.cpu_forward): layout, parity, batching, fallbacks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from infire.config import CacheConfig, EngineConfig, SchedulerConfig
from infire.engine import merge_delta
from infire.engine.engine import LLMEngine
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner
from infire.kernels import cpu_forward
from infire.models.loader import load_model
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")),
    reason="the fused forward needs AVX2",
)


def _untile(tiled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if tiled.dtype == torch.bfloat16:
        tiled = tiled.transpose(-2, -3).reshape(*tiled.shape[:-3], 16)
    return tiled.transpose(1, 2).reshape(-1, cols)[:rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_weight_is_a_lossless_permutation(dtype: torch.dtype):
    weight = torch.randn(10, 48).to(dtype)
    tiled = cpu_forward.tile_weight(weight)
    assert tiled.shape[0] == 3 and tiled.numel() == 12 * 48  # rows padded to a multiple of 4
    full = _untile(tiled, 12, 48)
    assert torch.equal(full[:10], weight) and not full[10:].any()
    if dtype == torch.bfloat16:
        # 16-chunks stored (w0-3, w8-11, w4-7, w12-15): lane-wise unpacks give columns 0-15
        chunk = tiled[0, 0, 0].reshape(-1)
        order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
        assert torch.equal(chunk, weight[0, order])


def _runner(
    folder: Path, dtype: torch.dtype, prompt: list[int], block_size: int = 16
) -> tuple[ModelRunner, Sequence]:
    loaded = load_model(folder, dtype)
    cache = CacheConfig(num_blocks=64, block_size=block_size)
    runner = ModelRunner(loaded.config, loaded.weights, cache, dtype)
    assert runner.fused_status == "active"
    seq = Sequence(
        seq_id=0, request_id="r", index=0, prompt_token_ids=prompt,
        params=SamplingParams(temperature=0), metrics=RequestMetrics(0.0),
        detokenizer=IncrementalDetokenizer(loaded.tokenizer),
    )  # fmt: skip
    return runner, seq


def _fused_logits(runner: ModelRunner, blocks: BlockManager, seq: Sequence, n: int) -> torch.Tensor:
    """The next n tokens of seq through the fused forward; logits of the last one."""
    assert blocks.allocate(seq, seq.num_computed_tokens + n)
    start = seq.num_computed_tokens
    positions = list(range(start, start + n))
    bs = runner.block_size
    slots = [seq.block_table[p // bs] * bs + p % bs for p in positions]
    logits = runner.fused.forward(
        seq.token_ids[start:], positions, slots, [0] * n, [seq.block_table], [n - 1]
    )
    seq.num_computed_tokens += n
    return logits[0]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mixtral (4 experts, top-2): the fused forward routes its experts."""
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral", seed=6)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3: the fused forward norms every q and k head."""
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=6)


def _tiny_qwen3_moe(factory: pytest.TempPathFactory, renormalize: bool) -> Path:
    from tiny_models import write_tiny_model

    folder = factory.mktemp("tiny-qwen3-moe")
    return write_tiny_model(folder, "qwen3_moe", seed=6, norm_topk_prob=renormalize)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE (a dense layer among sparse ones), top-k renormalized."""
    return _tiny_qwen3_moe(tmp_path_factory, True)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with the top-k softmax weights left as they are (norm_topk_prob false)."""
    return _tiny_qwen3_moe(tmp_path_factory, False)


def _match_reference(
    reference: transformers.PreTrainedModel, runner: ModelRunner, blocks: BlockManager,
    seq: Sequence, prompt: torch.Tensor, steps: int,
) -> None:  # fmt: skip
    """The fused forward's logits of the prompt's last token, then of `steps` greedy tokens,
    equal transformers' (fp32) within 1e-4."""
    ours = _fused_logits(runner, blocks, seq, len(prompt))
    with torch.no_grad():
        out = reference(prompt.unsqueeze(0), use_cache=True)
    assert (ours - out.logits[0, -1]).abs().max().item() < 1e-4
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        seq.token_ids.append(token)
        ours = _fused_logits(runner, blocks, seq, 1)
        with torch.no_grad():
            out = reference(torch.tensor([[token]]), past_key_values=out.past_key_values)
        assert (ours - out.logits[0, -1]).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama",
        "tiny_qwen2",
        "tiny_mixtral",
        "tiny_qwen3",
        "tiny_qwen3_moe",
        "tiny_qwen3_moe_raw",
    ],
)
def test_prefill_and_decode_match_transformers(fixture: str, request: pytest.FixtureRequest):
    folder = request.getfixturevalue(fixture)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = torch.randint(
        0, reference.config.vocab_size, (37,), generator=torch.Generator().manual_seed(3)
    )
    runner, seq = _runner(folder, torch.float32, prompt.tolist())
    blocks = BlockManager(runner.num_blocks, runner.block_size)

    _match_reference(reference, runner, blocks, seq, prompt, 16)


def test_blocks_longer_than_a_span_attend_in_pieces(tiny_llama: Path):
    """Blocks of 80 keys: a query's keys go 64 at a time (the span widened for all query
    heads of a KV head), the second span cut at the block's end; the same logits as
    transformers over a 150-token prompt and its next tokens."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = torch.randint(
        0, reference.config.vocab_size, (150,), generator=torch.Generator().manual_seed(5)
    )
    runner, seq = _runner(tiny_llama, torch.float32, prompt.tolist(), block_size=80)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    holes = [
        Sequence(
            seq_id=i, request_id=f"h{i}", index=0, prompt_token_ids=[1], params=seq.params,
            metrics=RequestMetrics(0.0), detokenizer=seq.detokenizer,
        )
        for i in (1, 2)
    ]  # fmt: skip
    for hole in holes:
        assert blocks.allocate(hole, 1)
    blocks.free(holes[0])  # the sequence's blocks are 0, 2, 3: a span may not run on
    _match_reference(reference, runner, blocks, seq, prompt, 12)  # past 160, the 2nd block's end
    assert seq.block_table == [0, 2, 3]


def test_bfloat16_matches_fp32_compute_on_bf16_weights(tiny_llama: Path):
    """bf16 weights, fp32 activations: only the bf16 KV cache rounds on top of the weights."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    prompt = list(range(5, 45))
    runner, seq = _runner(tiny_llama, torch.bfloat16, prompt)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    ours = _fused_logits(runner, blocks, seq, len(prompt))
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1]
    assert (ours - theirs).abs().max().item() < 2e-2 * theirs.abs().max().item()
    assert int(ours.argmax()) == int(theirs.argmax())


def _engine(model: Path, dtype: str, budget: int = 2048, cpu_kernels: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model), dtype=dtype, cpu_kernels=cpu_kernels,
            cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        )
    )  # fmt: skip


def _generate(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    outputs = {}
    while len(done) < len(prompts):
        for delta in engine.step():
            output = outputs[delta.request_id] = merge_delta(outputs.get(delta.request_id), delta)
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("seeded", [False, True])
def test_bfloat16_batching_chunking_and_prefix_cache_change_nothing(tiny_llama: Path, seeded: bool):
    """In bf16 every token runs through the fused forward; scheduling must not show."""
    params = SamplingParams(
        temperature=0.8 if seeded else 0, seed=7, max_tokens=12, ignore_eos=True
    )
    prefix = list(range(10, 60))
    prompts = [prefix + [70 + i] * (3 + i) for i in range(4)]
    solo = [_generate(_engine(tiny_llama, "bfloat16"), [p], params)[0] for p in prompts]
    assert _generate(_engine(tiny_llama, "bfloat16"), prompts, params) == solo
    engine = _engine(tiny_llama, "bfloat16", budget=16)
    assert _generate(engine, prompts, params) == solo
    assert engine.stats.prefix_cache_hits >= 48
    # the fused forward runs every bf16 step, so PyTorch's copy of the matmuls is freed
    assert engine.runner.model.layers[0].mlp.down_proj.weight.numel() == 0


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_mixtral", "tiny_qwen3_moe"])
def test_fp32_paths_agree_on_greedy_tokens(fixture: str, request: pytest.FixtureRequest):
    model = request.getfixturevalue(fixture)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [list(range(3, 30)), list(range(40, 45)), [7] * 9, list(range(100, 131))]
    fused = _generate(_engine(model, "float32"), prompts, params)
    plain = _generate(_engine(model, "float32", cpu_kernels=False), prompts, params)
    assert fused == plain


def test_bfloat16_mixtral_runs_every_step_fused(tiny_mixtral: Path):
    """In bf16 the fused forward routes prefill and decode experts alike; batching and
    chunking change nothing, and PyTorch's copy of the experts is freed."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(10, 40)) + [70 + i] * (3 + i) for i in range(4)]
    solo = [_generate(_engine(tiny_mixtral, "bfloat16"), [p], params)[0] for p in prompts]
    engine = _engine(tiny_mixtral, "bfloat16", budget=16)
    assert _generate(engine, prompts, params) == solo
    assert engine.runner.fused_status == "active"
    assert engine.runner.model.layers[0].mlp.experts.w13.numel() == 0


def test_compiler_failure_falls_back_to_pytorch(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("INFIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    cpu_forward.load_library.cache_clear()
    try:
        engine = _engine(tiny_llama, "float32")
        assert engine.runner.fused is None
        assert engine.runner.fused_status.startswith("unavailable: /bin/false failed")
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        assert len(_generate(engine, [[5, 6, 7]], params)[0]) == 5
    finally:
        cpu_forward.load_library.cache_clear()


def test_unsupported_models_and_dtypes_are_named(tiny_llama: Path):
    config = load_model(tiny_llama, torch.float32).config
    cpu = torch.device("cpu")
    assert cpu_forward.unsupported_reason(config, torch.float32, cpu) is None
    assert "float16" in cpu_forward.unsupported_reason(config, torch.float16, cpu)
    odd = dataclasses.replace(config, hidden_size=72)
    assert "hidden_size 72" in cpu_forward.unsupported_reason(odd, torch.float32, cpu)
    assert "device is meta" in cpu_forward.unsupported_reason(
        config, torch.float32, torch.device("meta")
    )
    engine = _engine(tiny_llama, "float32", cpu_kernels=False)
    assert engine.runner.fused is None and engine.runner.fused_status == "disabled"
