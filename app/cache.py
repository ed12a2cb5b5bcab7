"""The result cache: the normalized request + what shapes an answer (versions, the estimator's source) -> the response.

SQLite (a file, the default) or Redis (``BATCHFIT_REDIS_URL``). Identical
concurrent requests are computed once (``SingleFlight``). Stored profiles
(app/profiles.py) live beside the results, in their own table or keys, under
a budget: past ``Budget.count`` profiles or ``Budget.total_bytes`` the oldest
stored are evicted (storing one again makes it new). They never expire
otherwise: a pod may name one for as long as it runs.

Faults degrade, never fail. A cache that cannot be read or written (a
read-only, deleted or corrupt file; Redis down) is *degraded*: ``get``
misses, ``set`` does nothing, ``error`` says why, ``on_error(op)`` counts it,
and the estimate is computed without the cache. A degraded cache is tried
again (the file reopened, Redis pinged) at most once every ``retry_s``
seconds, and used again once it answers. A corrupt SQLite file is moved
aside to ``<path>.corrupt-<UTC time>`` and a new one is created.

>>> c = SQLiteCache("", ttl_s=0)   # in memory
>>> c.set("k", {"v": 1}); c.get("k"), c.error
({'v': 1}, None)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from app import logs
from app.settings import Settings
from estimator import CATALOG_VERSION, __version__

LIBRARIES = ("torch", "torchvision", "timm", "transformers")  # every library a model is built with
ErrorHook = Callable[[str], None]  # the operation that failed: "open", "get", "set", "ping" or "decode"


def cache_key(normalized_request: dict[str, Any], kind: str = "estimate") -> str:
    """The key of what ``kind`` (the route: ``estimate``, ``timeline``, ``snapshot``) answers to the request."""
    doc = {"request": normalized_request, "batchfit": __version__, "catalog": CATALOG_VERSION,
           "libraries": library_versions(), "source": source_hash()}
    if kind != "estimate":  # an estimate's key as before this field: caches written then still answer
        doc["kind"] = kind
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@lru_cache(maxsize=1)
def library_versions() -> dict[str, str | None]:
    """``{"torch": "2.14.1", ..., "transformers": None}`` (None: not installed), once per process."""
    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


@lru_cache(maxsize=1)
def source_hash() -> str:
    """The installed ``estimator`` package's code and presets, hashed once per process (``tree_hash``)."""
    import estimator

    return tree_hash(Path(estimator.__file__).parent)


def tree_hash(root: Path) -> str:
    """sha256 of the .py and .json files under ``root``, sorted by relative path; each file counts its path
    and length, so moving bytes between files changes the hash too."""
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*")
                   if p.suffix in (".py", ".json") and p.is_file())
    h = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def open_cache(settings: Settings, on_error: ErrorHook | None = None) -> Cache | None:
    """The cache the settings name (Redis, SQLite or none); it opens degraded rather than fail."""
    if settings.redis_url:
        return RedisCache(settings.redis_url, settings.cache_ttl_s, retry_s=settings.cache_retry_s,
                          on_error=on_error)
    if settings.cache_path:
        return SQLiteCache(settings.cache_path, settings.cache_ttl_s, retry_s=settings.cache_retry_s,
                           on_error=on_error)
    return None


class Cache:
    """A cache whose faults degrade it (module docstring). A backend sets ``kind`` and ``faults`` (its own
    errors: any other exception is a defect and propagates) and implements ``_open`` (connect or reconnect),
    ``_read``, ``_write``, ``_probe`` (can it read and write now?) and ``_drop`` (forget the connection)."""

    kind = "cache"
    faults: tuple[type[BaseException], ...] = ()

    def __init__(self, ttl_s: int, *, retry_s: float = 5.0, on_error: ErrorHook | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.retry_s = ttl_s, retry_s
        self.error: str | None = None  # why the cache is degraded; None while it answers
        self._on_error, self._clock = on_error, clock
        self._state = threading.Lock()
        self._retry_at = 0.0
        self._attempt("open", self._open)

    def get(self, key: str) -> dict | None:
        """The stored response, or None; a stored value that is not a JSON object (a bad row, a foreign value
        under our key in a shared Redis) is a miss, counted as a ``decode`` error, without degrading the cache
        (the next ``set`` overwrites it)."""
        raw = self._attempt("get", lambda: self._read(key))
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except _DECODE_FAULTS:
            value = None
        if not isinstance(value, dict):
            if self._on_error is not None:
                self._on_error("decode")
            logs.log("cache-bad-value", cache=self.kind, key=key)
            return None
        return value

    def set(self, key: str, value: dict) -> None:
        raw = json.dumps(value)
        self._attempt("set", lambda: self._write(key, raw))

    def ping(self) -> bool:
        """True when the cache can be read and written now (a probe; a degraded one is retried when due)."""
        return self._attempt("ping", self._probe) is True

    def close(self) -> None:
        self._drop()

    def put_profile(self, key: str, raw: str, budget: Budget) -> bool:
        """Store a profile (its checked canonical JSON) under ``key``, evicting the oldest past ``budget``;
        False when the cache cannot be written now."""
        return self._try("set", lambda: self._write_profile(key, raw, budget))[0]

    def get_profile(self, key: str) -> tuple[bool, str | None]:
        """(whether the cache answered, the stored profile's JSON or None)."""
        answered, raw = self._try("get", lambda: self._read_profile(key))
        return answered, raw.decode() if isinstance(raw, bytes) else raw

    def _attempt(self, op: str, fn: Callable[[], Any]) -> Any:
        return self._try(op, fn)[1]

    def _try(self, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(done, ``fn()``'s result); not done while degraded (retried when due) or when it faults now."""
        if self.error is not None:
            with self._state:
                now = self._clock()
                if now < self._retry_at:
                    return False, None  # degraded: compute without the cache
                self._retry_at = now + self.retry_s  # one caller per period tries to recover
            if op != "open" and not self._run("open", self._open)[0]:
                return False, None
        return self._run(op, fn)

    def _run(self, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            result = fn()
        except self.faults as exc:
            self._fail(op, exc)
            return False, None
        if self.error is not None:
            logs.log("cache-recovered", cache=self.kind, was=self.error)
            self.error = None
        return True, result

    def _fail(self, op: str, exc: BaseException) -> None:
        reason = f"{op}: {type(exc).__name__}: {exc}"
        with self._state:
            first = self.error is None
            self.error, self._retry_at = reason, self._clock() + self.retry_s
        if self._on_error is not None:
            self._on_error(op)
        if first:
            logs.log("cache-degraded", cache=self.kind, error=reason, retry_s=self.retry_s)
        self._drop()

    def _open(self) -> None:
        raise NotImplementedError

    def _read(self, key: str) -> str | bytes | None:
        raise NotImplementedError

    def _write(self, key: str, raw: str) -> None:
        raise NotImplementedError

    def _probe(self) -> bool:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def _write_profile(self, key: str, raw: str, budget: Budget) -> None:
        raise NotImplementedError

    def _read_profile(self, key: str) -> str | bytes | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Budget:
    """How many stored profiles (``count``) and bytes of them (``total_bytes``) the cache keeps."""

    count: int
    total_bytes: int


class Unavailable(Exception):
    """The connection was dropped after a fault (another thread's); the next retry reopens it."""


_DECODE_FAULTS = (json.JSONDecodeError, UnicodeDecodeError)  # a stored value that is not our JSON
_CORRUPT = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
_SCHEMA = "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, value TEXT, created REAL)"
_PROFILES = "CREATE TABLE IF NOT EXISTS profiles (key TEXT PRIMARY KEY, value TEXT, bytes INTEGER, created REAL)"


class _CorruptFile(Exception):
    pass


class SQLiteCache(Cache):
    """A file (``path``; "" is in memory). Rows older than ``ttl_s`` are not answered and are deleted
    whenever the file is opened (``ttl_s`` 0: never)."""

    kind = "sqlite"
    faults = (sqlite3.Error, OSError, Unavailable, _CorruptFile)

    def __init__(self, path: str, ttl_s: int, **kwargs: Any) -> None:
        self.path = path or ":memory:"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        super().__init__(ttl_s, **kwargs)

    def _open(self) -> None:
        self._drop()
        with self._lock:
            try:
                self._db = self._connect()
            except (sqlite3.DatabaseError, _CorruptFile) as exc:
                if not _is_corrupt(exc):
                    raise
                aside = self._move_aside()
                logs.log("cache-file-moved-aside", path=self.path, to=aside, error=f"{type(exc).__name__}: {exc}")
                self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=1.0)
        try:
            db.execute(_SCHEMA)
            db.execute(_PROFILES)
            check = db.execute("PRAGMA quick_check(1)").fetchone()
            if check != ("ok",):
                raise _CorruptFile(f"quick_check: {check}")
            if self.ttl_s:
                db.execute("DELETE FROM results WHERE created < ?", (time.time() - self.ttl_s,))
                db.commit()
            self._write_probe(db)
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> str:
        """``path`` (with its journal, if any: a hot journal would be replayed into the new file) ->
        ``path.corrupt-<UTC time>``."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside, n = f"{self.path}.corrupt-{stamp}", 1
        while os.path.exists(aside):
            n += 1
            aside = f"{self.path}.corrupt-{stamp}-{n}"
        for suffix in ("-journal", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, aside + suffix)
        os.replace(self.path, aside)
        return aside

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise Unavailable(self.path)
        return self._db

    def _read(self, key: str) -> str | None:
        with self._lock:
            row = self._connection().execute("SELECT value, created FROM results WHERE key = ?", (key,)).fetchone()
        if row is None or (self.ttl_s and time.time() - row[1] > self.ttl_s):
            return None
        return str(row[0])

    def _write(self, key: str, raw: str) -> None:
        with self._lock:
            db = self._connection()
            db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?)", (key, raw, time.time()))
            db.commit()

    def _probe(self) -> bool:
        with self._lock:
            self._write_probe(self._connection())
        return True

    def _write_profile(self, key: str, raw: str, budget: Budget) -> None:
        with self._lock:
            db = self._connection()
            db.execute("INSERT OR REPLACE INTO profiles VALUES (?, ?, ?, ?)", (key, raw, len(raw.encode()),
                                                                               time.time()))
            count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM profiles").fetchone()
            while count > budget.count or total > budget.total_bytes:
                oldest = db.execute("SELECT key, bytes FROM profiles WHERE key != ? ORDER BY created, rowid LIMIT 1",
                                    (key,)).fetchone()
                if oldest is None:
                    break
                db.execute("DELETE FROM profiles WHERE key = ?", (oldest[0],))
                count, total = count - 1, total - oldest[1]
                logs.log("profile-evicted", cache=self.kind, id=oldest[0])
            db.commit()

    def _read_profile(self, key: str) -> str | None:
        with self._lock:
            row = self._connection().execute("SELECT value FROM profiles WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def _write_probe(db: sqlite3.Connection) -> None:
        """A write that is rolled back: a read-only file, or one deleted or moved since it was opened
        (SQLITE_READONLY_DBMOVED), fails here; reads alone would still pass."""
        try:
            db.execute("INSERT OR REPLACE INTO results VALUES ('', '', 0)")
        finally:
            db.rollback()

    def _drop(self) -> None:
        with self._lock:
            db, self._db = self._db, None
        if db is not None:
            db.close()


def _is_corrupt(exc: BaseException) -> bool:
    if isinstance(exc, _CorruptFile):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _CORRUPT  # the primary code of an extended one


class RedisCache(Cache):
    """Keys ``batchfit:<key>``, expiring after ``ttl_s`` (0: never). Connecting and each command time out
    after ``timeout_s``, with one retry on a dropped connection, so an unreachable Redis costs a request
    at most about 2 x ``timeout_s``, and only once per ``retry_s`` while degraded."""

    kind = "redis"

    def __init__(self, url: str, ttl_s: int, *, timeout_s: float = 0.5, **kwargs: Any) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.faults = (redis.RedisError, OSError)
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1))
        super().__init__(ttl_s, **kwargs)

    def _open(self) -> None:
        self._redis.ping()

    def _read(self, key: str) -> str | bytes | None:
        raw: str | bytes | None = self._redis.get(f"batchfit:{key}")
        return raw

    def _write(self, key: str, raw: str) -> None:
        self._redis.set(f"batchfit:{key}", raw, ex=self.ttl_s or None)

    def _probe(self) -> bool:
        return bool(self._redis.ping())

    # A profile: its JSON under batchfit:profile:<id>, its age in the sorted set batchfit:profiles (score: when
    # stored) and its bytes in the hash batchfit:profile-bytes, so the budget is read without the values.
    def _write_profile(self, key: str, raw: str, budget: Budget) -> None:
        r = self._redis
        pipe = r.pipeline()
        pipe.set(f"batchfit:profile:{key}", raw)
        pipe.zadd("batchfit:profiles", {key: time.time()})
        pipe.hset("batchfit:profile-bytes", key, len(raw.encode()))
        pipe.execute()
        count = int(r.zcard("batchfit:profiles"))
        total = sum(int(b) for b in r.hvals("batchfit:profile-bytes"))
        while count > budget.count or total > budget.total_bytes:
            oldest = [k.decode() if isinstance(k, bytes) else str(k) for k in r.zrange("batchfit:profiles", 0, 1)]
            victim = next((k for k in oldest if k != key), None)
            if victim is None:
                break
            size = int(r.hget("batchfit:profile-bytes", victim) or 0)
            pipe = r.pipeline()
            pipe.delete(f"batchfit:profile:{victim}")
            pipe.zrem("batchfit:profiles", victim)
            pipe.hdel("batchfit:profile-bytes", victim)
            pipe.execute()
            count, total = count - 1, total - size
            logs.log("profile-evicted", cache=self.kind, id=victim)

    def _read_profile(self, key: str) -> str | bytes | None:
        raw: str | bytes | None = self._redis.get(f"batchfit:profile:{key}")
        return raw

    def _drop(self) -> None:
        self._redis.connection_pool.disconnect()

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
