"""Stop conditions on the real default model: stop strings across token boundaries are
never emitted (not even in part while streaming), stop token ids, EOS, logprobs."""

from __future__ import annotations

from infire import SamplingParams
from infire.engine.engine import LLMEngine

PROMPT = "Once upon a time, in a small village,"


def _greedy(llm, **kw):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)
    return llm.generate(PROMPT, params)[0].outputs[0]


def _stream(engine: LLMEngine, params: SamplingParams) -> list[str]:
    engine.add_request("s", PROMPT, params)
    texts, text = [], ""
    while engine.has_unfinished_requests():
        for delta in engine.step():
            text += "".join(c.text for c in delta.choices)
            texts.append(text)
    return texts


def test_stop_string_spanning_tokens(smollm2_llm):
    full = _greedy(smollm2_llm)
    tokenizer = smollm2_llm.get_tokenizer()
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    boundary = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = full.text[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and full.text.find(stop) == boundary - 2
    out = _greedy(smollm2_llm, stop=[stop])
    assert out.text == full.text[: boundary - 2]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = _greedy(smollm2_llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: boundary + 3]


def test_streamed_text_never_shows_part_of_a_stop_string(smollm2_llm):
    full = _greedy(smollm2_llm)
    stop = full.text[20:26]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    texts = _stream(smollm2_llm.engine, params)
    final = texts[-1]
    assert final == full.text[:20]
    for text in texts:
        assert final.startswith(text) or text.startswith(final)
        assert len(text) <= len(final)


def test_stop_token_ids_and_eos(smollm2_llm):
    full = _greedy(smollm2_llm)
    target = full.token_ids[5]
    out = _greedy(smollm2_llm, stop_token_ids=[target])
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    chat = smollm2_llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64)
    )[0].outputs[0]
    assert chat.finish_reason == "stop"
    assert chat.token_ids[-1] in smollm2_llm.get_tokenizer().eos_token_ids


def test_logprobs_top_alternatives(smollm2_llm):
    out = _greedy(smollm2_llm, logprobs=3)
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(entry) <= 4
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
    assert (
        abs(
            out.cumulative_logprob
            - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
        )
        < 1e-6
    )


def test_penalties_change_greedy_output(smollm2_llm):
    plain = _greedy(smollm2_llm)
    penalized = _greedy(smollm2_llm, repetition_penalty=1.5, frequency_penalty=1.0)
    assert plain.token_ids != penalized.token_ids
    counts = {t: penalized.token_ids.count(t) for t in penalized.token_ids}
    assert max(counts.values()) <= max(plain.token_ids.count(t) for t in plain.token_ids)
