"""Helpers the test modules share (fixtures live in conftest.py): the cards most tests use, the service under
test, its problem documents, metrics and paused workers, and the model a parsed request builds."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from estimator.gpus import get_gpu
from estimator.models import BuiltModel, build
from estimator.request.adapt import job_of

A100_80, A100_40, T4 = get_gpu("A100-80GB"), get_gpu("A100-40GB"), get_gpu("T4-16GB")
PROBLEM = "application/problem+json"  # the media type of every non-2xx answer


@contextmanager
def service(cache: Path | None = None, *, start_workers: bool = True, raise_server_exceptions: bool = True,
            **settings: Any) -> Iterator[Any]:
    """A ``TestClient`` of the service: one worker, ``cache`` its SQLite file (none when None), ``settings``
    any other ``app.settings.Settings`` field; e.g. ``with service(start_workers=False) as client: ...``."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(**{"workers": 1, "cache_path": str(cache) if cache else "", **settings}),
                     start_workers=start_workers)
    with TestClient(app, raise_server_exceptions=raise_server_exceptions) as client:
        yield client


@contextmanager
def paused_workers(app: Any) -> Iterator[list[int]]:
    """The service's worker processes stopped (SIGSTOP) inside the block, continued after it; their pids. A job
    sent meanwhile waits in its worker however fast it would run: what happens while an estimate runs, tested
    without an estimate slow enough to race."""
    pids = [w.pid for w in app.state.pool._workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed inside the block


def metric(client: Any, name: str) -> float:
    """A sample's value in the service's /metrics (0 when absent); ``name`` with its labels, as printed."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def build_request(request: Any) -> BuiltModel:
    """The model of a parsed request, as the pipeline builds it."""
    job = job_of(request)
    return build(job.model, job.input)
