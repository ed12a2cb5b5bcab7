"""The result cache under faults: they degrade, never fail (SQLite files, Redis), and the key and expiry.

A degraded cache means "compute without the cache": estimates stay 200, /readyz stays 200 and says
``"cache": "degraded"`` with the reason, /metrics counts ``batchfit_cache_errors_total{op}``. Most tests
run the app with ``StubPool`` (a canned answer per estimate, numbered, so a hit is told from a recomputed
answer); the read-only file is also tried end to end with a real worker.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import app.cache
from app.cache import RedisCache, SQLiteCache, cache_key
from app.main import create_app
from app.settings import Settings
from app.worker import Reply, ReplyKind

pytestmark = pytest.mark.service

SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
         "planner": {"confirm": "none", "curve_points": 0}}
OTHER = {**SMALL, "gpus": ["A100-80GB"]}
THIRD = {**SMALL, "gpus": ["H100-80GB"]}
WEEK = 7 * 24 * 3600
UNREACHABLE = "redis://127.0.0.1:1/0"  # nothing listens on port 1


class StubPool:
    """A pool without worker processes: estimate n answers ``{"computed": n}``."""

    ready, live = True, 1

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, body, kind="estimate", progress=None) -> Reply:
        self.runs += 1
        return Reply(self.runs, ReplyKind.OK, {"computed": self.runs})

    async def stop(self) -> None:
        pass


@contextmanager
def served(**settings) -> Iterator[tuple[TestClient, object]]:
    app = create_app(Settings(workers=1, **settings), start_workers=False)
    with TestClient(app) as client:
        app.state.pool = StubPool()
        yield client, app


def estimate(client: TestClient, body: dict) -> tuple[str, dict]:
    r = client.post("/estimate", json=body)
    assert r.status_code == 200, r.text[:500]
    return r.headers["x-batchfit-cache"], r.json()


def cache_errors(client: TestClient, op: str) -> float:
    found = re.search(rf'^batchfit_cache_errors_total{{op="{op}"}} (\S+)$', client.get("/metrics").text, re.M)
    assert found, f"no batchfit_cache_errors_total for op={op}"
    return float(found.group(1))


def readyz(client: TestClient) -> dict:
    r = client.get("/readyz")
    assert r.status_code == 200, r.text  # live workers: ready, whatever the cache's state
    return r.json()


def read_only(path: Path) -> None:
    os.chmod(path, 0o444)
    if os.geteuid() == 0:  # root writes through file modes; the immutable attribute stops root too
        subprocess.run(["chattr", "+i", str(path)], check=True)


def writable(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    os.chmod(path, 0o644)


def test_read_only_file_degrades_then_recovers_end_to_end(tmp_path) -> None:
    """A real worker: estimates are computed (200) while the file is read-only, /readyz says why, and the
    file is used again once it is writable."""
    path = tmp_path / "cache.sqlite"
    SQLiteCache(str(path), 3600).close()  # a good cache file, then read-only
    read_only(path)
    try:
        app = create_app(Settings(workers=1, queue_size=0, cache_path=str(path), cache_retry_s=0,
                                  request_timeout_s=300))
        with TestClient(app) as c:
            ready = readyz(c)
            assert ready["workers"] and ready["live_workers"] == 1 and ready["cache"] == "degraded"
            assert ready["cache_error"].startswith("open: OperationalError") and "readonly" in ready["cache_error"]
            state, first = estimate(c, SMALL)
            assert state == "miss" and first["results"][0]["max_batch_size"] > 100
            assert cache_errors(c, "open") >= 1
            writable(path)
            assert readyz(c) == {"workers": True, "live_workers": 1, "cache": "ok", "cache_error": None}
            state, second = estimate(c, SMALL)
            assert state == "miss" and second["results"] == first["results"]  # nothing was stored while read-only
            assert estimate(c, SMALL) == ("hit", second)
    finally:
        writable(path)


def test_file_corrupted_while_running_recomputes_former_hits_and_is_replaced(tmp_path) -> None:
    path = tmp_path / "cache.sqlite"
    with served(cache_path=str(path), cache_retry_s=0) as (c, _):
        assert estimate(c, SMALL) == ("miss", {"computed": 1})
        assert estimate(c, SMALL) == ("hit", {"computed": 1})
        garbage = os.urandom(path.stat().st_size)
        path.write_bytes(garbage)
        assert estimate(c, SMALL) == ("miss", {"computed": 2})  # the former hit, recomputed
        assert cache_errors(c, "get") == 1
        (aside,) = tmp_path.glob("cache.sqlite.corrupt-*")  # moved aside on the next open, a new file made
        assert aside.read_bytes() == garbage
        assert estimate(c, SMALL) == ("hit", {"computed": 2})
        assert readyz(c)["cache"] == "ok"


def test_file_deleted_while_running_is_recreated(tmp_path) -> None:
    path = tmp_path / "cache.sqlite"
    with served(cache_path=str(path), cache_retry_s=0) as (c, _):
        assert estimate(c, SMALL) == ("miss", {"computed": 1})
        path.unlink()  # SQLite keeps the unlinked file open: reads pass, writes fail (READONLY_DBMOVED)
        assert estimate(c, OTHER) == ("miss", {"computed": 2})
        assert cache_errors(c, "set") == 1
        assert estimate(c, THIRD) == ("miss", {"computed": 3})  # reopened: a new, empty file
        assert path.exists() and estimate(c, THIRD) == ("hit", {"computed": 3})
        path.unlink()
        ready = readyz(c)  # the probe writes too, so it sees the deletion
        assert ready["cache"] == "degraded" and "readonly" in ready["cache_error"]
        assert readyz(c)["cache"] == "ok" and path.exists()


def test_corrupt_file_at_startup_is_moved_aside(tmp_path) -> None:
    path = tmp_path / "cache.sqlite"
    garbage = b"not a database " * 512
    path.write_bytes(garbage)
    with served(cache_path=str(path)) as (c, _):
        assert readyz(c)["cache"] == "ok"
        (aside,) = tmp_path.glob("cache.sqlite.corrupt-*")
        assert aside.read_bytes() == garbage
        assert estimate(c, SMALL) == ("miss", {"computed": 1})
        assert estimate(c, SMALL) == ("hit", {"computed": 1})


def test_unreachable_redis_means_compute_without_the_cache() -> None:
    with served(redis_url=UNREACHABLE, cache_retry_s=3600) as (c, app):
        assert estimate(c, SMALL) == ("miss", {"computed": 1})
        assert estimate(c, SMALL) == ("miss", {"computed": 2})
        ready = readyz(c)
        assert ready["cache"] == "degraded" and ready["cache_error"].startswith("open: ConnectionError")
        assert cache_errors(c, "open") == 1 and cache_errors(c, "get") == 0  # not retried within cache_retry_s
        kwargs = app.state.cache._redis.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == 0.5 and kwargs["socket_timeout"] == 0.5


def test_a_degraded_cache_is_retried_at_a_bounded_rate(tmp_path) -> None:
    now, failed = [0.0], []
    path = tmp_path / "not-yet" / "cache.sqlite"  # its directory does not exist: SQLite cannot open it
    c = SQLiteCache(str(path), 3600, retry_s=5.0, on_error=failed.append, clock=lambda: now[0])
    assert c.error is not None and c.error.startswith("open: OperationalError") and failed == ["open"]
    for _ in range(100):
        c.set("k", {"v": 1})
        assert c.get("k") is None and not c.ping()
    assert failed == ["open"]  # no retry within retry_s
    now[0] = 5.0
    assert c.get("k") is None and failed == ["open", "open"]  # one retry, which failed
    path.parent.mkdir()
    now[0] = 10.0
    c.set("k", {"v": 1})
    assert c.error is None and c.get("k") == {"v": 1} and c.ping()
    c.close()


def redis_server(port: int, workdir: Path) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run installs it)"
    return subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_redis_that_comes_back_is_used_again(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = RedisCache(f"redis://127.0.0.1:{port}/0", WEEK, retry_s=0)
    assert c.error is not None and c.get("k") is None
    proc = redis_server(port, tmp_path)
    try:
        deadline = time.time() + 20
        while not c.ping() and time.time() < deadline:
            time.sleep(0.1)
        c.set("k", {"v": 1})
        assert c.error is None and c.get("k") == {"v": 1}
        ttl = c._redis.ttl("batchfit:k")  # the default 7 days, as Redis's own expiry
        assert WEEK - 60 < ttl <= WEEK
    finally:
        c.close()
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("library", ["timm", "torchvision", "transformers", "torch"])
def test_key_changes_with_each_model_library_version(monkeypatch, library) -> None:
    installed = app.cache.library_versions()
    assert set(installed) == set(app.cache.LIBRARIES) and installed[library] == version(library)
    before = cache_key({"model": {"source": "timm", "name": "resnet18"}})
    monkeypatch.setattr(app.cache, "library_versions", lambda: {**installed, library: "0.0.0"})
    assert cache_key({"model": {"source": "timm", "name": "resnet18"}}) != before


def test_key_changes_with_the_estimator_source(monkeypatch) -> None:
    import estimator

    assert app.cache.source_hash() == app.cache.tree_hash(Path(estimator.__file__).parent)
    before = cache_key({"x": 1})
    monkeypatch.setattr(app.cache, "source_hash", lambda: "0" * 64)
    assert cache_key({"x": 1}) != before


def test_tree_hash_covers_code_and_presets_only(tmp_path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "presets" / "gpt2.json").write_text('{"n_layer": 12}')
    (tmp_path / "a.cpython-311.pyc").write_bytes(b"\0")
    first = app.cache.tree_hash(tmp_path)
    (tmp_path / "a.cpython-311.pyc").write_bytes(b"\1")
    assert app.cache.tree_hash(tmp_path) == first  # compiled files are not the source
    (tmp_path / "presets" / "gpt2.json").write_text('{"n_layer": 24}')
    second = app.cache.tree_hash(tmp_path)
    assert second != first
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    assert app.cache.tree_hash(tmp_path) not in (first, second)  # a moved file is a change too


def test_ttl_is_seven_days_and_expired_rows_leave_the_file(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("BATCHFIT_CACHE_TTL_S", raising=False)
    assert Settings().cache_ttl_s == WEEK
    path = tmp_path / "cache.sqlite"
    c = SQLiteCache(str(path), WEEK)
    c.set("fresh", {"v": 1})
    c.set("old", {"v": 2})
    c.close()
    with sqlite3.connect(path) as db:  # "old" written 8 days ago
        db.execute("UPDATE results SET created = ? WHERE key = 'old'", (time.time() - 8 * 24 * 3600,))
    db.close()
    c = SQLiteCache(str(path), WEEK)
    assert c.get("fresh") == {"v": 1} and c.get("old") is None
    c.close()
    with sqlite3.connect(path) as db:
        assert [k for (k,) in db.execute("SELECT key FROM results")] == ["fresh"]  # deleted when opened
    db.close()


def test_a_bad_stored_value_is_a_miss_and_leaves_the_cache_up(tmp_path) -> None:
    """One row that is not our JSON (or a foreign value under our key) must not turn the cache off for
    every other request: a miss, counted as a decode error, overwritten by the recomputed answer."""
    path = tmp_path / "cache.sqlite"
    with served(cache_path=str(path), cache_retry_s=3600) as (c, app):
        assert estimate(c, SMALL)[0] == "miss" and estimate(c, OTHER)[0] == "miss"
        with sqlite3.connect(path) as db:
            db.execute("UPDATE results SET value = ? WHERE key = ?",
                       ("{not json", cache_key(_normalized(SMALL))))
            db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?)",
                       (cache_key(_normalized(THIRD)), "[1, 2]", time.time()))  # JSON, but not an answer
        assert estimate(c, SMALL)[0] == "miss" and estimate(c, THIRD)[0] == "miss"
        assert cache_errors(c, "decode") == 2
        ready = readyz(c)
        assert ready["cache"] == "ok" and ready["cache_error"] is None
        assert estimate(c, OTHER)[0] == "hit"  # the other rows still answer
        assert estimate(c, SMALL)[0] == "hit"  # the bad row was overwritten


def _normalized(body: dict) -> dict:
    from estimator import EstimateRequest

    return EstimateRequest.model_validate(body).model_dump(mode="json")
