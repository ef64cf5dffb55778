"""The default model end to end: greedy continuations token-identical to transformers."""

from __future__ import annotations

import torch

from family_harness import transformers_greedy
from infire import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


def test_greedy_continuations_match_transformers(smollm2_llm, smollm2_reference):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = smollm2_llm.generate(PROMPTS, params)
    for out in outputs:
        with torch.no_grad():
            expected = transformers_greedy(smollm2_reference, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, out.prompt
