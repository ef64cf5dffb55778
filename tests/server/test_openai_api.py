"""The OpenAI API of `infire serve` on a tiny model, through the real `openai` client and httpx.

Every answer is compared with the engine run in-process on the same model (float32,
greedy or seeded): the server must add nothing and lose nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from harness import TINY_NAME, Server, sse_events

from infire import LLM, SamplingParams

MESSAGES = [{"role": "user", "content": "the cat sat on"}]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_blocks=256)


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.base_url, api_key="unused")


def test_models_lists_the_served_model(client: openai.OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY_NAME]
    assert models[0].object == "model" and models[0].max_model_len == 256


def test_health(tiny_server: Server):
    response = httpx.get(f"{tiny_server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_chat_completion_equals_the_engine(client: openai.OpenAI, reference: LLM):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0]
    answer = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, temperature=0, max_tokens=12
    )
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == ("length" if expected.outputs[0].finish_reason == "length"
                                    else "stop")  # fmt: skip
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_max_completion_tokens_and_length_finish(client: openai.OpenAI):
    answer = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, temperature=0, max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.usage.completion_tokens == 5
    assert answer.choices[0].finish_reason == "length"


def test_chat_stream_chunks_and_usage(tiny_server: Server, reference: LLM):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10))[0]
    body = {"model": TINY_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 10,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{tiny_server.base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == TINY_NAME for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, last = chunks
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == len(expected.outputs[0].token_ids)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
    assert text == expected.outputs[0].text
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI, reference: LLM):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0]
    stream = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, temperature=0, max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text


def test_text_completion_from_text_and_from_token_ids(client: openai.OpenAI, reference: LLM):
    expected = reference.generate("the cat", SamplingParams(temperature=0, max_tokens=9))[0]
    answer = client.completions.create(model=TINY_NAME, prompt="the cat", temperature=0,
                                       max_tokens=9)  # fmt: skip
    assert answer.object == "text_completion"
    assert answer.choices[0].text == expected.outputs[0].text
    by_ids = client.completions.create(
        model=TINY_NAME, prompt=expected.prompt_token_ids, temperature=0, max_tokens=9
    )
    assert by_ids.choices[0].text == expected.outputs[0].text
    streamed = client.completions.create(
        model=TINY_NAME, prompt="the cat", temperature=0, max_tokens=9, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.outputs[0].text


def test_text_completion_default_max_tokens_is_16(client: openai.OpenAI):
    answer = client.completions.create(model=TINY_NAME, prompt="a", temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert answer.usage.completion_tokens == 16


def test_n2_seeded_equals_the_engine_and_repeats(client: openai.OpenAI, reference: LLM):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    expected = reference.generate("once upon", params)[0]
    request = dict(model=TINY_NAME, prompt="once upon", n=2, temperature=1.0, seed=7,
                   max_tokens=10, extra_body={"ignore_eos": True})  # fmt: skip
    first = client.completions.create(**request)
    second = client.completions.create(**request)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [o.text for o in expected.outputs]
    assert [c.text for c in sorted(second.choices, key=lambda c: c.index)] == texts
    assert texts[0] != texts[1]  # each choice samples its own stream
    assert first.usage.completion_tokens == 20


def test_seeded_stream_equals_non_stream_with_n2(client: openai.OpenAI):
    request = dict(model=TINY_NAME, messages=MESSAGES, n=2, temperature=0.8, seed=3,
                   max_tokens=8)  # fmt: skip
    whole = client.chat.completions.create(**request)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_chat_logprobs_equal_the_engine(client: openai.OpenAI, reference: LLM):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[
        0
    ].outputs[0]
    answer = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = answer.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, step, token in zip(content, expected.logprobs, expected.token_ids, strict=True):
        sampled = step[token]
        assert entry.token == sampled.decoded_token
        assert entry.logprob == pytest.approx(sampled.logprob, abs=1e-5)
        assert entry.bytes == list(sampled.decoded_token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: top-1
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_text_logprobs_equal_the_engine(client: openai.OpenAI, reference: LLM):
    expected = reference.generate("the", SamplingParams(temperature=0, max_tokens=4, logprobs=2))[
        0
    ].outputs[0]
    answer = client.completions.create(model=TINY_NAME, prompt="the", temperature=0,
                                       max_tokens=4, logprobs=2)  # fmt: skip
    logprobs = answer.choices[0].logprobs
    sampled = [step[t] for step, t in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert logprobs.tokens == [s.decoded_token for s in sampled]
    assert logprobs.token_logprobs == pytest.approx([s.logprob for s in sampled], abs=1e-5)
    offsets = [sum(len(s.decoded_token) for s in sampled[:i]) for i in range(len(sampled))]
    assert logprobs.text_offset == offsets
    for top, step in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        best = sorted((e for e in step.values() if e.rank <= 2), key=lambda e: e.rank)
        assert top == pytest.approx({e.decoded_token: e.logprob for e in best}, abs=1e-5)


def test_metrics_move_after_requests(tiny_server: Server, client: openai.OpenAI):
    before = tiny_server.metrics()
    answer = client.completions.create(model=TINY_NAME, prompt="metrics please", temperature=0,
                                       max_tokens=3, extra_body={"ignore_eos": True})  # fmt: skip
    after = tiny_server.metrics()
    prompt = answer.usage.prompt_tokens
    assert after["infire:prompt_tokens_total"] - before["infire:prompt_tokens_total"] == prompt
    assert after["infire:generation_tokens_total"] - before["infire:generation_tokens_total"] == 3
    assert after["infire:request_success_total"] == before["infire:request_success_total"] + 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):  # fmt: skip
        count = f"infire:{name}_count"
        assert after[count] == before[count] + 1
    assert after["infire:inter_token_latency_seconds_count"] >= before.get(
        "infire:inter_token_latency_seconds_count", 0) + 2  # fmt: skip
    assert after["infire:num_requests_running"] == 0
    assert after["infire:kv_cache_usage_perc"] == 0
    # The same prompt again is served from the prefix cache (its full blocks).
    client.completions.create(model=TINY_NAME, prompt="metrics please", max_tokens=1)
    again = tiny_server.metrics()
    assert again["infire:prefix_cache_queries_total"] > after["infire:prefix_cache_queries_total"]


def test_cached_tokens_are_reported(client: openai.OpenAI):
    prompt = "a long shared prefix " * 6  # more than two 16-token blocks
    client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=1)
    answer = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=1)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < answer.usage.prompt_tokens


def test_50_concurrent_streams_complete_exactly(tiny_server: Server, reference: LLM):
    prompts = [f"request number {i}" for i in range(50)]
    lengths = [3 + i % 17 for i in range(50)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [o.outputs[0].text for o in reference.generate(prompts, params)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=TINY_NAME, prompt=prompt, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def bad(http: httpx.AsyncClient) -> int:
        response = await http.post(f"{tiny_server.base_url}/completions", content=b"{oops")
        return response.status_code

    async def main() -> tuple[list, list]:
        client = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key="unused")
        async with httpx.AsyncClient() as http:
            good = asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )
            bads = asyncio.gather(*(bad(http) for _ in range(5)))
            return await asyncio.gather(good, bads)

    results, statuses = asyncio.run(main())
    assert statuses == [400] * 5
    assert [count for _, count in results] == lengths
    assert [text for text, _ in results] == expected


def test_penalties_and_extras_reach_the_sampler(client: openai.OpenAI, reference: LLM):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, top_k=20, min_p=0.02,
                            presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
                            ignore_eos=True)  # fmt: skip
    expected = reference.generate("a b a b a b", params)[0].outputs[0].text
    answer = client.completions.create(
        model=TINY_NAME, prompt="a b a b a b", temperature=0.9, seed=11, max_tokens=12,
        presence_penalty=0.8, frequency_penalty=0.5, user="someone",
        extra_body={"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.3, "ignore_eos": True},
    )  # fmt: skip
    assert answer.choices[0].text == expected
    plain = reference.generate("a b a b a b", SamplingParams(temperature=0.9, seed=11,
                                                              max_tokens=12, ignore_eos=True))  # fmt: skip
    assert plain[0].outputs[0].text != expected  # the penalties changed the tokens


def test_access_log_carries_the_session_affinity(tiny_server: Server):
    response = httpx.get(f"{tiny_server.base_url}/models", headers={"x-session-affinity": "s-42"})
    assert response.status_code == 200
    deadline = time.monotonic() + 5  # the line is written once the response has gone out
    while time.monotonic() < deadline:
        lines = [json.loads(line.split("infire.access ", 1)[1])
                 for line in tiny_server.log.read_text().splitlines()
                 if "infire.access" in line]  # fmt: skip
        tagged = [line for line in lines if line["session_affinity"] == "s-42"]
        if tagged:
            break
        time.sleep(0.05)
    [line] = tagged
    assert {"method": "GET", "path": "/v1/models", "status": 200,
            "client": "127.0.0.1"}.items() <= line.items()  # fmt: skip
    assert line["duration_ms"] >= 0


def test_logit_bias_over_http(client: openai.OpenAI, reference: LLM):
    expected = reference.generate(
        "the cat", SamplingParams(temperature=0, max_tokens=4, logit_bias={66: 100})
    )[0]
    answer = client.completions.create(model=TINY_NAME, prompt="the cat", temperature=0,
                                       max_tokens=4, logit_bias={"66": 100})  # fmt: skip
    assert answer.choices[0].text == expected.outputs[0].text == "c" * 4
