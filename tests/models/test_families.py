"""Every family beyond Llama against transformers, on tiny random models in float32.

Three prompts (37, 20 and 5 tokens) run through the real scheduler with a 16-token budget,
so prompts prefill in chunks, with and without context in the pool, beside other
sequences' decodes; every sampled row's logits must be within 1e-4 of transformers' at
that position, and 32 greedy tokens per prompt must equal transformers' generate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from family_harness import assert_matches_transformers, prompts_for
from infire.models.loader import load_model
from tiny_models import write_tiny_model

FAMILIES = ["mistral", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "llama4_text", "deepseek_v3"]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    return request.param, folder


def test_logits_and_greedy_tokens_match_transformers(family_model: tuple[str, Path]):
    _, folder = family_model
    vocab = load_model(folder, torch.float32).config.vocab_size
    assert_matches_transformers(folder, prompts_for(vocab), NEW_TOKENS)
