"""Stored profiles in the cache backends: SQLite and Redis keep them under a count and byte budget, evicting the
oldest stored (storing one again makes it new), never by the results' expiry; a store that cannot be written
answers 503 and one that is not there keeps profiles in memory."""

from __future__ import annotations

import socket
import time

import pytest
from support import PROBLEM, service
from test_cache_faults import redis_server
from test_profile_schema import profile

from app.cache import Budget, RedisCache, SQLiteCache

pytestmark = pytest.mark.service


def _exercise(cache) -> None:
    """The same budget rules on any backend: two profiles or 100 bytes, the oldest stored evicted first."""
    budget = Budget(count=2, total_bytes=100)
    for key in "abc":
        assert cache.put_profile(key, key * 10, budget)
        time.sleep(0.002)  # distinct ages
    assert cache.get_profile("a") == (True, None)  # the third evicted the oldest
    assert cache.get_profile("b") == (True, "b" * 10) and cache.get_profile("c") == (True, "c" * 10)
    assert cache.put_profile("b", "b" * 10, budget)  # stored again: now the newest
    time.sleep(0.002)
    assert cache.put_profile("d", "d" * 10, budget)
    assert cache.get_profile("c") == (True, None) and cache.get_profile("b") == (True, "b" * 10)
    assert cache.put_profile("e", "e" * 95, budget)  # 95 + 10 bytes > 100: only the new one stays
    assert [cache.get_profile(k)[1] is not None for k in "bde"] == [False, False, True]


def test_sqlite_keeps_profiles_under_the_budget(tmp_path) -> None:
    cache = SQLiteCache(str(tmp_path / "c.sqlite"), ttl_s=1)
    _exercise(cache)
    cache.close()
    time.sleep(1.1)  # past the results' ttl: profiles do not expire with them
    again = SQLiteCache(str(tmp_path / "c.sqlite"), ttl_s=1)
    assert again.get_profile("e") == (True, "e" * 95)


def test_redis_keeps_profiles_under_the_budget(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = redis_server(port, tmp_path)
    try:
        cache = None
        for _ in range(100):
            cache = RedisCache(f"redis://127.0.0.1:{port}/0", 60, retry_s=0)
            if cache.error is None:
                break
            time.sleep(0.05)
        assert cache is not None and cache.error is None
        _exercise(cache)
        assert cache._redis.ttl("batchfit:profile:e") == -1  # no expiry
        assert int(cache._redis.zcard("batchfit:profiles")) == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_store_that_cannot_be_written_is_a_503_and_no_cache_keeps_them_in_memory(tmp_path) -> None:
    doc = {"schema": "batchfit.profile", "version": 3}  # checked after the store: refused before it
    with service(tmp_path / "missing-folder" / "c.sqlite", start_workers=False) as client:
        assert client.get("/readyz").json()["cache"] == "degraded"
        r = client.post("/profiles", json=doc)
        assert r.status_code == 422  # a bad profile is refused before the store is asked
        r = client.post("/profiles", json=profile())
        assert r.status_code == 503 and r.headers["content-type"] == PROBLEM
        assert r.json()["type"].endswith("/store-unavailable")
        r = client.get("/profiles/sha256:" + "0" * 64)
        assert r.status_code == 503
    with service(None, start_workers=False) as client:
        key = client.post("/profiles", json=profile()).json()["id"]
        assert client.get(f"/profiles/{key}").json() == profile()
