"""One function run in a forked child while the parent works on something else.

The planner needs full simulations at two batch sizes before it can do
anything else; each takes one core for most of a second. The second runs in
a child forked from the warm process (the model code, torch's kernels and
the fake-tensor cache are already loaded) and comes back pickled.

>>> job = Background(lambda: record_training(...))               # doctest: +SKIP
>>> trace = job.result(timeout=5.0) or record_training(...)

Anything unusual and the caller computes the value itself: ``result`` is
``None`` when fork is unavailable, the child failed or is stuck: it used no
CPU for the timeout (then it is killed). A child still working is waited
for, however long it takes: it is further along than the caller would be
computing the value from the start. The child dies with its parent (Linux
``PR_SET_PDEATHSIG``), so a service worker killed at its time limit leaves
nothing running.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import select
import signal
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1

# a prefetched value whose child used no CPU this long is stuck: killed, and computed by the caller instead
STUCK_S = 5.0

# this process's children not yet collected or closed (weakly: one dropped unclosed is killed by __del__)
_jobs: weakref.WeakSet[Background] = weakref.WeakSet()
_in_child = False  # this process is itself a Background child
_exiting: set[int] = set()  # children whose value came back, not reaped yet (``_reap``)


def enabled() -> bool:
    """Whether a second simulation may run beside the first: more than one core and
    ``BATCHFIT_PARALLEL`` not ``0``."""
    return hasattr(os, "fork") and (os.cpu_count() or 1) > 1 and os.environ.get("BATCHFIT_PARALLEL", "1") != "0"


class Background:
    """``fn()`` in a forked child; ``result`` collects it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.pid: int | None = None
        self.fd: int | None = None
        _reap()
        parent = os.getpid()
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork with threads running
            pid = os.fork()
        if pid == 0:  # the child: never returns
            global _in_child
            _in_child = True
            # the collector leaves the parent's objects alone: a collection here neither scans them (gen 2 is
            # the whole warm process) nor writes their headers (copying every page the fork shares)
            gc.freeze()
            _jobs.clear()  # the parent's children are not this one's
            os.close(read)
            code = 1
            try:
                _die_with(parent)
                data = pickle.dumps(fn(), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(write, "wb") as out:
                    out.write(data)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent computes the value itself
                pass
            finally:
                os._exit(code)
        os.close(write)
        self.pid, self.fd = pid, read
        _jobs.add(self)

    def result(self, timeout: float) -> Any | None:
        """The child's value, or None: failed, stuck (no CPU time used for ``timeout`` seconds; where its CPU
        time cannot be read, not done within ``timeout`` seconds) and killed, or unpicklable."""
        if self.pid is None or self.fd is None:
            return None
        try:
            if not self._wait(timeout):
                return None
            with os.fdopen(self.fd, "rb") as src:
                self.fd = None
                data = src.read()
            # the value is complete once the pipe closes (a child that failed wrote nothing, one killed while
            # writing left a truncated pickle, which does not load): not waited for while it exits, which
            # unmaps the warm process's memory (~20-40 ms), but reaped by a later call (``_reap``)
            _exiting.add(self.pid)
            self.pid = None
            _reap()
            return pickle.loads(data) if data else None
        except Exception:  # noqa: BLE001 - the caller computes the value itself
            return None
        finally:
            self.close()

    def _wait(self, timeout: float) -> bool:
        """Whether the child's value is ready before it sits ``timeout`` seconds without using CPU."""
        assert self.fd is not None and self.pid is not None
        used, idle_since = _cpu_ticks(self.pid), time.monotonic()
        while not select.select([self.fd], [], [], min(timeout, 0.25))[0]:
            now, ticks = time.monotonic(), _cpu_ticks(self.pid)
            if ticks is not None and used is not None and ticks > used:
                used, idle_since = ticks, now  # still working
            elif now - idle_since >= timeout:
                return False
        return True

    def working(self) -> bool:
        """Whether the child is still computing (its value not written yet)."""
        return self.fd is not None and not select.select([self.fd], [], [], 0)[0]

    def close(self) -> None:
        """Kill the child if it still runs, and reap it."""
        _jobs.discard(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _reap() -> None:
    """Reap the children in ``_exiting`` that have exited (none waited for)."""
    for pid in list(_exiting):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid  # reaped elsewhere
        if done:
            _exiting.discard(pid)


def spare_core() -> bool:
    """Whether work may be split with a child now: background runs are enabled, this process is not itself a
    child, and none of its children is still computing (each takes a core)."""
    return enabled() and not _in_child and not any(job.working() for job in list(_jobs))


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time ``pid`` has used (user and system, in clock ticks); None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5), after pid and comm
    except (OSError, IndexError, ValueError):
        return None


def _die_with(parent: int) -> None:
    """Ask Linux to kill this process when its parent dies; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
