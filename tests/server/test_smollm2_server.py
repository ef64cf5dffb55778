"""`infire serve` on the default model (SmolLM2-135M-Instruct): the real thing over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from harness import Server

from infire import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five."]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(["--dtype", "float32", "--kv-cache-memory", "64MiB"],
                    tmp_path_factory.mktemp("smollm2-server") / "server.log")  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_health_is_503_until_the_model_is_loaded(smollm2_server: Server):
    assert smollm2_server.not_ready  # loading the GGUF takes seconds; the socket opens at once
    for response in smollm2_server.not_ready:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_loading"
    assert httpx.get(f"{smollm2_server.url}/health").json() == {"status": "ok"}


def test_no_arguments_serve_the_default_catalog(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused")
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct", "all-minilm-l6-v2"]
    chat, embed = (m.model_extra for m in models)
    assert chat["task"] == "text-generation" and chat["load"]["state"] == "ready"  # pinned
    assert embed["task"] == "text-embeddings" and embed["load"]["state"] == "unloaded"
    # The name the default model had when it was served alone still names it.
    answer = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi",
                                       max_tokens=2)  # fmt: skip
    assert answer.model == "smollm2-135m-instruct"
    vectors = client.embeddings.create(model="@cf/sentence-transformers/all-minilm-l6-v2",
                                       input="hello")  # fmt: skip
    assert len(vectors.data[0].embedding) == 384


def test_greedy_chat_equals_the_engine(smollm2_server: Server, smollm2_llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = smollm2_llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused")
    for question, reference in zip(QUESTIONS, expected, strict=True):
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
            temperature=0, max_tokens=24,
        )  # fmt: skip
        assert answer.choices[0].message.content == reference.outputs[0].text


def test_stop_string_over_http(smollm2_server: Server, smollm2_llm: LLM):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    text = full.outputs[0].text
    stop = text.split()[3]  # a word in the middle of the answer
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused")
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=24,
        stop=["<never>", stop],
    )  # fmt: skip
    assert answer.choices[0].message.content == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=24,
        stop=stop, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[: text.index(stop)]


def test_workers_ai_alias_of_the_default_model(smollm2_server: Server, smollm2_llm: LLM):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    expected = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    response = httpx.post(
        f"{smollm2_server.url}/ai/run/@cf/huggingface/smollm2-135m-instruct",
        json={"messages": messages, "temperature": 0, "max_tokens": 16}, timeout=60,
    )  # fmt: skip
    assert response.status_code == 200
    assert response.json()["result"]["response"] == expected.outputs[0].text
