"""Greedy outputs of two arithmetics of one model (GGUF blocks against the file
dequantized, one rank against tensor-parallel ranks) compared prompt by prompt: equal, or
parting only where the reference's top two log-probabilities were within a tolerance."""

from __future__ import annotations

# Where the blocks path and the dequantized path may pick different greedy tokens: the
# reference's top two log-probabilities within this of each other. The blocks path
# multiplies int8-quantized activations, as llama.cpp does: on SmolLM2's Q4_1 file the
# first token's log-probabilities differ from the dequantized float32 path's by up to
# 0.46 (llama.cpp's own, on the same file: up to 0.44; docs/gguf.md).
TOP2_TOLERANCE = 1.0


def compare_greedy(got: list, want: list, tolerance: float = TOP2_TOLERANCE) -> list[str]:
    """Per prompt: "same", or where the tokens part and why that is allowed (asserted).
    `got` and `want` are CompletionOutputs; `want`'s were sampled with logprobs >= 2."""
    verdicts = []
    for i, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        if ours.token_ids == theirs.token_ids:
            verdicts.append("same")
            continue
        step = next(
            j
            for j, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True))
            if a != b
        )
        top = sorted((entry.logprob for entry in theirs.logprobs[step].values()), reverse=True)
        gap = top[0] - top[1]
        assert gap <= tolerance, f"prompt {i} parts at step {step}, top-2 gap {gap:.3f}"
        verdicts.append(f"parts at step {step} (top-2 gap {gap:.3f})")
    return verdicts
