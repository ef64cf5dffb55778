"""Where the gateway keeps the state that its instances may share: the response cache's
entries and the rate-limit counters. The choice is made here, once, for both: Redis when
the config has `[store] redis_url` (several gateway processes share one Redis, through one
client), else the gateway's SQLite file (one instance, or processes on one host). The
request log always stays in SQLite (store.py). redis-py is imported only for Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infire.gateway.cache import Backend, RedisBackend, SqliteBackend
from infire.gateway.config import ConfigError
from infire.gateway.limits import Counters, RedisCounters, SqliteCounters


@dataclass(slots=True)
class Backends:
    """The cache's backend and the rate-limit counters, over the same store."""

    cache: Backend
    counters: Counters
    redis: Any = None  # the Redis client both use (redis.asyncio.Redis), else None

    async def close(self) -> None:
        await self.cache.close()
        await self.counters.close()
        if self.redis is not None:
            await self.redis.aclose()


def open_backends(redis_url: str | None, sqlite_path: Path) -> Backends:
    """Redis for the config's redis_url (checked on load), else the SQLite file."""
    if redis_url:
        try:
            import redis.asyncio
        except ModuleNotFoundError:
            raise ConfigError("[store] redis_url needs redis-py: pip install 'infire[gateway]' "
                              "(or 'infire-gateway[redis]')") from None  # fmt: skip
        client = redis.asyncio.from_url(redis_url)
        return Backends(RedisBackend(client), RedisCounters(client), client)
    return Backends(SqliteBackend(sqlite_path), SqliteCounters(sqlite_path))
