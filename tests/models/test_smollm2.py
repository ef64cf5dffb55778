"""The default model end to end: greedy continuations token-identical to transformers."""

from __future__ import annotations

import torch

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
        expected = _reference_greedy(smollm2_reference, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, out.prompt


def _reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache (its generate() would stop or
    suppress EOS; we want the raw argmax chain, EOS included, like ignore_eos)."""
    tokens, past, inputs = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            out = model(inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            inputs = torch.tensor([[tokens[-1]]])
    return tokens


def test_chat_answer_is_sensible(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
