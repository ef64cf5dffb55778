"""The balancer over a real prefill and decode worker (KV through Mooncake over TCP):
answers token for token equal to a colocated server's, through the `openai` client, streamed
and whole, chat, completions and Workers AI; the decode side's prefix cache; refusals."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from cluster import KV_SECRET
from harness import TINY_NAME, sse_events

from infire.disagg.transfer import sign

SYSTEM = "You are a terse assistant. " * 12  # long enough to fill several KV blocks


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _chat(server, content: str, stream: bool, **extra: object) -> tuple[str, list[str], str]:
    """Text, token strings and finish reason of one chat completion."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    kwargs = dict(model=TINY_NAME, messages=messages, max_tokens=12, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True}, **extra)  # fmt: skip
    if not stream:
        choice = _client(server).chat.completions.create(**kwargs).choices[0]
        return (
            choice.message.content,
            [t.token for t in choice.logprobs.content],
            choice.finish_reason,
        )
    text, tokens, reason = "", [], None
    for chunk in _client(server).chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else [])]
            reason = choice.finish_reason or reason
    return text, tokens, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chat_through_the_balancer_equals_colocated(cluster, stream: bool, sampling: str) -> None:
    extra = {"temperature": 0} if sampling == "greedy" else {"temperature": 0.9, "seed": 1234}
    for i, content in enumerate(["Say hello.", "Count to five.", "Name a colour."]):
        expected = _chat(cluster["both"], content, stream, **extra)
        got = _chat(cluster["balancer"], content, stream, **extra)
        assert got == expected, i
        assert len(got[1]) == 12 and got[2] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_through_the_balancer_equals_colocated(cluster, stream: bool) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    extra = {"temperature": 0.9, "seed": 7, "extra_body": {"guided_json": schema}}
    kwargs = dict(model=TINY_NAME, messages=[{"role": "user", "content": "JSON please"}],
                  max_tokens=40, stream=stream, **extra)  # fmt: skip
    answers = []
    for name in ("both", "balancer"):
        response = _client(cluster[name]).chat.completions.create(**kwargs)
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = response.choices[0].message.content
        answers.append(text)
    assert answers[0] == answers[1]
    parsed = json.loads(answers[1])
    assert isinstance(parsed["a"], int) and parsed["b"] in ("x", "y") and len(parsed) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_and_workers_ai_through_the_balancer(cluster, stream: bool) -> None:
    body = {"model": TINY_NAME, "prompt": "The quick brown fox", "max_tokens": 9,
            "temperature": 0.7, "seed": 5, "ignore_eos": True, "stream": stream}  # fmt: skip
    ai = {"prompt": "Tell me a story", "max_tokens": 7, "seed": 9, "stream": stream}
    for path, payload in (("/v1/completions", body), (f"/ai/run/{TINY_NAME}", ai)):
        answers = []
        for server in (cluster["both"], cluster["balancer"]):
            reply = httpx.post(f"{server.url}{path}", json=payload, timeout=60)
            assert reply.status_code == 200, reply.text
            if stream:
                events = sse_events(reply)
                assert events[-1] == "[DONE]"
                answers.append("".join(e["choices"][0]["text"] if "choices" in e else
                                       e.get("response", "") for e in events[:-1]))  # fmt: skip
            else:
                data = reply.json()
                answers.append(data["choices"][0]["text"] if "choices" in data else
                               data["result"]["response"])  # fmt: skip
        assert answers[0] == answers[1] and answers[0], path


def _metric(server, name: str) -> float:
    """A sample of the balancer's /metrics, summed over its labels."""
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.split("{")[0].split(" ")[0] == name)


def _load(server) -> dict:
    return httpx.get(f"{server.url}/load", timeout=10).json()


def test_decode_prefix_cache_pulls_fewer_blocks(cluster) -> None:
    decode, balancer = cluster["decode"], cluster["balancer"]
    headers = {"x-session-affinity": "conversation-7"}
    system = "Remember this list: " + ", ".join(f"item {i}" for i in range(60))
    blocks = []
    hits = _metric(balancer, "infire_balance:affinity_hits_total")
    for question in ("What is item 3?", "What is item 4?"):
        before = _load(decode)
        reply = httpx.post(f"{balancer.base_url}/chat/completions", headers=headers, timeout=60,
                           json={"model": TINY_NAME, "max_tokens": 4, "messages": [
                               {"role": "system", "content": system},
                               {"role": "user", "content": question}]})  # fmt: skip
        assert reply.status_code == 200, reply.text
        after = _load(decode)
        blocks.append((after["kv_blocks_pulled"] - before["kv_blocks_pulled"],
                       after["kv_blocks_reused"] - before["kv_blocks_reused"]))  # fmt: skip
    (first_pulled, first_reused), (second_pulled, second_reused) = blocks
    assert first_pulled >= 10 and first_reused == 0
    assert second_reused >= 10 and second_pulled < first_pulled / 3
    assert _metric(balancer, "infire_balance:affinity_hits_total") == hits + 1
    for _ in range(50):  # the decode worker's counter, as the balancer polls it (every 0.2 s)
        if _metric(balancer, "infire_balance:worker_kv_blocks_reused_total") >= second_reused:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the balancer's metrics do not show the reused blocks")


def test_everything_is_released_after_the_requests(cluster) -> None:
    for role in ("prefill", "decode"):
        load = _load(cluster[role])
        assert load["num_leases"] == 0 and load["num_pulling"] == 0
        assert load["num_running"] == 0 and load["kv_leases_expired"] == 0
    assert _load(cluster["prefill"])["kv_leases_released"] >= 10
    streams = _metric(cluster["balancer"], "infire_balance:time_to_first_token_seconds_count")
    assert streams >= 8  # the streamed chat and completions requests above were timed


def test_workers_refuse_legs_that_are_not_theirs(cluster) -> None:
    body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 3}
    fake = {"first": {"token": 5}, "lease": "x", "engine": "e", "bases": [], "block_ids": [],
            "checksums": [], "num_tokens": 1, "prompt_hash": ""}  # fmt: skip
    other_layout = sign(fake | {"layout": "block_size=8 dtype=float32 planes=4 bytes=0"},
                        KV_SECRET)  # a prefill worker of the deployment, laid out otherwise  # fmt: skip
    for role, extra, needle in (
        ("prefill", {}, "--role prefill"),
        ("decode", {}, "--role decode"),
        ("both", {"kv_transfer_params": {"do_remote_decode": True}}, "--role both"),
        ("prefill", {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream"),
        ("decode", {"kv_transfer_params": fake | {"signature": "0" * 64}}, "not signed"),
        ("decode", {"kv_transfer_params": other_layout}, "heterogeneous"),
    ):
        reply = httpx.post(f"{cluster[role].base_url}/completions", json=body | extra, timeout=30)
        assert reply.status_code == 400, (role, reply.text)
        assert needle in reply.json()["error"]["message"]


def test_forged_handle_is_refused_and_n_over_1_needs_a_colocated_worker(cluster) -> None:
    body = {"model": TINY_NAME, "prompt": "hello there", "max_tokens": 3}
    leg = httpx.post(f"{cluster['prefill'].base_url}/completions", timeout=30,
                     json=body | {"kv_transfer_params": {"do_remote_decode": True}}).json()  # fmt: skip
    handle = leg["kv_transfer_params"]
    assert len(handle["signature"]) == 64
    forged = handle | {"engine": "127.0.0.1:1"}  # a pull from somewhere else
    reply = httpx.post(f"{cluster['decode'].base_url}/completions", timeout=30,
                       json=body | {"kv_transfer_params": forged})  # fmt: skip
    assert reply.status_code == 400 and "not signed" in reply.json()["error"]["message"]
    httpx.post(f"{cluster['prefill'].url}/kv/release", json={"lease": handle["lease"]})
    many = httpx.post(f"{cluster['balancer'].base_url}/completions", json=body | {"n": 2})
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
