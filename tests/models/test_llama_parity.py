"""Logit parity with transformers on tiny random Llama and Qwen2 models (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from infire.config import CacheConfig
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner
from infire.engine.scheduler import ScheduledSequence
from infire.models.loader import load_model
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer
from tiny_models import write_tiny_model

DECODE_STEPS = 16


def _runner_and_seq(folder: Path, prompt: list[int]) -> tuple[ModelRunner, BlockManager, Sequence]:
    loaded = load_model(folder, torch.float32)
    runner = ModelRunner(loaded.config, loaded.weights, CacheConfig(num_blocks=64), torch.float32)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence(
        seq_id=0, request_id="r", index=0, prompt_token_ids=prompt,
        params=SamplingParams(temperature=0), metrics=RequestMetrics(0.0),
        detokenizer=IncrementalDetokenizer(loaded.tokenizer),
    )  # fmt: skip
    return runner, blocks, seq


def _last_logits(runner: ModelRunner, blocks: BlockManager, seq: Sequence, n: int) -> torch.Tensor:
    """Run the next n tokens of seq through our model; logits of the last one."""
    assert blocks.allocate(seq, seq.num_computed_tokens + n)
    with torch.inference_mode():
        ids, pos, meta = runner._prepare_inputs([ScheduledSequence(seq, n)])
        hidden = runner.model(ids, pos, runner.kv_cache, meta)
        logits = runner.model.compute_logits(hidden[-1:])[0]
    seq.num_computed_tokens += n
    return logits


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_prefill_and_decode_logits_match_transformers(fixture: str, request: pytest.FixtureRequest):
    folder = request.getfixturevalue(fixture)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference.eval()
    prompt = torch.randint(
        0, reference.config.vocab_size, (37,), generator=torch.Generator().manual_seed(3)
    )
    runner, blocks, seq = _runner_and_seq(folder, prompt.tolist())

    ours = _last_logits(runner, blocks, seq, len(prompt))
    with torch.no_grad():
        out = reference(prompt.unsqueeze(0), use_cache=True)
    theirs, past = out.logits[0, -1], out.past_key_values
    assert (ours - theirs).abs().max().item() < 1e-4

    for _ in range(DECODE_STEPS):
        token = int(theirs.argmax())
        seq.token_ids.append(token)
        ours = _last_logits(runner, blocks, seq, 1)
        with torch.no_grad():
            out = reference(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        assert (ours - theirs).abs().max().item() < 1e-4


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path):
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }  # fmt: skip
    folder = write_tiny_model(
        tmp_path / "llama3", "llama", seed=5, rope_scaling=scaling, rope_theta=500000.0
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    prompt = list(range(3, 103))
    runner, blocks, seq = _runner_and_seq(folder, prompt)
    assert runner.config.rope_scaling is not None
    ours = _last_logits(runner, blocks, seq, len(prompt))
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1]
    assert (ours - theirs).abs().max().item() < 1e-4
