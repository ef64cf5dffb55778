"""Structured outputs in the engine (llguidance): JSON Schema, JSON object, regex and
choice on SmolLM2, greedy and sampled, n > 1, beside unconstrained requests in one batch,
an unsatisfiable grammar ending at max_tokens, and bad grammars refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from infire import LLM, SamplingParams
from infire.errors import InvalidRequestError
from structured_models import Person

# Every string is bounded, so every answer ends within max_tokens whatever is sampled.
SCHEMA = Person.model_json_schema()
CHAT = [{"role": "user", "content": "Describe a fictional person as JSON."}]


def test_json_schema_answers_validate_greedy_and_sampled(smollm2_llm: LLM) -> None:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=200, structured_output={"json": SCHEMA})
              for t, s in ((0.0, None), (0.8, 1), (0.8, 2), (1.0, 3))]  # fmt: skip
    outputs = smollm2_llm.chat([CHAT] * len(params), params)
    for output in outputs:
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        Person.model_validate_json(choice.text)  # raises on any violation


def test_n_samples_each_follow_the_grammar(smollm2_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=200,
                            structured_output={"json": SCHEMA})  # fmt: skip
    [output] = smollm2_llm.chat([CHAT], params)
    assert len(output.outputs) == 3
    texts = [choice.text for choice in output.outputs]
    for text in texts:
        Person.model_validate_json(text)
    assert len(set(texts)) > 1  # three samples, not one copied


def test_json_object_regex_and_choice(smollm2_llm: LLM) -> None:
    ask = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
    objects = smollm2_llm.chat([ask] * 3, [
        SamplingParams(temperature=t, seed=s, max_tokens=150, structured_output={"json_object": True})
        for t, s in ((0.0, None), (0.7, 1), (0.7, 2))])  # fmt: skip
    for output in objects:
        assert isinstance(json.loads(output.outputs[0].text), dict)
    specs = [{"regex": r"[0-9]{3}-[0-9]{4}"}, {"choice": ["yes", "no"]}]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_output=s) for s in specs]
    outputs = smollm2_llm.generate(["Answer:"] * 2, params)
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[0])
    assert texts[1] in ("yes", "no")
    assert all(o.outputs[0].finish_reason == "stop" for o in [*objects, *outputs])


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(smollm2_llm: LLM) -> None:
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = smollm2_llm.generate(prompts, plain)
    constrained = SamplingParams(temperature=0, max_tokens=80, structured_output={"json": SCHEMA})
    mixed = smollm2_llm.generate(["Person:", *prompts, "Another person:"],
                                 [constrained, plain, plain, plain, constrained])  # fmt: skip
    for a, m in zip(alone, mixed[1:4], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    assert mixed[0].outputs[0].finish_reason in ("stop", "length")


def test_the_pool_and_one_thread_fill_the_same_masks(smollm2_llm: LLM) -> None:
    """The GPU path fills a batch's masks on llguidance's pool, the CPU path one row at a
    time: the rows must not depend on which."""
    from infire.engine.structured import advance, disallowed_tokens

    grammars = smollm2_llm.engine.grammars
    specs = [{"json": SCHEMA}, {"regex": r"[0-9]{3}-[0-9]{4}"}, {"choice": ["yes", "no"]}]
    matchers = [grammars.matcher(spec) for spec in specs]
    vocab = smollm2_llm.engine.model_config.vocab_size
    opening = smollm2_llm.get_tokenizer().encode('{"', add_special_tokens=False)
    for token in opening:  # one matcher past its start
        advance(matchers[0], token)
    one, pool = disallowed_tokens(matchers, vocab), disallowed_tokens(matchers, vocab, True)
    assert one.shape == (3, vocab) and torch.equal(one, pool)
    assert int((~one).sum(1).min()) > 0 and int((~one).sum(1).max()) < vocab


def test_a_grammar_unfinished_at_max_tokens_ends_with_length(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, structured_output={"json": SCHEMA})
    [output] = smollm2_llm.chat([CHAT], params)
    choice = output.outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 5
    assert choice.text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"json": "{not json"}, "invalid json"),
        ({"regex": "("}, "unclosed group"),
        ({"choice": []}, "non-empty list"),
        ({"grammar": "start: missing_rule"}, "missing_rule"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ],
)
def test_bad_grammars_are_refused_by_name(smollm2_llm: LLM, spec: dict, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        smollm2_llm.generate(["x"], SamplingParams(structured_output=spec))


def test_preemption_and_chunked_prefill_keep_the_grammar(smollm2_llm: LLM) -> None:
    """A pool too small for four constrained answers at once, and a step budget that cuts
    their prompts in chunks: sequences are preempted and recomputed, and each answer is
    the one it gets alone (the matcher's state survives preemption with the tokens)."""
    asks = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=160, structured_output={"json": SCHEMA})
    alone = [smollm2_llm.chat([ask], params)[0].outputs[0].text for ask in asks]
    small = LLM(dtype="float32", num_blocks=14, max_num_batched_tokens=24,
                enable_prefix_caching=False, quantization="none")  # as smollm2_llm  # fmt: skip
    try:
        together = [o.outputs[0].text for o in small.chat(asks, params)]
        assert small.engine.stats.num_preemptions > 0
    finally:
        small.shutdown()
    assert together == alone
    for text in together:
        Person.model_validate_json(text)
