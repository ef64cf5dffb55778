"""`infire serve` on the default model (SmolLM2-135M-Instruct): the real thing over HTTP."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from harness import Server
from pydantic import BaseModel, Field

from infire import LLM, SamplingParams
from structured_models import Person

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five."]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # dequantized, as the smollm2_llm reference these tests compare it with
    server = Server(["--dtype", "float32", "--kv-cache-memory", "64MiB", "--quantization", "none"],
                    tmp_path_factory.mktemp("smollm2-server") / "server.log")  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_the_server_dequantizes_when_told(smollm2_server: Server):
    """--quantization none reaches the engine process: no GGUF blocks in its ready line."""
    httpx.get(f"{smollm2_server.url}/health")
    ready = re.search(r"ready: .*\(.*CPU kernels (.*)\)", smollm2_server.log.read_text())
    assert ready is not None and ready.group(1) == "active"


def test_health_is_503_until_the_model_is_loaded(smollm2_server: Server):
    assert smollm2_server.not_ready  # loading the GGUF takes seconds; the socket opens at once
    for response in smollm2_server.not_ready:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_loading"
    assert httpx.get(f"{smollm2_server.url}/health").json() == {"status": "ok"}


def test_no_arguments_serve_the_default_catalog(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused")
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct", "all-minilm-l6-v2", "whisper-base"]
    chat, embed, speech = (m.model_extra for m in models)
    assert chat["task"] == "text-generation" and chat["load"]["state"] == "ready"  # pinned
    assert embed["task"] == "text-embeddings" and embed["load"]["state"] == "unloaded"
    assert speech["task"] == "automatic-speech-recognition"
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


PEOPLE = [f"Describe a fictional {job} from {place} as JSON." for job, place in (
    ("baker", "Paris"), ("pilot", "Lagos"), ("nurse", "Lima"), ("painter", "Oslo"),
    ("farmer", "Kyoto"), ("chef", "Rome"), ("teacher", "Austin"), ("diver", "Perth"),
    ("poet", "Dublin"), ("judge", "Delhi"), ("miner", "Quito"), ("tailor", "Cairo"),
    ("singer", "Seoul"), ("coder", "Berlin"), ("sailor", "Lisbon"), ("monk", "Lhasa"),
    ("doctor", "Boston"), ("guide", "Nairobi"), ("barber", "Havana"), ("clerk", "Riga"),
)]  # fmt: skip


def test_openai_parse_validates_across_prompts_and_seeds(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)

    def parse(prompt: str, seed: int) -> Person:
        answer = client.chat.completions.parse(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompt}],
            response_format=Person, temperature=0.8, seed=seed, max_tokens=300,
        )  # fmt: skip
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].message.parsed  # the client validated it with pydantic

    jobs = [(prompt, seed) for prompt in PEOPLE for seed in (1, 2, 3)]
    with ThreadPoolExecutor(8) as pool:  # batched in the engine
        people = list(pool.map(lambda job: parse(*job), jobs))
    assert len(people) == 60 and all(isinstance(p, Person) for p in people)
    assert len({p.model_dump_json() for p in people}) > 30  # sampled, not one answer


def test_structured_output_streams_and_json_object(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)
    schema = {"type": "json_schema", "json_schema": {"name": "Person", "strict": True,
                                                     "schema": Person.model_json_schema()}}  # fmt: skip
    for seed in (1, 2):
        stream = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": PEOPLE[seed]}],
            response_format=schema, temperature=0.8, seed=seed, max_tokens=300, stream=True,
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5
        Person.model_validate_json(text)
    ask = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=ask, response_format={"type": "json_object"},
        temperature=0, max_tokens=150,
    )  # fmt: skip
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_bad_structured_outputs_are_400_naming_the_field(smollm2_server: Server):
    url = f"{smollm2_server.base_url}/chat/completions"
    base = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),
    ):  # fmt: skip
        response = httpx.post(url, json={**base, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, response.text
    regex = httpx.post(url, json={**base, "guided_regex": "[0-9]{3}-[0-9]{4}", "temperature": 0},
                       timeout=30)  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.json()["choices"][0]["message"]["content"])


class Weather(BaseModel):
    model_config = {"extra": "forbid"}
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class Clock(BaseModel):
    model_config = {"extra": "forbid"}
    timezone: str = Field(max_length=32)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                      "parameters": Clock.model_json_schema()}},
]  # fmt: skip
ARGUMENTS = {"get_weather": Weather, "get_time": Clock}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def test_a_two_tool_conversation(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=120,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
    # The next turn carries the call and its result; the model answers in text.
    follow = [*ASK, choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}
        for call in choice.message.tool_calls]  # fmt: skip
    final = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=follow, tools=TOOLS, temperature=0, max_tokens=40,
    )  # fmt: skip
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    # A named function: its arguments, constrained by its schema.
    named = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=ASK, tools=TOOLS, temperature=0.7, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80,
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    Clock.model_validate_json(call.function.arguments)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_reassemble_to_the_same_call(smollm2_server: Server, tool_choice):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)
    kwargs = {"model": "smollm2-135m-instruct", "messages": ASK, "tools": TOOLS,
              "tool_choice": tool_choice, "temperature": 0, "max_tokens": 120}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons, fragments = [], 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function and part.function.name:
                assert call["arguments"] == ""  # the name comes before the arguments
                call["name"] = part.function.name
            if part.function and part.function.arguments:
                call["arguments"] += part.function.arguments
                fragments += 1
    assert reasons[-1] == "tool_calls"
    assert fragments >= 5  # the arguments streamed as they were generated
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole]  # fmt: skip
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_calls_with_n_2_whole_and_streamed(smollm2_server: Server):
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)
    kwargs = {"model": "smollm2-135m-instruct", "messages": ASK, "tools": TOOLS, "n": 2,
              "tool_choice": "required", "temperature": 0.8, "seed": 3, "max_tokens": 120}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices
    assert [c.index for c in whole] == [0, 1]
    for choice in whole:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
    calls: dict[tuple[int, int], dict] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault((choice.index, part.index), {"name": None, "arguments": ""})
                call["name"] = (part.function.name if part.function else None) or call["name"]
                call["arguments"] += (part.function.arguments if part.function else None) or ""
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    assert {i for i, _ in calls} == {0, 1}
    for call in calls.values():
        ARGUMENTS[call["name"]].model_validate_json(call["arguments"])


def test_with_tools_a_text_answer_streams_as_content(smollm2_server: Server):
    """tool_choice auto: SmolLM2 answers this in text, which streams as it is generated
    (only an answer that opens like a call is held), the same text as the whole answer."""
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Write one sentence about the sea."}]
    kwargs = {"model": "smollm2-135m-instruct", "messages": ask, "tools": TOOLS,
              "temperature": 0, "max_tokens": 30}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    pieces = [
        c.choices[0].delta.content for c in client.chat.completions.create(**kwargs, stream=True)
    ]
    pieces = [p for p in pieces if p]
    assert len(pieces) >= 5 and "".join(pieces) == whole.message.content


def test_workers_ai_streams_tool_calls(smollm2_server: Server):
    flat = [t["function"] for t in TOOLS]
    body = {"messages": ASK, "tools": flat, "tool_choice": "required", "temperature": 0,
            "stream": True}  # fmt: skip
    url = f"{smollm2_server.url}/ai/run/smollm2-135m-instruct"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    [calls] = [e["tool_calls"] for e in events if "tool_calls" in e]
    assert calls and all(ARGUMENTS[c["name"]].model_validate(c["arguments"]) for c in calls)
    assert "usage" in events[-1] and not any(e["response"] for e in events)


def test_workers_ai_tools_and_bad_tools(smollm2_server: Server):
    flat = [t["function"] for t in TOOLS]  # Workers AI's own form
    body = {"messages": ASK, "tools": flat, "tool_choice": "required", "temperature": 0}
    response = httpx.post(f"{smollm2_server.url}/ai/run/@cf/huggingface/smollm2-135m-instruct",
                          json=body, timeout=60)  # fmt: skip
    calls = response.json()["result"]["tool_calls"]
    assert calls and all(ARGUMENTS[c["name"]].model_validate(c["arguments"]) for c in calls)
    schema = {"type": "json_schema", "json_schema": {"schema": Weather.model_json_schema()}}
    body = {"messages": ASK, "response_format": schema, "temperature": 0}
    response = httpx.post(f"{smollm2_server.url}/ai/run/smollm2-135m-instruct", json=body,
                          timeout=60)  # fmt: skip
    Weather.model_validate_json(response.json()["result"]["response"])
    url = f"{smollm2_server.base_url}/chat/completions"
    base = {"model": "smollm2-135m-instruct", "messages": ASK}
    for extra, param in (
        ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ):  # fmt: skip
        response = httpx.post(url, json={**base, **extra}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (
            response.text
        )


def test_a_slow_grammar_does_not_hold_up_other_requests(smollm2_server: Server):
    """A 50,000-value enum takes llguidance about 0.4 s to compile, at the edge and again
    in the engine core: both off their loops, so a plain request sent after it is
    answered first. A grammar over llguidance's limits is a 400 naming the limit."""
    url = f"{smollm2_server.base_url}/completions"
    values = [f"value_{i}_abc" for i in range(50000)]
    slow_schema = {"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]}
    done: dict[str, float] = {}

    def slow() -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": "x:", "max_tokens": 20,
                "temperature": 0, "guided_json": slow_schema}  # fmt: skip
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        json.loads(response.json()["choices"][0]["text"])
        done["slow"] = time.monotonic()

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.05)  # the slow request is in
    plain = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json=plain, timeout=60).status_code == 200
    done["plain"] = time.monotonic()
    thread.join(120)
    assert done["plain"] < done["slow"]
    many = [f"value_{i}_abc" for i in range(150000)]
    too_big = {"type": "object", "properties": {"x": {"enum": many}}}
    body = {"model": "smollm2-135m-instruct", "prompt": "x:", "guided_json": too_big}
    response = httpx.post(url, json=body, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_json"
    assert "too big" in response.json()["error"]["message"]
