"""The request log in SQLite: one row per request through the gateway.

One connection under a lock. Rows are handed to a writer thread (`write` never waits on
the disk) that inserts whatever has queued up in one transaction; every read first waits
until the rows written before it are in. WAL mode so readers (analytics, the dashboard)
do not block the writer.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("infire.gateway")

COLUMNS = {
    "id": "TEXT PRIMARY KEY",  # cf-aig-log-id
    "created": "REAL NOT NULL",  # unix seconds
    "gateway": "TEXT NOT NULL",
    "provider": "TEXT",
    "model": "TEXT",
    "endpoint": "TEXT",
    "status": "INTEGER",
    "latency_ms": "REAL",  # until the last byte went to the client
    "ttfb_ms": "REAL",  # until the upstream's answer started
    "tokens_in": "INTEGER",
    "tokens_out": "INTEGER",
    "cost": "REAL",
    "cache_status": "TEXT",
    "step": "INTEGER",
    "attempts": "INTEGER",
    "stream": "INTEGER",
    "error": "TEXT",
    "metadata": "TEXT",  # JSON object from cf-aig-metadata
    "request_body": "TEXT",  # only when cf-aig-collect-log-payload allows
    "response_body": "TEXT",
}
_GATHER_S = 0.002  # the writer's pause before it takes the rows waiting
GROUP_COLUMNS = ("provider", "model")  # what analytics may group by

# One row's contributions to the aggregates (COUNT of a CASE counts the rows it matches).
_AGGREGATES = ("COUNT(*), COUNT(CASE WHEN status >= 400 OR error IS NOT NULL THEN 1 END), "
               "COALESCE(SUM(tokens_in), 0), COALESCE(SUM(tokens_out), 0), TOTAL(cost), "
               "COUNT(CASE WHEN cache_status = 'HIT' THEN 1 END), COUNT(cache_status)")  # fmt: skip


@dataclass(slots=True)
class RequestStats:
    """Aggregates over the rows of one group (or time bucket, or all of them)."""

    key: tuple[Any, ...]  # the bucket's start (with bucket_s), then the group_by columns
    requests: int = 0
    errors: int = 0  # status >= 400 or an error
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float = 0.0
    cache_hits: int = 0
    cache_lookups: int = 0  # rows with a cache status
    latencies_ms: list[float] = field(default_factory=list)  # sorted, nulls left out
    ttfbs_ms: list[float] = field(default_factory=list)  # sorted, nulls left out


@dataclass(frozen=True, slots=True)
class CounterTotals:
    """All-time counts of the rows with one gateway, provider, model and status."""

    gateway: str
    provider: str | None
    model: str | None
    status: int | None
    requests: int
    tokens_in: int
    tokens_out: int
    cost: float


@dataclass(frozen=True, slots=True)
class LatencyCounts:
    """All-time latency histogram of one gateway, provider and model."""

    gateway: str
    provider: str | None
    model: str | None
    count: int  # rows with a latency
    sum_ms: float
    at_most: tuple[int, ...]  # rows with latency_ms <= each bound, in the bounds' order


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the gateway's SQLite file (made if missing), shared by threads under
    the caller's lock: autocommit, WAL, and fsync at checkpoints only (synchronous=NORMAL:
    a crash of the process loses nothing, a power cut at most the last transactions), and
    up to 30 s of waiting for another gateway process's write lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class LogStore:
    """Insert and read request rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = connect(path)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
            self._db.execute(f"CREATE TABLE IF NOT EXISTS requests ({columns})")
            self._db.execute("CREATE INDEX IF NOT EXISTS requests_time ON requests(created)")

        self._pending: list[dict[str, Any]] = []  # written, not inserted yet
        self._writing = False
        self._closed = False
        self._changed = threading.Condition()
        self._writer = threading.Thread(target=self._write_rows, name="gateway-log-writer",
                                        daemon=True)  # fmt: skip
        self._writer.start()

    def write(self, row: dict[str, Any]) -> None:
        """Queue a row for the writer thread (returns at once)."""
        with self._changed:
            self._pending.append(row)
            if len(self._pending) == 1:  # the writer waits only for a first row
                self._changed.notify_all()

    def flush(self) -> None:
        """Wait until every row written so far is in the database."""
        with self._changed:
            self._changed.wait_for(lambda: not (self._pending or self._writing))

    def insert(self, row: dict[str, Any]) -> None:
        """Write a row and wait until it is in."""
        self.write(row)
        self.flush()

    def _write_rows(self) -> None:
        names = list(COLUMNS)
        sql = f"INSERT INTO requests ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                self._writing = True
            if not self._closed:
                time.sleep(_GATHER_S)  # let the rows of a busy moment join one transaction
            with self._changed:
                rows, self._pending = self._pending, []
            try:
                values = [[json.dumps(row[n]) if n == "metadata" and row.get(n) is not None
                           else row.get(n) for n in names] for row in rows]  # fmt: skip
                with self._lock:
                    self._db.execute("BEGIN")
                    self._db.executemany(sql, values)
                    self._db.execute("COMMIT")
            except sqlite3.Error:
                logger.exception("could not log %d requests", len(rows))
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            finally:
                with self._changed:
                    self._writing = False
                    self._changed.notify_all()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """The connection, once the rows written before are in."""
        self.flush()
        with self._lock:
            yield self._db

    def rows(self, gateway: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest rows first (of one gateway, or all)."""
        where, args = ("WHERE gateway = ?", [gateway]) if gateway else ("", [])
        sql = f"SELECT * FROM requests {where} ORDER BY created DESC LIMIT ?"
        with self._reading():
            found = self._db.execute(sql, [*args, limit]).fetchall()
        return [_decoded(dict(r)) for r in found]

    def page(
        self,
        gateway: str,
        limit: int,
        offset: int,
        start: float | None = None,
        end: float | None = None,
        filters: dict[str, str] | None = None,
    ) -> tuple[int, list[dict[str, Any]]]:
        """(matching rows, one page of them newest first, without bodies). filters:
        provider, model, status (2xx / 4xx / 5xx or a code), cache (HIT / MISS), search
        (a substring of id, provider, model, endpoint or error)."""
        clause, args = _range(gateway, start, end)
        where = [clause]
        f = filters or {}
        for column in ("provider", "model"):
            if f.get(column):
                where.append(f"{column} = ?")
                args.append(f[column])
        status = f.get("status", "")
        if len(status) == 3 and status.endswith("xx") and status[0].isdigit():
            where.append("status >= ? AND status < ?")
            args += [int(status[0]) * 100, int(status[0]) * 100 + 100]
        elif status.isdigit():
            where.append("status = ?")
            args.append(int(status))
        if f.get("cache"):
            where.append("cache_status = ?")
            args.append(f["cache"].upper())
        if f.get("search"):
            like = "%" + f["search"].replace("%", "").replace("_", "") + "%"
            where.append("(id LIKE ? OR provider LIKE ? OR model LIKE ? OR endpoint LIKE ? "
                         "OR error LIKE ?)")  # fmt: skip
            args += [like] * 5
        clause = " AND ".join(where)
        columns = ", ".join(c for c in COLUMNS if c not in ("request_body", "response_body"))
        with self._reading():
            total = self._db.execute(f"SELECT COUNT(*) FROM requests WHERE {clause}",
                                     args).fetchone()[0]  # fmt: skip
            found = self._db.execute(
                f"SELECT {columns} FROM requests WHERE {clause} ORDER BY created DESC "
                "LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()  # fmt: skip
        return total, [_decoded(dict(r)) for r in found]

    def get(self, gateway: str, log_id: str) -> dict[str, Any] | None:
        """One row with its bodies, or None."""
        with self._reading():
            row = self._db.execute("SELECT * FROM requests WHERE gateway = ? AND id = ?",
                                   (gateway, log_id)).fetchone()  # fmt: skip
        return None if row is None else _decoded(dict(row))

    def stats(
        self,
        gateway: str,
        start: float | None = None,
        end: float | None = None,
        group_by: Sequence[str] = (),
        bucket_s: int | None = None,
    ) -> list[RequestStats]:
        """Aggregates of one gateway's rows with created in [start, end), per time bucket
        (floor(created / bucket_s) * bucket_s) and per value of the group_by columns; one
        (maybe empty) entry when neither is given."""
        if unknown := set(group_by) - set(GROUP_COLUMNS):
            raise ValueError(f"cannot group by {', '.join(sorted(unknown))}")
        keys, key_args = list(group_by), []
        if bucket_s is not None:
            if bucket_s < 1:
                raise ValueError(f"bucket_s must be at least 1, not {bucket_s}")
            keys.insert(0, "CAST(created / ? AS INTEGER) * ?")  # created > 0: floor
            key_args = [bucket_s, bucket_s]
        where, args = _range(gateway, start, end)
        select = "".join(f"{k}, " for k in keys)
        group = f"GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}" if keys else ""
        with self._reading():
            # one read transaction: the sums and the latencies see the same rows
            self._db.execute("BEGIN")
            try:
                sums = self._db.execute(
                    f"SELECT {select}{_AGGREGATES} FROM requests WHERE {where} {group}",
                    [*key_args, *args],
                ).fetchall()
                values = self._db.execute(
                    f"SELECT {select}latency_ms, ttfb_ms FROM requests WHERE {where} "
                    "AND (latency_ms IS NOT NULL OR ttfb_ms IS NOT NULL)",
                    [*key_args, *args],
                ).fetchall()
            finally:
                self._db.execute("COMMIT")
        n = len(keys)
        found = {tuple(r[:n]): RequestStats(tuple(r[:n]), *r[n:]) for r in sums}
        for r in values:
            entry = found[tuple(r[:n])]
            if r[n] is not None:
                entry.latencies_ms.append(r[n])
            if r[n + 1] is not None:
                entry.ttfbs_ms.append(r[n + 1])
        for entry in found.values():
            entry.latencies_ms.sort()
            entry.ttfbs_ms.sort()
        return list(found.values())

    def counter_totals(self) -> list[CounterTotals]:
        """Requests, tokens and cost of all time, per gateway, provider, model and status."""
        sql = ("SELECT gateway, provider, model, status, COUNT(*), COALESCE(SUM(tokens_in), 0), "
               "COALESCE(SUM(tokens_out), 0), TOTAL(cost) FROM requests GROUP BY 1, 2, 3, 4")  # fmt: skip
        with self._reading():
            found = self._db.execute(sql).fetchall()
        return [CounterTotals(*r) for r in found]

    def latency_counts(self, bounds_ms: Sequence[float]) -> list[LatencyCounts]:
        """The latency histogram of all time (cumulative counts at bounds_ms), per gateway,
        provider and model."""
        at_most = "".join(", COUNT(CASE WHEN latency_ms <= ? THEN 1 END)" for _ in bounds_ms)
        sql = (f"SELECT gateway, provider, model, COUNT(*), TOTAL(latency_ms){at_most} "
               "FROM requests WHERE latency_ms IS NOT NULL GROUP BY 1, 2, 3")  # fmt: skip
        with self._reading():
            found = self._db.execute(sql, list(bounds_ms)).fetchall()
        return [LatencyCounts(*r[:5], tuple(r[5:])) for r in found]

    def close(self) -> None:
        """Insert what is queued, then close."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._writer.join()
        with self._lock:
            self._db.close()


def _range(gateway: str, start: float | None, end: float | None) -> tuple[str, list[Any]]:
    """A WHERE clause (and its arguments) for one gateway's rows in [start, end)."""
    where, args = ["gateway = ?"], [gateway]
    if start is not None:
        where.append("created >= ?")
        args.append(start)
    if end is not None:
        where.append("created < ?")
        args.append(end)
    return " AND ".join(where), args


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("metadata"):
        row["metadata"] = json.loads(row["metadata"])
    return row
