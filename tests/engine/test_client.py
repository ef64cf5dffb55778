"""EngineClient, in a thread and in its own process: concurrent streams of deltas, abort
and early exit free every block, bad input raises before anything is queued, a killed
engine core fails open streams at once, and no process is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from infire import LLM, GenerateRequest, InprocEngineClient, MPEngineClient, SamplingParams
from infire.config import CacheConfig, EngineConfig
from infire.engine import EngineClient, merge_delta
from infire.errors import EngineDeadError, InvalidRequestError, ModelLoadError


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(num_blocks=128))


@pytest.fixture(scope="module", params=["inproc", "mp"])
def client(request: pytest.FixtureRequest, tiny_llama: Path):
    if request.param == "inproc":
        client = InprocEngineClient.from_config(_config(tiny_llama))
    else:
        client = MPEngineClient.start(_config(tiny_llama), timeout=120)
    yield client
    client.shutdown()
    if isinstance(client, MPEngineClient):
        assert client.process.poll() is not None


async def _collect(client: EngineClient, prompt: list[int], params: SamplingParams, rid: str):
    return [d async for d in client.generate(GenerateRequest(rid, prompt, params))]


async def _idle(client: EngineClient) -> bool:
    for _ in range(200):
        stats = client.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_concurrent_streams_of_deltas_match_offline(client: EngineClient, tiny_llama: Path):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3, 40 + i] for i in range(6)]

    async def main():
        return await asyncio.gather(
            *(_collect(client, p, params, f"c{i}") for i, p in enumerate(prompts))
        )

    results = asyncio.run(main())
    offline = LLM(str(tiny_llama), dtype="float32", num_blocks=64).generate(prompts, params)
    for deltas, expected in zip(results, offline, strict=True):
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        # Deltas carry only what is new: their concatenation is the whole output.
        tokens = [t for d in deltas for c in d.choices for t in c.token_ids]
        assert tokens == expected.outputs[0].token_ids
        assert "".join(c.text for d in deltas for c in d.choices) == expected.outputs[0].text
        assert deltas[-1].choices[-1].finish_reason == "length"
        assert deltas[-1].metrics is not None and deltas[-1].metrics.finished_time is not None
        merged = None
        for d in deltas:
            merged = merge_delta(merged, d)
        assert merged.outputs[0].token_ids == expected.outputs[0].token_ids


def test_n_and_logprobs_cross_as_deltas(client: EngineClient):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    deltas = asyncio.run(_collect(client, [5, 6, 7], params, "n2"))
    merged = None
    for d in deltas:
        merged = merge_delta(merged, d)
    assert [c.index for c in merged.outputs] == [0, 1]
    for choice in merged.outputs:
        assert len(choice.token_ids) == 6 and len(choice.logprobs) == 6
        assert [next(iter(step)) for step in choice.logprobs] == choice.token_ids
        assert choice.finish_reason == "length"


def test_abort_and_early_exit_free_blocks(client: EngineClient):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        seen = 0
        async for delta in client.generate(GenerateRequest("leaver", [1, 2, 3], params)):
            seen += sum(len(c.token_ids) for c in delta.choices)
            if seen >= 3:
                break  # the client went away
        received = []

        async def consume():
            async for delta in client.generate(GenerateRequest("aborted", [4, 5, 6], params)):
                received.append(delta)

        task = asyncio.create_task(consume())
        while not received:
            await asyncio.sleep(0.01)
        await client.abort("aborted")
        await asyncio.wait_for(task, 5)
        return seen, received[-1], await _idle(client)

    seen, last, idle = asyncio.run(main())
    assert seen >= 3
    assert last.finished and last.choices[-1].finish_reason == "abort"
    assert idle, client.stats()


def test_invalid_request_raises_before_queueing(client: EngineClient):
    before = client.stats().num_prompt_tokens

    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):
            client.generate(GenerateRequest("bad", [], SamplingParams()))
        with pytest.raises(InvalidRequestError, match="token ids must be in"):
            client.generate(GenerateRequest("bad", [10**6], SamplingParams()))
        bias = SamplingParams(logit_bias={10**6: 1.0})
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            client.generate(GenerateRequest("bad", [1], bias))
        ok = SamplingParams(max_tokens=3, ignore_eos=True)
        return await _collect(client, [1, 2], ok, "ok")

    assert asyncio.run(main())[-1].finished
    assert client.stats().num_prompt_tokens == before + 2


def test_a_grammar_the_core_cannot_compile_fails_as_the_requests_fault(client: EngineClient):
    """The server compiles a grammar before it queues the request; a client used without
    that check still gets an InvalidRequestError (a 400), not an engine failure."""
    bad = SamplingParams(max_tokens=3, structured_output={"regex": "("})

    async def main():
        with pytest.raises(InvalidRequestError, match="regex"):
            await _collect(client, [1, 2], bad, "bad-grammar")
        return await _idle(client)

    assert asyncio.run(main())


def test_a_failed_start_names_the_cause(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        MPEngineClient.start(EngineConfig(model=str(tmp_path / "missing")), timeout=120)


def test_killed_core_fails_open_streams_at_once(tiny_long: Path):
    client = MPEngineClient.start(_config(tiny_long), timeout=120)
    dead: list[str] = []
    client.on_dead(dead.append)
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def main():
        received = []

        async def consume(rid: str):
            async for delta in client.generate(GenerateRequest(rid, [1, 2, 3], params)):
                received.append(delta)

        tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(3)]
        while len(received) < 6:
            await asyncio.sleep(0.01)
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - start

    try:
        results, elapsed = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < 5
        assert not client.is_healthy and dead and "exited with -9" in dead[0]
        with pytest.raises(EngineDeadError):
            client.generate(GenerateRequest("late", [1], SamplingParams()))
    finally:
        client.shutdown()
    assert client.process.poll() == -signal.SIGKILL
