"""Rate limits on requests and on tokens, in fixed or sliding windows, counted in SQLite
(one gateway instance) or Redis (several).

Admission is one atomic check-and-add per limit: a request is admitted when the window's
total plus its cost stays within the limit (a request costs 1 against a request limit;
against a token limit it reserves its `max_tokens`, at least 1, and once the answer's usage
is known the reservation is corrected to the tokens it really used). A fixed window
counts in buckets of `window_s` seconds; a sliding window counts exactly the events of the
last `window_s` seconds. A refusal says how long to wait (`Retry-After`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from infire.gateway.store import connect

KINDS = ("requests", "tokens")
TECHNIQUES = ("fixed", "sliding")


@dataclass(frozen=True, slots=True)
class Limit:
    """At most `limit` requests or tokens per `window_s` seconds."""

    kind: str
    limit: int
    window_s: float
    technique: str = "fixed"


@dataclass(slots=True)
class Admission:
    """What one admitted request holds against one limit (to correct or give back)."""

    key: str
    limit: Limit
    bucket: int  # fixed window: the bucket charged
    event: str  # sliding window: the event's id
    cost: int


class Counters(Protocol):
    async def admit(self, key: str, limit: Limit, cost: int) -> Admission | float: ...
    async def adjust(self, admission: Admission, delta: int) -> None: ...
    async def close(self) -> None: ...


class SqliteCounters:
    """Counters in two tables; each check-and-add is one IMMEDIATE transaction, so gateway
    processes sharing the file never over-admit."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = connect(path)
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS limit_buckets (key TEXT, bucket INTEGER, "
                             "amount INTEGER, PRIMARY KEY (key, bucket))")  # fmt: skip
            self._db.execute("CREATE TABLE IF NOT EXISTS limit_events (id TEXT PRIMARY KEY, "
                             "key TEXT, t REAL, amount INTEGER)")  # fmt: skip
            self._db.execute("CREATE INDEX IF NOT EXISTS limit_events_key ON limit_events(key, t)")

    def _admit(self, key: str, limit: Limit, cost: int) -> Admission | float:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = self._check(key, limit, cost, now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return result

    def _check(self, key: str, limit: Limit, cost: int, now: float) -> Admission | float:
        db = self._db
        if limit.technique == "fixed":
            bucket = math.floor(now / limit.window_s)
            row = db.execute("SELECT amount FROM limit_buckets WHERE key = ? AND bucket = ?",
                             (key, bucket)).fetchone()  # fmt: skip
            used = row[0] if row else 0
            if used + cost > limit.limit:
                return (bucket + 1) * limit.window_s - now
            db.execute("INSERT INTO limit_buckets VALUES (?, ?, ?) ON CONFLICT (key, bucket) "
                       "DO UPDATE SET amount = amount + excluded.amount", (key, bucket, cost))  # fmt: skip
            db.execute("DELETE FROM limit_buckets WHERE key = ? AND bucket < ?", (key, bucket - 1))
            return Admission(key, limit, bucket, "", cost)
        db.execute("DELETE FROM limit_events WHERE key = ? AND t <= ?", (key, now - limit.window_s))
        events = db.execute("SELECT t, amount FROM limit_events WHERE key = ? ORDER BY t",
                            (key,)).fetchall()  # fmt: skip
        refusal = _sliding_refusal(events, limit, cost, now)
        if refusal is not None:
            return refusal
        event = uuid.uuid4().hex
        db.execute("INSERT INTO limit_events VALUES (?, ?, ?, ?)", (event, key, now, cost))
        return Admission(key, limit, 0, event, cost)

    def _adjust(self, admission: Admission, delta: int) -> None:
        with self._lock:
            if admission.limit.technique == "fixed":
                self._db.execute("UPDATE limit_buckets SET amount = amount + ? WHERE key = ? AND "
                                 "bucket = ?", (delta, admission.key, admission.bucket))  # fmt: skip
            else:
                self._db.execute("UPDATE limit_events SET amount = amount + ? WHERE id = ?",
                                 (delta, admission.event))  # fmt: skip

    async def admit(self, key: str, limit: Limit, cost: int) -> Admission | float:
        return await asyncio.to_thread(self._admit, key, limit, cost)

    async def adjust(self, admission: Admission, delta: int) -> None:
        await asyncio.to_thread(self._adjust, admission, delta)

    async def close(self) -> None:
        with self._lock:
            self._db.close()


def _sliding_refusal(events: list[tuple[float, int]], limit: Limit, cost: int,
                     now: float) -> float | None:  # fmt: skip
    """None if cost fits in the window next to events (time, amount), else the seconds until
    enough of them have left it."""
    total = sum(amount for _, amount in events)
    if total + cost <= limit.limit:
        return None
    for t, amount in events:  # oldest first: wait until they leave the window
        total -= amount
        if total + cost <= limit.limit:
            return max(0.0, t + limit.window_s - now)
    return limit.window_s  # cost alone exceeds the limit


# Redis: one Lua script per technique, so the check and the add are atomic for every
# gateway on that Redis. Sliding windows keep a sorted set of event ids by time and a hash
# of their amounts.
_FIXED = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + cost > limit then return 0 end
redis.call('INCRBY', KEYS[1], cost)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
_SLIDING = """
local now, window, cost, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
for _, id in ipairs(old) do redis.call('HDEL', KEYS[2], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local total = 0
local events = {}
for i = 1, #ids, 2 do
  local amount = tonumber(redis.call('HGET', KEYS[2], ids[i]) or '0')
  total = total + amount
  table.insert(events, {tonumber(ids[i + 1]), amount})
end
if total + cost <= limit then
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('HSET', KEYS[2], ARGV[5], cost)
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000) + 1000)
  redis.call('PEXPIRE', KEYS[2], math.ceil(window * 1000) + 1000)
  return {1, '0'}
end
for _, event in ipairs(events) do
  total = total - event[2]
  if total + cost <= limit then return {0, tostring(event[1] + window - now)} end
end
return {0, tostring(window)}
"""


class RedisCounters:
    """Counters in Redis, shared by every gateway instance on it. The client is
    backends.Backends', which closes it."""

    def __init__(self, client: Any) -> None:  # redis.asyncio.Redis
        self._redis = client
        self._fixed = self._redis.register_script(_FIXED)
        self._sliding = self._redis.register_script(_SLIDING)

    async def admit(self, key: str, limit: Limit, cost: int) -> Admission | float:
        now = time.time()
        if limit.technique == "fixed":
            bucket = math.floor(now / limit.window_s)
            name = f"infire:limit:{key}:{bucket}"
            ttl_ms = int(limit.window_s * 2000) + 1000
            if await self._fixed(keys=[name], args=[cost, limit.limit, ttl_ms]):
                return Admission(key, limit, bucket, "", cost)
            return (bucket + 1) * limit.window_s - now
        event = uuid.uuid4().hex
        names = [f"infire:limit:{key}:events", f"infire:limit:{key}:amounts"]
        admitted, wait = await self._sliding(keys=names,
                                             args=[now, limit.window_s, cost, limit.limit, event])  # fmt: skip
        if admitted:
            return Admission(key, limit, 0, event, cost)
        return max(0.0, float(wait))

    async def adjust(self, admission: Admission, delta: int) -> None:
        key = admission.key
        if admission.limit.technique == "fixed":
            await self._redis.incrby(f"infire:limit:{key}:{admission.bucket}", delta)
        else:
            await self._redis.hincrby(f"infire:limit:{key}:amounts", admission.event, delta)

    async def close(self) -> None:
        pass  # the shared client is closed by its owner
