"""logit_bias (OpenAI's): added to a token's logit before sampling, greedy included."""

from __future__ import annotations

from pathlib import Path

import pytest

from infire import LLM, SamplingParams
from infire.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_blocks=64)


def test_bias_forces_and_bans_tokens(llm: LLM):
    plain = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=6))[0]
    first = plain.outputs[0].token_ids[0]
    banned = llm.generate(
        "the cat", SamplingParams(temperature=0, max_tokens=6, logit_bias={first: -100})
    )[0]
    assert banned.outputs[0].token_ids[0] != first
    assert first not in banned.outputs[0].token_ids
    forced = llm.generate(
        ["the cat", "a dog"],
        [SamplingParams(temperature=0.8, seed=1, max_tokens=5, logit_bias={65: 100}),
         SamplingParams(temperature=0, max_tokens=5)],
    )  # fmt: skip
    assert forced[0].outputs[0].token_ids == [65] * 5
    alone = llm.generate("a dog", SamplingParams(temperature=0, max_tokens=5))[0]
    assert forced[1].outputs[0].token_ids == alone.outputs[0].token_ids  # its row is untouched


@pytest.mark.parametrize(
    "bias", [{5: 101.0}, {5: -100.5}, {-1: 1.0}, {10**6: 1.0}], ids=["high", "low", "neg", "big"]
)
def test_bad_bias_is_refused(llm: LLM, bias: dict):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("x", SamplingParams(max_tokens=1, logit_bias=bias))
    assert error.value.param == "logit_bias"
    assert not llm.engine.has_unfinished_requests()
