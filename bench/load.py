"""Bounded concurrent clients against `batchfit serve` on 127.0.0.1.

Prints, measured in one run: p50/p99 latency and throughput for cache
misses (distinct requests, 2 clients) and cache hits (the same requests
again, 8 clients), and /healthz p99 while two estimates run.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.ready import wait_ready

N = 12


def _request(i: int) -> dict:
    return {"model": {"source": "torchvision", "name": "resnet18", "kwargs": {"num_classes": 10 + i}},
            "gpus": ["T4-16GB"], "planner": {"confirm": "none", "curve_points": 0}}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _run(client: httpx.AsyncClient, bodies: list[dict], concurrency: int) -> tuple[list[float], float]:
    sem, latencies = asyncio.Semaphore(concurrency), []

    async def one(body):
        async with sem:
            t0 = time.perf_counter()
            r = await client.post("/estimate", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return latencies, len(bodies) / (time.perf_counter() - t0)


async def main(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        misses, miss_rps = await _run(client, [_request(i) for i in range(N)], 2)
        hits, hit_rps = await _run(client, [_request(i) for i in range(N)] * 20, 8)
        print(f"misses: p50 {statistics.median(misses):.2f} s  p99 {_pct(misses, 99):.2f} s  {miss_rps:.2f} req/s")
        print(f"hits:   p50 {statistics.median(hits) * 1e3:.1f} ms  p99 {_pct(hits, 99) * 1e3:.1f} ms  "
              f"{hit_rps:.0f} req/s")
        running = [asyncio.create_task(client.post("/estimate", json=_request(100 + i))) for i in range(2)]
        await asyncio.sleep(0.5)
        health = []
        while not all(t.done() for t in running) and len(health) < 2000:
            t0 = time.perf_counter()
            (await client.get("/healthz")).raise_for_status()
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        await asyncio.gather(*running)
        print(f"/healthz while 2 estimates run: p50 {statistics.median(health) * 1e3:.1f} ms  "
              f"p99 {_pct(health, 99) * 1e3:.1f} ms over {len(health)} calls")


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
    env = {**os.environ, "BATCHFIT_WORKERS": "2", "BATCHFIT_CACHE_PATH": str(Path(tmp) / "cache.sqlite")}
    exe = str(Path(sys.executable).with_name("batchfit"))
    server = subprocess.Popen([exe, "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        asyncio.run(main(url))
    finally:
        server.terminate()
        server.wait(30)
