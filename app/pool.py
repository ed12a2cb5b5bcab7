"""A pool of estimate worker processes: time and memory limits, a bounded queue, self-healing.

The event loop never blocks: waiting on a worker happens in a thread. A
worker past ``request_timeout_s`` or ``worker_memory_bytes`` (its RSS, read
from /proc) is killed and replaced; the caller gets ``LimitExceeded``.
When every worker is busy and ``queue_size`` callers already wait, ``Busy``.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import time
from typing import Any

from app.settings import Settings
from app.worker import Reply, serve
from estimator.errors import Busy, LimitExceeded, WorkerDied

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise RuntimeError("worker did not start")
        self.conn.recv()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def _died(self) -> WorkerDied:
        self.process.join(1)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return WorkerDied(f"the estimate's worker process died ({how}); it was replaced: retry the request")

    def call(self, job_id: int, body: Any, timeout: float, memory: int) -> Reply:
        deadline = time.monotonic() + timeout
        try:
            self.conn.send((job_id, body))
            while True:
                if self.conn.poll(0.1):
                    reply: Reply = self.conn.recv()  # EOFError when the worker died (poll is true at EOF)
                    return reply
                if not self.process.is_alive():
                    raise self._died()
                if time.monotonic() > deadline:
                    raise LimitExceeded("time", f"the estimate ran past the service's time limit of {timeout:g} s")
                if _rss(self.process.pid) > memory:
                    raise LimitExceeded("memory", f"the estimate passed the service's memory limit of "
                                                  f"{memory // 2**20} MiB")
        except (EOFError, OSError) as exc:
            raise self._died() from exc
    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


class Pool:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ctx = mp.get_context("spawn")  # no fork after torch is imported
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: list[_Worker] = []
        self._waiting = 0
        self._ids = itertools.count()
        self.ready = False
        self.restarts = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        workers = [_Worker(self._ctx) for _ in range(self.settings.workers)]
        await asyncio.gather(*(loop.run_in_executor(None, w.wait_ready, 300.0) for w in workers))
        for w in workers:
            self._workers.append(w)
            self._idle.put_nowait(w)
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, w.stop) for w in self._workers))
        self._workers.clear()

    @property
    def busy(self) -> int:
        return len(self._workers) - self._idle.qsize()

    @property
    def live(self) -> int:
        """Worker processes alive now (a dead one is replaced when next handed out or when its job fails)."""
        return sum(w.alive for w in self._workers)

    async def _replace(self, worker: _Worker) -> _Worker:
        loop = asyncio.get_running_loop()
        self._workers.remove(worker)
        await loop.run_in_executor(None, worker.kill)
        fresh = _Worker(self._ctx)
        await loop.run_in_executor(None, fresh.wait_ready, 300.0)
        self._workers.append(fresh)
        self.restarts += 1
        return fresh

    async def run(self, body: Any) -> Reply:
        """A worker's reply; ``Busy``, ``LimitExceeded`` or ``WorkerDied`` otherwise (then the worker is
        replaced before it is handed out again)."""
        if self._idle.empty() and self._waiting >= self.settings.queue_size:
            raise Busy()
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        s = self.settings
        try:
            if not worker.alive:  # died while idle
                worker = await self._replace(worker)
            return await loop.run_in_executor(None, worker.call, next(self._ids), body, s.request_timeout_s,
                                              s.worker_memory_bytes)
        except (LimitExceeded, WorkerDied):
            worker = await self._replace(worker)
            raise
        finally:
            self._idle.put_nowait(worker)
