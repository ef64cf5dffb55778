"""KVConnector: how KV blocks move between two engines' pools.

The decode side pulls: the prefill engine registers its KV pool and holds a request's
blocks under a lease (disagg/transfer.py); the decode engine reads those blocks into its
own pool and then tells the prefill side to let them go. A connector only moves bytes:
`register` exposes this engine's pool, `address` names it to peers, and `pull` copies a
list of (local address, peer address, length) ranges from a peer, returning a Transfer to
poll. Two implementations:

- MooncakeConnector: Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`,
  TCP; its RDMA transports where the CUDA build and the NICs are present), peers found by
  P2P handshake, so one pair needs no metadata server. Its transfers block the calling
  thread (a busy wait), so they run on one thread of their own.
- InprocConnector: for unit tests only. Engines in one process copy each other's
  registered memory with memmove; the address ranges are checked as Mooncake does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11

from infire.errors import InfireError, KVTransferError

logger = logging.getLogger("infire.disagg")

Range = tuple[int, int, int]  # local address, peer address, bytes


def timed(copy: Callable[..., None], *args: object) -> float:
    """Run `copy` (on a transfer thread) and return how long the copy itself took."""
    start = time.perf_counter()
    copy(*args)
    return time.perf_counter() - start


class Transfer:
    """One pull in progress: poll until `done`; then `error` is None or why it failed, and
    `seconds` how long the copy took on its thread (not counting the wait for polls)."""

    def __init__(self, future: Future, num_bytes: int) -> None:
        self._future = future
        self.num_bytes = num_bytes

    @property
    def done(self) -> bool:
        """True once the copy has ended, well or not."""
        return self._future.done()

    @property
    def seconds(self) -> float:
        """The copy's own duration (0 until it ended well)."""
        if not self._future.done() or self._future.exception() is not None:
            return 0.0
        return self._future.result()

    @property
    def error(self) -> str | None:
        """Why the copy failed, or None (only meaningful once done)."""
        exc = self._future.exception()
        return None if exc is None else str(exc) or repr(exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout`; returns done."""
        try:
            self._future.exception(timeout=timeout)
        except FutureTimeout:
            return False
        return self.done


class KVConnector(ABC):
    """Moves byte ranges between registered KV pools of two engines."""

    name: str = ""

    @property
    @abstractmethod
    def address(self) -> str:
        """What a peer passes to `pull` to read from this engine."""

    @abstractmethod
    def register(self, regions: list[tuple[int, int]]) -> None:
        """Expose (address, bytes) regions of this process (the KV pool) to peers."""

    @abstractmethod
    def pull(self, peer: str, ranges: list[Range]) -> Transfer:
        """Start copying each peer range into the local one; returns at once."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and transferring (idempotent)."""


class MooncakeConnector(KVConnector):
    """Mooncake's transfer engine over TCP, peers by P2P handshake."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the package, or Debian's libibverbs1 it links against
            raise InfireError(
                "KV transfer needs Mooncake's transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1): "
                f"{e}"
            ) from None
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise InfireError(f"Mooncake's transfer engine did not start on {host} ({protocol})")
        self._address = f"{host}:{self._engine.get_rpc_port()}"
        self._regions: list[int] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="infire-kv-transfer")
        self._closed = False

    @property
    def address(self) -> str:
        """host:port of this engine's handshake server."""
        return self._address

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register each region with the transfer engine."""
        for address, length in regions:
            if self._engine.register_memory(address, length) != 0:
                raise InfireError(f"Mooncake could not register {length} bytes of KV pool")
            self._regions.append(address)

    def pull(self, peer: str, ranges: list[Range]) -> Transfer:
        """Read the ranges from `peer` on the transfer thread."""
        future = self._pool.submit(timed, self._read, peer, ranges)
        return Transfer(future, sum(r[2] for r in ranges))

    def _read(self, peer: str, ranges: list[Range]) -> None:
        local, remote, lengths = (
            (list(x) for x in zip(*ranges, strict=True)) if ranges else ([],) * 3
        )
        if not ranges:
            return
        code = self._engine.batch_transfer_sync_read(peer, local, remote, lengths)
        if code != 0:
            raise KVTransferError(
                f"Mooncake read of {sum(lengths)} bytes from {peer} failed ({code})"
            )

    def close(self) -> None:
        """Stop the transfer thread and unregister the pool."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for address in self._regions:
            self._engine.unregister_memory(address)
        self._regions.clear()


class InprocConnector(KVConnector):
    """Test-only: engines of one process read each other's registered memory."""

    name = "inproc"
    _registry: dict[str, list[tuple[int, int]]] = {}
    _lock = threading.Lock()
    _next = 0

    def __init__(self) -> None:
        with InprocConnector._lock:
            InprocConnector._next += 1
            self._address = f"inproc-{os.getpid()}-{InprocConnector._next}"
            InprocConnector._registry[self._address] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="infire-kv-inproc")

    @property
    def address(self) -> str:
        """This engine's name in the process-wide registry."""
        return self._address

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Add regions to what peers may read."""
        with InprocConnector._lock:
            InprocConnector._registry[self._address] += regions

    def pull(self, peer: str, ranges: list[Range]) -> Transfer:
        """memmove each range, after checking it lies in the peer's registered memory."""
        future = self._pool.submit(timed, self._copy, peer, ranges)
        return Transfer(future, sum(r[2] for r in ranges))

    def _copy(self, peer: str, ranges: list[Range]) -> None:
        with InprocConnector._lock:
            regions = InprocConnector._registry.get(peer)
        if regions is None:
            raise KVTransferError(f"no engine at {peer}")
        for local, remote, length in ranges:
            if not any(a <= remote and remote + length <= a + n for a, n in regions):
                raise KVTransferError(f"{peer} has not registered [{remote}, +{length})")
            ctypes.memmove(local, remote, length)

    def close(self) -> None:
        """Leave the registry: pulls from this engine fail from now on."""
        with InprocConnector._lock:
            InprocConnector._registry.pop(self._address, None)
        self._pool.shutdown(wait=True)


def make_connector(name: str, host: str = "127.0.0.1", protocol: str = "tcp") -> KVConnector:
    """The connector called `name` ('mooncake', or 'inproc' in tests)."""
    if name == "mooncake":
        return MooncakeConnector(host, protocol)
    if name == "inproc":
        return InprocConnector()
    raise InfireError(f"unknown KV connector {name!r}; choose mooncake")
