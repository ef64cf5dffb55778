"""The response cache: exact matches, in SQLite (one instance) or Redis (several).

Which of the two is chosen once, for the cache and the rate limits together (backends.py).
The key is a SHA-256 over the gateway, provider, endpoint, model, a hash of the client's
credentials and the canonical JSON of the body (keys sorted, no spaces), or over the
gateway and the client's own `cf-aig-cache-key`. An entry is the answer exactly as the
client got it (status, content type, body: a streamed answer's whole event stream), so a
hit replays the same bytes. Identical requests that miss at the same time in one gateway
process collapse: one goes upstream, the others wait for its answer and replay it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from infire.gateway.store import connect

# Answer headers an entry keeps (the rest belong to the original exchange).
KEPT_HEADERS = ("content-type",)


@dataclass(slots=True)
class Entry:
    """A cached answer."""

    status: int
    headers: dict[str, str]
    body: bytes
    provider: str | None = None  # the provider that answered
    step: int = 0

    def encode(self) -> bytes:
        meta = {"status": self.status, "headers": self.headers, "provider": self.provider,
                "step": self.step}  # fmt: skip
        return json.dumps(meta).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> Entry:
        meta, _, body = data.partition(b"\n")
        fields = json.loads(meta)
        return cls(int(fields["status"]), dict(fields["headers"]), body, fields.get("provider"),
                   int(fields.get("step", 0)))  # fmt: skip


class Backend(Protocol):
    async def get(self, key: str) -> Entry | None: ...
    async def put(self, key: str, entry: Entry, ttl_s: float) -> None: ...
    async def close(self) -> None: ...


class SqliteBackend:
    """Entries in a `cache` table, expired ones ignored and pruned on write."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = connect(path)
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS cache (key TEXT PRIMARY KEY, "
                             "expires REAL NOT NULL, value BLOB NOT NULL)")  # fmt: skip

    def _get(self, key: str) -> Entry | None:
        with self._lock:
            row = self._db.execute("SELECT expires, value FROM cache WHERE key = ?",
                                   (key,)).fetchone()  # fmt: skip
        if row is None or row[0] <= time.time():
            return None
        return Entry.decode(row[1])

    def _put(self, key: str, entry: Entry, ttl_s: float) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO cache VALUES (?, ?, ?)",
                             (key, now + ttl_s, entry.encode()))  # fmt: skip
            self._db.execute("DELETE FROM cache WHERE expires <= ?", (now,))

    async def get(self, key: str) -> Entry | None:
        return await asyncio.to_thread(self._get, key)

    async def put(self, key: str, entry: Entry, ttl_s: float) -> None:
        await asyncio.to_thread(self._put, key, entry, ttl_s)

    async def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisBackend:
    """Entries as Redis strings with a TTL (shared by every gateway on that Redis). The
    client is backends.Backends', which closes it."""

    def __init__(self, client: Any) -> None:  # redis.asyncio.Redis
        self._redis = client

    async def get(self, key: str) -> Entry | None:
        value = await self._redis.get(f"infire:cache:{key}")
        return None if value is None else Entry.decode(value)

    async def put(self, key: str, entry: Entry, ttl_s: float) -> None:
        await self._redis.set(f"infire:cache:{key}", entry.encode(), px=max(1, int(ttl_s * 1000)))

    async def close(self) -> None:
        pass  # the shared client is closed by its owner


def cache_key(parts: dict[str, Any], body: bytes) -> str:
    """SHA-256 (hex) over the request's identity and its body (canonical if JSON)."""
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
    except (ValueError, UnicodeDecodeError):
        canonical = hashlib.sha256(body).hexdigest()
    identity = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{identity}\n{canonical}".encode()).hexdigest()


def credentials_hash(headers: Any) -> str:
    """A hash of the client's credentials, so that tenants never share entries."""
    values = [headers.get(h, "") for h in ("authorization", "cf-aig-authorization")]
    return hashlib.sha256("\n".join(values).encode()).hexdigest()


class Cache:
    """A backend plus the misses in flight in this process (collapsed by key)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._inflight: dict[str, asyncio.Future[Entry | None]] = {}
        self.hits = self.misses = 0

    async def lookup(self, key: str) -> tuple[Entry | None, bool]:
        """(entry, False) on a hit, after waiting for an identical miss in flight; else
        (None, True): this caller leads, goes upstream and must call `done`."""
        while True:
            pending = self._inflight.get(key)
            if pending is not None:  # someone is looking this key up, or fetching it
                entry = await asyncio.shield(pending)
                if entry is not None:
                    self.hits += 1
                    return entry, False
                continue  # the leader got no cacheable answer: one of the waiters leads
            # Claim the key before the first await, so a lookup never races a leader.
            claim = asyncio.get_running_loop().create_future()
            self._inflight[key] = claim
            try:
                entry = await self.backend.get(key)
            except BaseException:
                await self.done(key, None, 0)
                raise
            if entry is not None:
                self._inflight.pop(key, None)
                claim.set_result(entry)
                self.hits += 1
                return entry, False
            self.misses += 1
            return None, True

    async def done(self, key: str, entry: Entry | None, ttl_s: float) -> None:
        """The leader's answer (None: not cacheable); wakes the waiters."""
        try:
            if entry is not None:
                await self.backend.put(key, entry, ttl_s)
        finally:
            pending = self._inflight.pop(key, None)
            if pending is not None and not pending.done():
                pending.set_result(entry)
