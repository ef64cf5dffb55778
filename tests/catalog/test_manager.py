"""ModelManager's policy with in-process stand-in models (the real engine processes are
tested over HTTP in tests/server/test_catalog_server.py): which model is evicted, the
hold against thrash, one load shared by waiters and its failure, and the refusal."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from infire.catalog.config import Catalog, CatalogEntry
from infire.catalog.manager import CapacityError, ModelManager, request_leases

MIB = 2**20


class StandIn:
    """A loaded model: its bytes, and whether it was shut down."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size, self.stopped, self.dead_reason = name, size, False, None

    def footprint(self) -> int:
        return self.size

    def shutdown(self) -> None:
        self.stopped = True


def _manager(sizes: dict[str, int], budget: int, *, pin: tuple[str, ...] = (),
             load_s: dict[str, float] | None = None, hold_s: float = 0.0,
             fail: set[str] | None = None) -> tuple[ModelManager, list[str]]:  # fmt: skip
    entries = tuple(CatalogEntry(name, "text-generation", "x", Path("x"), pin=name in pin)
                    for name in sizes)  # fmt: skip
    loads: list[str] = []

    def load(entry: CatalogEntry) -> StandIn:
        loads.append(entry.name)
        time.sleep((load_s or {}).get(entry.name, 0.0))
        if entry.name in (fail or set()):
            raise RuntimeError(f"{entry.name} is broken")
        return StandIn(entry.name, sizes[entry.name])

    def inspect(entry: CatalogEntry) -> tuple[int, dict]:
        return sizes[entry.name], {}

    return ModelManager(Catalog(entries), budget, load, inspect, hold_s=hold_s), loads


async def _use(manager: ModelManager, name: str) -> StandIn:
    with request_leases():
        return await manager.acquire(manager.find(name))


def test_the_least_recently_used_cheap_model_goes_first() -> None:
    async def run() -> None:
        manager, loads = _manager({"a": 100 * MIB, "b": 100 * MIB, "c": 100 * MIB}, 250 * MIB)
        a = await _use(manager, "a")
        await _use(manager, "b")
        await asyncio.sleep(0.3)  # well over 10 x the jitter of the stand-ins' load times
        await _use(manager, "a")  # a is the more recent
        await _use(manager, "c")  # evicts b
        assert loads == ["a", "b", "c"] and not a.stopped
        assert manager.slots["b"].state == "unloaded" and manager.slots["b"].evictions == 1
        assert manager.used() == 200 * MIB

    asyncio.run(run())


def test_reload_cost_outweighs_a_little_recency() -> None:
    async def run() -> None:
        sizes = {"slow": 100 * MIB, "fast": 100 * MIB, "new": 100 * MIB}
        manager, _ = _manager(sizes, 250 * MIB, load_s={"slow": 0.3})
        await _use(manager, "slow")
        await _use(manager, "fast")  # used last, but reloads for nothing
        await _use(manager, "new")
        assert manager.slots["fast"].state == "unloaded"
        assert manager.slots["slow"].state == "ready"

    asyncio.run(run())


def test_a_held_model_is_waited_for_not_evicted_at_once() -> None:
    async def run() -> None:
        manager, _ = _manager({"a": 100 * MIB, "b": 100 * MIB}, 150 * MIB, hold_s=0.3)
        await _use(manager, "a")
        start = time.monotonic()
        await _use(manager, "b")
        assert time.monotonic() - start >= 0.25  # a was inside its hold
        assert manager.slots["a"].evictions == 1

    asyncio.run(run())


def test_concurrent_requests_share_one_load_and_its_failure() -> None:
    async def run() -> None:
        manager, loads = _manager({"a": MIB, "bad": MIB}, 100 * MIB,
                                  load_s={"a": 0.1, "bad": 0.1}, fail={"bad"})  # fmt: skip
        models = await asyncio.gather(*(_use(manager, "a") for _ in range(10)))
        assert loads == ["a"] and len({id(m) for m in models}) == 1
        results = await asyncio.gather(*(_use(manager, "bad") for _ in range(5)),
                                       return_exceptions=True)  # fmt: skip
        assert loads == ["a", "bad"]
        assert all(isinstance(r, RuntimeError) and "broken" in str(r) for r in results)
        assert manager.slots["bad"].failures == 1 and manager.slots["bad"].state == "unloaded"
        assert manager.used() == MIB  # the failed load gave its reservation back

    asyncio.run(run())


def test_leased_and_pinned_models_are_never_evicted() -> None:
    async def run() -> None:
        manager, _ = _manager({"p": 100 * MIB, "a": 100 * MIB, "b": 100 * MIB}, 250 * MIB,
                              pin=("p",))  # fmt: skip
        await _use(manager, "p")
        with request_leases():
            await manager.acquire(manager.find("a"))  # a request in flight on a
            with pytest.raises(CapacityError) as refused:
                await _use(manager, "b")
            assert "(a) cannot be evicted" in str(refused.value)
            assert refused.value.retry_after >= 1
        assert manager.slots["a"].in_flight == 0  # the lease ended with its block
        await _use(manager, "b")
        assert manager.slots["a"].evictions == 1 and manager.slots["p"].state == "ready"
        assert manager.refusals == 1
        alone, loads = _manager({"huge": 300 * MIB}, 250 * MIB)
        with pytest.raises(CapacityError) as too_big:
            await _use(alone, "huge")
        assert "memory budget is 250 MiB" in str(too_big.value) and loads == []

    asyncio.run(run())


def test_a_request_that_leaves_does_not_cancel_the_load() -> None:
    async def run() -> None:
        manager, loads = _manager({"a": MIB}, 100 * MIB, load_s={"a": 0.2})
        impatient = asyncio.ensure_future(_use(manager, "a"))
        await asyncio.sleep(0.05)
        impatient.cancel()
        model = await _use(manager, "a")  # the same load, not a second one
        assert loads == ["a"] and not model.stopped

    asyncio.run(run())
