"""A pool of estimate worker processes: time and memory limits, a bounded queue, self-healing.

The event loop never blocks: waiting on a worker happens in a thread. A
worker past ``request_timeout_s`` or ``worker_memory_bytes`` (its RSS, read
from /proc) is killed and replaced; the caller gets ``LimitExceeded``.
When every worker is busy and ``queue_size`` callers already wait, ``Busy``.
A caller cancelled (its client went away) leaves the queue, or, when its job
runs, has its worker killed at once and replaced: a torch simulation has no
cooperative cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app import logs
from app.settings import Settings
from app.worker import JobKind, Progress, Reply, serve
from estimator.errors import Busy, LimitExceeded, WorkerDied

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
Heard = Callable[[int, str], None]  # (simulations done, which one)


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

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _died(self) -> WorkerDied:
        self.process.join(1)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return WorkerDied(f"the estimate's worker process died ({how}); it was replaced: retry the request")

    def call(self, job_id: int, kind: JobKind, body: Any, limits: tuple[float, int],
             progress: Heard | None = None) -> Reply:
        """The worker's reply to the job; ``limits``: (seconds, RSS bytes); ``progress`` hears each ``Progress``
        the worker sends meanwhile (in this thread)."""
        timeout, memory = limits
        deadline = time.monotonic() + timeout
        try:
            self.conn.send((job_id, kind, body))
            while True:
                if self.conn.poll(0.1):
                    message = self.conn.recv()  # EOFError when the worker died (poll is true at EOF)
                    if isinstance(message, Progress):
                        if progress is not None:
                            progress(message.simulations, message.note)
                        continue
                    reply: Reply = message
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
        self._renewals: set[asyncio.Task] = set()
        # Its own threads: each running job holds one for up to request_timeout_s, and each renewal one, so
        # the default executor (min(32, cores + 4)) would leave cache reads and body checks queued behind them.
        self._threads = ThreadPoolExecutor(max_workers=2 * settings.workers + 2, thread_name_prefix="pool")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        workers = [_Worker(self._ctx) for _ in range(self.settings.workers)]
        await asyncio.gather(*(loop.run_in_executor(self._threads, w.wait_ready, 300.0) for w in workers))
        for w in workers:
            self._workers.append(w)
            self._idle.put_nowait(w)
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await asyncio.gather(*self._renewals, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, w.stop) for w in self._workers))
        self._workers.clear()
        self._threads.shutdown(wait=False)

    @property
    def busy(self) -> int:
        return len(self._workers) - self._idle.qsize()

    @property
    def live(self) -> int:
        """Worker processes alive now (a dead one is replaced when next handed out or when its job fails)."""
        return sum(w.alive for w in self._workers)

    def _renew(self, worker: _Worker, reason: str, running: asyncio.Future | None = None) -> asyncio.Task:
        """Kill ``worker`` now and replace it in a task of its own, which a caller's cancellation does not
        stop; the fresh worker joins the idle queue when it is ready. ``running``: the thread still waiting
        on ``worker`` (it returns once the worker is dead; the pipe is closed after it)."""
        if worker.alive:
            worker.process.kill()
        task = asyncio.ensure_future(self._replace(worker, reason, running))
        self._renewals.add(task)
        task.add_done_callback(self._renewed)
        return task

    def _renewed(self, task: asyncio.Task) -> None:
        self._renewals.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the pool is a worker short
            logs.log("worker not replaced", error=repr(task.exception()))

    async def _replace(self, worker: _Worker, reason: str, running: asyncio.Future | None) -> None:
        loop = asyncio.get_running_loop()
        if running is not None:
            await asyncio.wait([running])
            if not running.cancelled():
                running.exception()  # retrieved: its WorkerDied is the kill's expected echo
        self._workers.remove(worker)
        await loop.run_in_executor(self._threads, worker.kill)
        self.restarts += 1
        if not self.ready:  # stopping: no replacement
            return
        fresh = _Worker(self._ctx)
        try:
            await loop.run_in_executor(self._threads, fresh.wait_ready, 300.0)
        except BaseException:
            await loop.run_in_executor(self._threads, fresh.kill)
            raise
        self._workers.append(fresh)
        self._idle.put_nowait(fresh)
        logs.log("worker replaced", reason=reason, old_pid=worker.pid, pid=fresh.pid)

    async def run(self, body: Any, kind: JobKind = JobKind.ESTIMATE, progress: Heard | None = None) -> Reply:
        """A worker's reply to the job ``kind`` asks of ``body``; ``Busy``, ``LimitExceeded`` or ``WorkerDied``
        otherwise (then the worker is replaced before the error is raised). Cancelled: a job still queued
        leaves the queue; a running job's worker is killed at once and replaced in the background.
        ``progress(simulations, note)`` hears each full simulation (called in a pool thread)."""
        if self._idle.empty() and self._waiting >= self.settings.queue_size:
            raise Busy()
        self._waiting += 1
        try:
            worker = await self._idle.get()
            while not worker.alive:  # died while idle
                await asyncio.shield(self._renew(worker, "died while idle"))
                worker = await self._idle.get()
        except asyncio.CancelledError:
            logs.log("estimate cancelled", state="queued")
            raise
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        s = self.settings
        job = next(self._ids)
        call = loop.run_in_executor(self._threads, worker.call, job, kind, body,
                                    (s.request_timeout_s, s.worker_memory_bytes), progress)
        try:
            reply: Reply = await asyncio.shield(call)  # the shield keeps the thread's future for _renew
        except (LimitExceeded, WorkerDied) as exc:
            await asyncio.shield(self._renew(worker, type(exc).__name__))
            raise
        except asyncio.CancelledError:
            logs.log("estimate cancelled", state="running", job=job, pid=worker.pid)
            self._renew(worker, "cancelled", running=call)
            raise
        except BaseException:
            self._idle.put_nowait(worker)
            raise
        self._idle.put_nowait(worker)
        return reply
