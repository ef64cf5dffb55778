"""The request log in SQLite: one row per request through the gateway.

One connection, used from a worker thread under a lock (the event loop never waits on
the disk); WAL mode so readers (analytics, the dashboard) do not block the writer.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

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


class LogStore:
    """Insert and read request rows."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
            self._db.execute(f"CREATE TABLE IF NOT EXISTS requests ({columns})")
            self._db.execute("CREATE INDEX IF NOT EXISTS requests_time ON requests(created)")

    def insert(self, row: dict[str, Any]) -> None:
        names = [name for name in COLUMNS if name in row]
        values = [json.dumps(row[n]) if n == "metadata" and row[n] is not None else row[n]
                  for n in names]  # fmt: skip
        sql = f"INSERT INTO requests ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        with self._lock:
            self._db.execute(sql, values)

    def rows(self, gateway: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest rows first (of one gateway, or all)."""
        where, args = ("WHERE gateway = ?", [gateway]) if gateway else ("", [])
        sql = f"SELECT * FROM requests {where} ORDER BY created DESC LIMIT ?"
        with self._lock:
            found = self._db.execute(sql, [*args, limit]).fetchall()
        return [_decoded(dict(r)) for r in found]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("metadata"):
        row["metadata"] = json.loads(row["metadata"])
    return row
