"""The catalog's models, loaded on demand within a memory budget in bytes.

Each catalog entry has a slot: unloaded, loading, ready or unloading, with the bytes it
takes (an estimate before its first load, the measured resident size of its engine
processes after), its load time and its counters. Everything here runs on the server's
event loop, so a check of the free bytes and the reservation that follows it cannot
interleave with another request's; loads and unloads run in their own threads, so the
resident models keep serving while another loads.

- A request takes a lease on its model (`acquire`) for as long as its HTTP response
  runs, stream included: the server's middleware releases the request's leases when the
  response is over, on every path (`request_leases`). A model with a lease is never
  evicted.
- Concurrent requests for a model that is loading wait for that one load (and share its
  failure).
- To make room, victims are taken among ready, unpinned, unleased models, those with the
  least value first: value = last use + `RELOAD_WEIGHT` x load seconds, so a model that
  is slow to load is kept as if it had been used that much more recently. A model loaded
  less than `hold_s` ago is not evicted (hysteresis against thrash); a request that needs
  its room waits for the hold to pass.
- When nothing can be freed the request gets CapacityError: a 429 with Retry-After
  (Workers AI code 3040), never an out-of-memory.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infire.catalog.config import Catalog, CatalogEntry
from infire.errors import InfireError, ModelLoadError, ModelNotFoundError

logger = logging.getLogger("infire.catalog")

RELOAD_WEIGHT = 10.0  # a second of load time counts as this many seconds of recency
MISESTIMATE = 0.2  # an estimate this far off the measured size is logged


class CapacityError(InfireError):
    """No room for a model within the memory budget right now: retry after `retry_after`."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class ModelSlot:
    """One catalog entry's place in memory."""

    entry: CatalogEntry
    state: str = "unloaded"  # unloaded | loading | ready | unloading
    model: Any = None  # a Serving or an encoder client, once ready
    estimate: int | None = None  # bytes, before the first load
    properties: dict | None = None  # context_window, max_input_tokens, output_dimensions
    measured: int | None = None  # bytes its processes took after its last load
    reserved: bool = False  # its bytes count against the budget
    load_seconds: float | None = None  # its last load
    loaded_at: float = 0.0
    last_used: float = 0.0
    in_flight: int = 0  # leases: requests running on it
    loads: int = 0
    evictions: int = 0
    failures: int = 0
    error: str | None = None  # why its last load failed
    pending: asyncio.Future | None = None  # the load or unload under way

    @property
    def bytes(self) -> int:
        """What it counts against the budget: measured once loaded, else the estimate."""
        return self.measured if self.measured is not None else (self.estimate or 0)


class Lease:
    """A request's hold on a ready model; `release` once (idempotent)."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slot.in_flight -= 1
            self.slot.last_used = time.monotonic()


_LEASES: contextvars.ContextVar[list[Lease] | None] = contextvars.ContextVar(
    "infire_leases", default=None
)


class request_leases:  # noqa: N801 (used as a context manager, like contextlib's)
    """The leases taken while this block runs (one HTTP request), released at its end."""

    def __enter__(self) -> list[Lease]:
        self.leases: list[Lease] = []
        self.token = _LEASES.set(self.leases)
        return self.leases

    def __exit__(self, *exc: object) -> None:
        _LEASES.reset(self.token)
        for lease in self.leases:
            lease.release()


class ModelManager:
    """The slots of a catalog and the budget they share.

    `load(entry)` builds a model (blocking; run in a thread) with `footprint()` (resident
    bytes, or None where they cannot be told apart), `shutdown()` and `dead_reason`;
    `inspect(entry)` guesses its bytes before its first load and reads its properties
    (blocking too; `inspect_all` runs it for every entry at startup)."""

    def __init__(
        self,
        catalog: Catalog,
        budget: int,
        load: Callable[[CatalogEntry], Any],
        inspect: Callable[[CatalogEntry], tuple[int, dict]],
        hold_s: float = 0.5,
    ) -> None:
        self.catalog = catalog
        self.budget = budget
        self.hold_s = hold_s
        self._load_model = load
        self._inspect = inspect
        self.slots = {entry.name: ModelSlot(entry) for entry in catalog.entries}
        self.refusals = 0  # requests answered CapacityError
        self.closed = False
        self._tasks: set[asyncio.Task] = set()

    # -- what the routes use ---------------------------------------------------------------

    def find(self, model: str) -> ModelSlot:
        """The slot a request's `model` names; ModelNotFoundError otherwise."""
        entry = self.catalog.find(model) if isinstance(model, str) else None
        if entry is None:
            names = ", ".join(e.name for e in self.catalog.entries)
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {names}", param="model"
            )
        return self.slots[entry.name]

    async def acquire(self, slot: ModelSlot) -> Any:
        """The slot's model, loaded if it was not, under a lease that the current request
        releases when its response ends (`request_leases`). Loads and unloads run as tasks
        of their own: a request that goes away does not cancel a load others wait for."""
        leases = _LEASES.get()
        if leases is None:
            raise RuntimeError("acquire runs inside request_leases()")
        while True:
            if self.closed:
                raise ModelLoadError("the server is shutting down")
            if slot.state == "ready":
                if slot.model.dead_reason is None:
                    break
                logger.error("%s: its engine died (%s); reloading it", slot.entry.name,
                             slot.model.dead_reason)  # fmt: skip
                self._start(slot, "unloading", self._unload(slot, evicted=False))
            elif slot.state == "unloaded":
                self._start(slot, "loading", self._load(slot))
            await asyncio.shield(slot.pending)  # the one load: its error is ours
        slot.in_flight += 1
        slot.last_used = time.monotonic()
        lease = Lease(slot)
        leases.append(lease)
        return slot.model

    def _start(self, slot: ModelSlot, state: str, work: Any) -> None:
        """Put the slot in `state` now (so that no other request starts the same work) and
        run `work` as its own task; `slot.pending` settles when it ends."""
        slot.state, slot.pending = state, asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def inspect_all(self) -> None:
        """Estimate every entry's bytes and read its properties (errors are logged; the
        entry's load reports them)."""
        for slot in self.slots.values():
            if slot.estimate is None:
                try:
                    await self._inspect_slot(slot)
                except Exception as e:
                    logger.warning("%s: cannot read its checkpoint: %s", slot.entry.name, e)

    async def _inspect_slot(self, slot: ModelSlot) -> None:
        slot.estimate, slot.properties = await in_thread(self._inspect, slot.entry)

    async def ensure(self, slot: ModelSlot) -> None:
        """Load the slot's model if it is not loaded (startup: pin and preload)."""
        with request_leases():
            await self.acquire(slot)

    def used(self) -> int:
        """Bytes reserved by loaded, loading and unloading models."""
        return sum(slot.bytes for slot in self.slots.values() if slot.reserved)

    def ready_models(self) -> Iterator[tuple[str, Any]]:
        """(name, model) of every ready model."""
        for name, slot in self.slots.items():
            if slot.state == "ready":
                yield name, slot.model

    async def close(self) -> None:
        """Stop every loaded model; loads still running stop theirs when they end."""
        self.closed = True
        ready = [slot for slot in self.slots.values() if slot.state == "ready"]
        for slot in ready:
            self._start(slot, "unloading", self._unload(slot, evicted=False))
        await asyncio.gather(*(asyncio.shield(slot.pending) for slot in ready))

    # -- loading and making room -----------------------------------------------------------

    async def _load(self, slot: ModelSlot) -> None:
        """Estimate, make room, load and measure (the slot is `loading`); every error
        settles `slot.pending`, which the waiting requests raise."""
        try:
            if slot.estimate is None:
                await self._inspect_slot(slot)
            await self._make_room(slot)
            start = time.monotonic()
            model = await in_thread(self._load_model, slot.entry)
            if self.closed:  # the server stopped while it loaded
                await in_thread(model.shutdown)
                raise ModelLoadError("the server is shutting down")
            measured = await in_thread(model.footprint)
        except BaseException as e:
            slot.state, slot.reserved = "unloaded", False
            if not isinstance(e, CapacityError | asyncio.CancelledError):
                slot.failures += 1
                slot.error = str(e) or repr(e)
                logger.error("%s: failed to load: %s", slot.entry.name, slot.error)
            _settle(slot.pending, e)
            return
        slot.load_seconds = time.monotonic() - start
        slot.loaded_at = time.monotonic()
        slot.model, slot.state, slot.error = model, "ready", None
        slot.loads += 1
        if measured is not None:
            off = abs(measured - slot.bytes) / max(1, slot.bytes)
            if off > MISESTIMATE:
                logger.warning("%s: takes %.0f MiB, %.0f MiB were reserved; corrected",
                               slot.entry.name, measured / 2**20, slot.bytes / 2**20)  # fmt: skip
            slot.measured = measured
        logger.info("%s: loaded in %.1f s, %.0f MiB (budget %.0f of %.0f MiB used)",
                    slot.entry.name, slot.load_seconds, slot.bytes / 2**20,
                    self.used() / 2**20, self.budget / 2**20)  # fmt: skip
        _settle(slot.pending, None)

    async def _make_room(self, slot: ModelSlot) -> None:
        """Reserve the slot's bytes, evicting idle models as needed; CapacityError when
        the budget cannot hold it now."""
        need = slot.bytes
        while True:
            free = self.budget - self.used()
            if need <= free:
                slot.reserved = True  # no await between the check and the reservation
                return
            now = time.monotonic()
            idle = [s for s in self.slots.values()
                    if s.state == "ready" and not s.entry.pin and s.in_flight == 0]  # fmt: skip
            victims = _victims([s for s in idle if now - s.loaded_at >= self.hold_s], need - free)
            if victims:
                for victim in victims:
                    self._start(victim, "unloading", self._unload(victim, evicted=True))
                await asyncio.gather(*(asyncio.shield(v.pending) for v in victims))
                continue
            unloading = [s.pending for s in self.slots.values() if s.state == "unloading"]
            if unloading:
                await asyncio.wait([asyncio.shield(p) for p in unloading])
                continue
            if _victims(idle, need - free):  # only models inside their hold would do
                wait = min(self.hold_s - (now - s.loaded_at) for s in idle
                           if now - s.loaded_at < self.hold_s)  # fmt: skip
                await asyncio.sleep(max(wait, 0.01))
                continue
            raise self._refusal(slot, need, free)

    def _refusal(self, slot: ModelSlot, need: int, free: int) -> CapacityError:
        self.refusals += 1
        pinned = sum(s.bytes for s in self.slots.values() if s.reserved and s.entry.pin)
        busy = [s for s in self.slots.values() if s.reserved and s.in_flight and not s.entry.pin]
        mib = 2**20
        if need > self.budget - pinned:
            reason = (f"it needs {need / mib:.0f} MiB and the memory budget is "
                      f"{self.budget / mib:.0f} MiB, {pinned / mib:.0f} MiB of it pinned")  # fmt: skip
            retry_after = 60
        else:
            names = ", ".join(s.entry.name for s in busy) or "none"
            reason = (f"it needs {need / mib:.0f} MiB, {free / mib:.0f} MiB are free and the "
                      f"models with requests running ({names}) cannot be evicted")  # fmt: skip
            retry_after = max(1, math.ceil(max((s.load_seconds or 1.0) for s in busy or [slot])))
        return CapacityError(f"no capacity to load {slot.entry.name!r} now: {reason}",
                             retry_after)  # fmt: skip

    async def _unload(self, slot: ModelSlot, evicted: bool) -> None:
        """Stop the slot's model (the slot is `unloading`) and give back its bytes."""
        model, slot.model = slot.model, None
        try:
            await in_thread(model.shutdown)
        finally:
            slot.state, slot.reserved = "unloaded", False
            slot.evictions += evicted
            if evicted:
                logger.info("%s: evicted (%.0f MiB)", slot.entry.name, slot.bytes / 2**20)
            _settle(slot.pending, None)

    # -- what /metrics, /v1/models and /ai/models/search show ------------------------------

    def status(self, slot: ModelSlot) -> dict:
        """The slot's load state, bytes and counters."""
        return {
            "state": slot.state, "pinned": slot.entry.pin, "bytes": slot.bytes or None,
            "estimated_bytes": slot.estimate, "measured_bytes": slot.measured,
            "load_seconds": None if slot.load_seconds is None else round(slot.load_seconds, 3),
            "loads": slot.loads, "evictions": slot.evictions, "load_failures": slot.failures,
            "requests_in_flight": slot.in_flight, "error": slot.error,
        }  # fmt: skip

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Prometheus families of the catalog (a collector's `collect`)."""
        labels = ["model_name"]
        gauges = {
            "infire:model_loaded": ("1 while the model is loaded and serving", lambda s: s.state == "ready"),
            "infire:model_loading": ("1 while the model loads", lambda s: s.state == "loading"),
            "infire:model_memory_bytes": ("Bytes the model takes (measured once loaded)", lambda s: s.bytes),
            "infire:model_load_seconds": ("Seconds its last load took", lambda s: s.load_seconds or 0.0),
            "infire:model_requests_in_flight": ("Requests holding the model", lambda s: s.in_flight),
        }  # fmt: skip
        counters = {
            "infire:model_loads": ("Times the model was loaded", lambda s: s.loads),
            "infire:model_evictions": ("Times the model was evicted to make room", lambda s: s.evictions),
            "infire:model_load_failures": ("Loads that failed", lambda s: s.failures),
        }  # fmt: skip
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, value) in table.items():
                family = kind(name, doc, labels=labels)
                for slot in self.slots.values():
                    family.add_metric([slot.entry.name], float(value(slot)))
                yield family
        yield GaugeMetricFamily("infire:memory_budget_bytes", "The models' memory budget",
                                value=self.budget)  # fmt: skip
        yield GaugeMetricFamily("infire:memory_used_bytes", "Bytes reserved by loaded models",
                                value=self.used())  # fmt: skip
        yield CounterMetricFamily("infire:capacity_refusals",
                                  "Requests refused: no room for their model", value=self.refusals)  # fmt: skip


def _victims(candidates: list[ModelSlot], shortfall: int) -> list[ModelSlot] | None:
    """The least valuable candidates that free `shortfall` bytes together, or None."""
    chosen, freed = [], 0
    for slot in sorted(
        candidates, key=lambda s: s.last_used + RELOAD_WEIGHT * (s.load_seconds or 0)
    ):
        if freed >= shortfall:
            break
        chosen.append(slot)
        freed += slot.bytes
    return chosen if freed >= shortfall else None


def _settle(future: asyncio.Future | None, error: BaseException | None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # retrieved: nobody else may be waiting


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread of its own (a load must not keep the interpreter
    from exiting, as the default executor's threads would)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result: Any = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, e)
        else:
            loop.call_soon_threadsafe(_set, future, result)

    threading.Thread(target=run, name="infire-catalog", daemon=True).start()
    return await future


def _set(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)
