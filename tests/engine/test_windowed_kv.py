"""Windowed KV groups (a tiny Mistral with an 8-token sliding window on every layer, 4-token
blocks): blocks out of the window are released as a generation grows, so the windowed
pool stays bounded while outputs still equal transformers', and the prefix cache reuses
a prompt's cached blocks in every pool, giving the same tokens as without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from family_harness import engine_run, prompts_for, reference_run
from infire import LLM, SamplingParams
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.layers.kv_spec import AttentionWindow
from infire.outputs import RequestMetrics
from tiny_models import write_tiny_model

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", seed=2)


def test_a_long_generation_keeps_the_window_pool_bounded(tiny_mistral: Path):
    prompts = prompts_for(200, lengths=(45, 30))
    run = engine_run(tiny_mistral, prompts, new_tokens=60, token_budget=16)
    window = AttentionWindow("sliding", WINDOW)
    per_sequence = window.max_blocks(16, run.runner.block_size)
    assert run.window_blocks_peak[0] <= len(prompts) * per_sequence
    # 105 tokens a sequence would need 27 blocks each without the window
    assert per_sequence < 27
    assert run.blocks.windows[0].num_used_blocks == 0  # all released at the end
    want_logits, want_tokens = reference_run(tiny_mistral, prompts, run.tokens, 60)
    assert run.tokens == want_tokens
    for ours, theirs in zip(run.logits, want_logits, strict=True):
        assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=False)) < 1e-4


def test_prefix_cache_reuses_the_window_blocks(tiny_mistral: Path):
    shared = [(5 * i) % 200 + 1 for i in range(40)]
    prompts = [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        with LLM(str(tiny_mistral), dtype="float32", block_size=4, num_blocks=64,
                 enable_prefix_caching=caching) as llm:  # fmt: skip
            first = llm.generate(prompts[:1], params)
            outputs[caching] = first + llm.generate(prompts[1:], params)
            hits = llm.engine.stats.prefix_cache_hits
            assert llm.engine.block_manager.num_free_blocks == 64
        assert (hits >= 36) == caching  # 9 of the 10 shared blocks (one token left to run)
    tokens = {k: [o.outputs[0].token_ids for o in v] for k, v in outputs.items()}
    assert tokens[True] == tokens[False]


def test_a_cached_prefix_takes_only_the_blocks_its_window_spans():
    manager = BlockManager(32, 4, True, [(AttentionWindow("sliding", WINDOW), 16)])
    first = _sequence(0, list(range(1, 22)))
    assert manager.acquire_cached_prefix(first) == 0
    assert manager.allocate(first, 21)
    first.num_computed_tokens = 21
    manager.cache_full_blocks(first)  # 5 full blocks
    window_blocks = list(first.window_block_tables[0])
    manager.free(first)

    second = _sequence(1, list(range(1, 22)) + [99])
    assert manager.acquire_cached_prefix(second) == 20
    assert second.block_table == first_blocks(manager, 5)
    # token 20 sees positions 13..20: blocks 3 and 4 of the window pool, none before
    assert second.window_block_tables[0] == [-1, -1, -1, *window_blocks[3:5]]
    assert manager.windows[0].ref_counts[window_blocks[3]] == 1
    assert manager.allocate(second, 22)
    manager.free(second)
    assert manager.num_free_blocks == 32 and manager.windows[0].num_free_blocks == 16


def first_blocks(manager: BlockManager, count: int) -> list[int]:
    """The main pool's blocks cached for the first `count` blocks of 1..20."""
    from infire.engine.kv_cache import prefix_block_hashes

    keys = prefix_block_hashes(list(range(1, 21)), 4)[:count]
    return [manager.block_of_hash[key] for key in keys]


def _sequence(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(
        seq_id=seq_id, request_id=str(seq_id), index=0, prompt_token_ids=tokens,
        params=SamplingParams(), metrics=RequestMetrics(0.0), detokenizer=None,  # type: ignore[arg-type]
    )  # fmt: skip


def test_aborting_a_waiting_request_frees_nothing_it_never_held(tiny_mistral: Path):
    from infire.config import CacheConfig, EngineConfig, SchedulerConfig
    from infire.engine.engine import LLMEngine

    config = EngineConfig(
        model=str(tiny_mistral), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=1),
    )  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("running", list(range(1, 20)), params)
    engine.add_request("waiting", list(range(5, 30)), params)
    engine.step()
    engine.abort_request("waiting")  # never scheduled: no window tables
    while engine.has_unfinished_requests():
        engine.step()
    manager = engine.block_manager
    assert manager.num_free_blocks == 32 and manager.windows[0].num_free_blocks == 32


def test_the_budget_gives_windows_what_they_can_use(tmp_path: Path, tiny_mistral: Path):
    import torch

    from infire.config import CacheConfig, SchedulerConfig
    from infire.engine.runner import ModelRunner
    from infire.errors import ModelLoadError
    from infire.models.loader import load_model

    gemma = load_model(write_tiny_model(tmp_path / "gemma", "gemma3_text"), torch.float32)
    limits = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    budget = 1 << 20
    runner = ModelRunner(gemma.config, gemma.weights, CacheConfig(block_size=4,
                         kv_cache_memory=budget), torch.float32, scheduler_config=limits)  # fmt: skip
    full, window = runner.group_num_blocks
    # 4 windows of 8 tokens (2 + 2 blocks each) and a 64-token step (16 blocks)
    assert window == 4 * 4 + 16
    per_block = [g.elements_per_token * 4 * 4 for g in runner.kv_spec.groups]
    assert full * per_block[0] + window * per_block[1] <= budget
    assert full > 10 * window  # the full-attention layers get the rest
    assert sum(t.numel() * 4 for t in runner.kv_caches) <= budget

    mistral = load_model(tiny_mistral, torch.float32)  # every layer windowed
    with pytest.raises(ModelLoadError, match="kv-cache-memory 4096 bytes is too small"):
        ModelRunner(mistral.config, mistral.weights, CacheConfig(block_size=4,
                    kv_cache_memory=4096), torch.float32, scheduler_config=limits)  # fmt: skip


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path: Path):
    import torch

    from infire.config import CacheConfig
    from infire.engine.runner import ModelRunner
    from infire.models.loader import load_model

    folder = write_tiny_model(tmp_path / "long-window", "mistral", sliding_window=256)
    loaded = load_model(folder, torch.float32)
    runner = ModelRunner(loaded.config, loaded.weights, CacheConfig(num_blocks=8), torch.float32)
    assert runner.windows == () and not runner.fused_status.startswith("unavailable: sliding")
