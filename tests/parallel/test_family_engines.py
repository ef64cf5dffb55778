"""The whole engine on the families beyond Llama, one rank and TP=2 / PP=2 (gloo, real
processes): greedy tokens equal transformers' generate, and every split run is token-
identical to one rank, through chunked prefill and preemption (a pool of 6 blocks), with
seeded sampling too; no worker is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_parallel import _all_gone, _workers

from family_harness import transformers_greedy
from infire import LLM, SamplingParams
from tiny_models import write_tiny_model

FAMILIES = ["mistral", "qwen3_moe", "mixtral", "gemma3_text", "llama4_text", "deepseek_v3"]
PROMPTS = [
    list(range(20, 57)),
    [11] * 3,
    list(range(1, 60)),
    [(7 * i) % 200 + 1 for i in range(25)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def _run(model: Path, tp: int = 1, pp: int = 1) -> tuple[list[list[int]], int]:
    params = [GREEDY, SEEDED] * 2
    with LLM(str(model), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             max_num_batched_tokens=32, num_blocks=6, block_size=16) as llm:  # fmt: skip
        workers = _workers(llm)
        outs = llm.generate(PROMPTS, params)
        preemptions = llm.engine.stats.num_preemptions
    assert _all_gone(workers)
    return [o.outputs[0].token_ids for o in outs], preemptions


def test_engine_matches_transformers_and_splits_match_one_rank(family_model: Path):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        family_model, dtype=torch.float32
    ).eval()
    tokens, preemptions = _run(family_model)
    assert preemptions > 0  # the pool is too small for all four at once
    for prompt, ours in zip(PROMPTS[::2], tokens[::2], strict=True):  # the greedy ones
        with torch.no_grad():
            assert ours == transformers_greedy(reference, prompt, 12)
    for tp, pp in ((2, 1), (1, 2)):
        assert _run(family_model, tp, pp)[0] == tokens, (tp, pp)
