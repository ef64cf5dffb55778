"""Engine processes started ahead of need (link.SparePool): a spare becomes the encoder
(or engine core) it is told to run, answers as a freshly started one does, and an
unused spare exits at once when closed."""

from __future__ import annotations

import asyncio
import time

import torch

from infire.engine.encoder import MPEncoderClient
from infire.engine.link import SparePool
from tiny_models import MINILM

TEXTS = ["the cat sat on the mat", "spare processes skip the imports"]


async def _embed(client: MPEncoderClient) -> torch.Tensor:
    vectors, _ = await client.embed(TEXTS)
    return vectors


def test_a_spare_becomes_the_encoder_it_is_told_to_run() -> None:
    pool = SparePool()
    pool.refill()
    spare_pid = pool._spare.process.pid
    fresh = MPEncoderClient.start(MINILM, "float32")
    from_spare = MPEncoderClient.start(MINILM, "float32", spares=pool)
    try:
        assert from_spare.link.process.pid == spare_pid  # it ran in the spare
        assert fresh.link.process.pid != spare_pid
        assert torch.equal(asyncio.run(_embed(from_spare)), asyncio.run(_embed(fresh)))
        assert pool._spare is None  # taken; the pool starts another when refilled
    finally:
        fresh.shutdown()
        from_spare.shutdown()
        pool.close()
    assert from_spare.link.process.poll() is not None


def test_an_unused_spare_exits_when_closed() -> None:
    pool = SparePool()
    pool.refill()
    process = pool._spare.process
    time.sleep(0.5)  # let it get into its imports
    start = time.monotonic()
    pool.close()
    assert process.poll() is not None
    assert time.monotonic() - start < 4  # it read EOF and exited; not the 5 s wait and kill
    assert process.returncode in (0, -15)
