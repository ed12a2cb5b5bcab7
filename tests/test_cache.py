"""The result cache: SQLite and a real redis-server (Debian's package), and single flight."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest

from app.cache import RedisCache, SingleFlight, SQLiteCache, cache_key

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    exe = shutil.which("redis-server")
    assert exe, "redis-server is required (Debian: apt-get install redis-server; .ci/run installs it)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.time() + 20
    while RedisCache(url, 0).ping() is False and time.time() < deadline:
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["sqlite", "redis"])
def cache(request, tmp_path):
    if request.param == "sqlite":
        c = SQLiteCache(str(tmp_path / "c.sqlite"), ttl_s=3600)
    else:
        c = RedisCache(request.getfixturevalue("redis_url"), ttl_s=3600)
    yield c
    c.close()


def test_round_trip(cache) -> None:
    key = cache_key({"model": {"source": "timm", "name": "resnet18"}})
    assert cache.ping()
    assert cache.get(key) is None
    cache.set(key, {"results": [1, 2, 3]})
    assert cache.get(key) == {"results": [1, 2, 3]}


def test_key_covers_versions_and_is_order_independent() -> None:
    a = cache_key({"x": 1, "y": {"b": 2, "a": 1}})
    b = cache_key({"y": {"a": 1, "b": 2}, "x": 1})
    assert a == b and a != cache_key({"x": 2, "y": {"a": 1, "b": 2}})


def test_sqlite_ttl(tmp_path) -> None:
    c = SQLiteCache(str(tmp_path / "c.sqlite"), ttl_s=1)
    c.set("k", {"v": 1})
    assert c.get("k") == {"v": 1}
    time.sleep(1.1)
    assert c.get("k") is None


def test_identical_concurrent_requests_are_computed_once() -> None:
    flights, calls = SingleFlight(), []

    async def compute():
        calls.append(1)
        await asyncio.sleep(0.05)
        return "answer"

    async def main():
        return await asyncio.gather(*(flights.run("same", compute) for _ in range(5)), flights.run("other", compute))

    assert asyncio.run(main()) == ["answer"] * 6
    assert len(calls) == 2  # one for "same", one for "other"


def test_service_uses_redis_when_configured(redis_url) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(workers=1, redis_url=redis_url), start_workers=False)
    with TestClient(app) as c:
        assert isinstance(app.state.cache, RedisCache)
        assert c.get("/readyz").json()["cache"] == "ok"
