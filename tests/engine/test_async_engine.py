"""AsyncLLMEngine: concurrent streams, abort frees blocks, bad input raises at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from infire import AsyncLLMEngine, SamplingParams
from infire.config import CacheConfig, EngineConfig
from infire.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=128))
    engine = AsyncLLMEngine.from_config(config)
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams, rid: str):
    outputs = [out async for out in engine.generate(prompt, params, rid)]
    return outputs


def test_concurrent_requests_stream_and_match_offline(engine: AsyncLLMEngine):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3, 40 + i] for i in range(6)]

    async def main():
        return await asyncio.gather(
            *(_collect(engine, p, params, f"c{i}") for i, p in enumerate(prompts))
        )

    results = asyncio.run(main())
    for outputs in results:
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[-1] == 10
    solo = asyncio.run(_collect(engine, prompts[3], params, "solo"))
    assert solo[-1].outputs[0].token_ids == results[3][-1].outputs[0].token_ids


def test_abort_and_early_exit_free_blocks(engine: AsyncLLMEngine):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    blocks = engine.engine.block_manager

    async def main():
        seen = 0
        async for out in engine.generate([1, 2, 3], params, "leaver"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                break  # the client went away
        task_outputs = []

        async def consume():
            async for out in engine.generate([4, 5, 6], params, "aborted"):
                task_outputs.append(out)

        task = asyncio.create_task(consume())
        while not task_outputs:
            await asyncio.sleep(0.01)
        await engine.abort("aborted")
        await asyncio.wait_for(task, 5)
        for _ in range(100):
            if blocks.num_free_blocks == blocks.num_blocks:
                break
            await asyncio.sleep(0.01)
        return seen, task_outputs[-1]

    seen, last = asyncio.run(main())
    assert seen >= 3
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not engine.engine.has_unfinished_requests()


def test_invalid_request_raises_before_queueing(engine: AsyncLLMEngine):
    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):
            await _collect(engine, [], SamplingParams(), "bad")
        return await _collect(engine, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), "ok")

    assert asyncio.run(main())[-1].finished
