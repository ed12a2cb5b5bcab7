"""The result cache: the normalized request + batchfit, torch and catalog versions -> the response.

SQLite (a file, the default) or Redis (``BATCHFIT_REDIS_URL``). Identical
concurrent requests are computed once (``SingleFlight``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from estimator import CATALOG_VERSION, __version__, torch_version


def cache_key(normalized_request: dict[str, Any]) -> str:
    doc = {"request": normalized_request, "batchfit": __version__, "torch": torch_version(),
           "catalog": CATALOG_VERSION}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SQLiteCache:
    def __init__(self, path: str, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, value TEXT, created REAL)")
        self._db.commit()

    def get(self, key: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT value, created FROM results WHERE key = ?", (key,)).fetchone()
        if row is None or (self.ttl_s and time.time() - row[1] > self.ttl_s):
            return None
        return json.loads(row[0])

    def set(self, key: str, value: dict) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?)", (key, json.dumps(value), time.time()))
            self._db.commit()

    def ping(self) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1").fetchone() == (1,)

    def close(self) -> None:
        self._db.close()


class RedisCache:
    def __init__(self, url: str, ttl_s: int) -> None:
        import redis

        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(url)

    def get(self, key: str) -> dict | None:
        raw = self._redis.get(f"batchfit:{key}")
        return None if raw is None else json.loads(raw)

    def set(self, key: str, value: dict) -> None:
        self._redis.set(f"batchfit:{key}", json.dumps(value), ex=self.ttl_s or None)

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except Exception:  # noqa: BLE001 - not ready is the answer
            return False

    def close(self) -> None:
        self._redis.close()


class SingleFlight:
    """``run(key, fn)``: concurrent callers with the same key share one ``fn()``.

    ``fn()`` runs in a task of its own, not in any caller's: a caller that is cancelled (its client
    went away) stops waiting, and the computation is cancelled only when no caller waits for it any
    more (then the key is free at once: a new caller starts a new computation).
    """

    def __init__(self) -> None:
        self._inflight: dict[str, _Flight] = {}

    def waiting(self, key: str) -> int:
        """How many callers wait for ``key``'s computation now (0: none runs)."""
        flight = self._inflight.get(key)
        return flight.waiters if flight is not None else 0

    async def run(self, key: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        flight = self._inflight.get(key)
        if flight is None:
            flight = self._inflight[key] = _Flight(asyncio.ensure_future(fn()))
            flight.task.add_done_callback(lambda _task: self._forget(key, flight))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():  # every caller left: nobody wants the answer
                self._forget(key, flight)
                flight.task.cancel()

    def _forget(self, key: str, flight: _Flight) -> None:
        if self._inflight.get(key) is flight:
            del self._inflight[key]
        if flight.task.done() and not flight.task.cancelled():
            flight.task.exception()  # retrieved: no "never retrieved" warning when every caller left


class _Flight:
    def __init__(self, task: asyncio.Future) -> None:
        self.task, self.waiters = task, 0
