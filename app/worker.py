"""The worker process side of the pool: one estimate at a time, never crashing the parent.

Each worker imports torch once (warm) and answers ``(job_id, kind, request)``
messages (a ``JobKind`` and an ``EstimateRequest`` the service parsed, or a ``ProfileJob``, sent pickled) with
a ``Reply``:

- ``OK``: what the job's kind asks for: ``ESTIMATE``, the response's JSON (docs/API.md), with ``validation``
  when the request asked for one; ``TIMELINE``, the first card's step's timeline as JSON; ``SNAPSHOT``, that
  step as a CUDA memory snapshot, pickled (bytes);
- ``ERROR``: any of batchfit's errors (estimator/errors.py: ``SpecError`` and ``UnknownGPUError``,
  ``SimulationError`` and its kinds, ``NoGPUError``, ``MissingExtraError``, ``ReplayError``, or
  ``LimitExceeded('memory')`` when the worker ran out of memory) as its class name and fields
  (``BatchfitError.fields``), rebuilt as the same type by the parent with ``Reply.error()``;
- ``INTERNAL``: any other exception's type and message (a batchfit defect: 500).

Requests are data only: custom factories are refused by ``check_request``
here as in the route (no local code over the network).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import signal
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import Any

from estimator import EstimateRequest, errors


class JobKind(StrEnum):
    """What a job asks of the request (the route it came by)."""

    ESTIMATE = "estimate"  # POST /estimate
    TIMELINE = "timeline"  # POST /timeline
    SNAPSHOT = "snapshot"  # POST /snapshot


@dataclass(frozen=True)
class Progress:
    """A worker's word while its job runs: full simulation ``simulations`` is done (``note``: which one)."""

    job_id: int
    simulations: int
    note: str


@dataclass(frozen=True)
class ProfileJob:
    """``POST /estimate`` by profile, as a worker takes it: the profile (checked by the route, checked again
    here), its id, and what the answer varies (``gpus``, ``batch_size``, the ``planner`` fields set)."""

    profile_id: str
    profile: dict[str, Any]
    options: dict[str, Any]

    def key_doc(self) -> dict[str, Any]:
        """What the answer depends on, for its cache key: the profile by id, and the options."""
        return {"profile": self.profile_id, **self.options}


class ReplyKind(StrEnum):
    OK = "ok"
    ERROR = "error"
    INTERNAL = "internal"


@dataclass(frozen=True)
class Reply:
    """What a worker answers: ``payload`` is the response (OK), the error's fields (ERROR, with ``error_type``)
    or a message (INTERNAL)."""

    job_id: int
    kind: ReplyKind
    payload: Any
    error_type: str = ""

    @classmethod
    def failed(cls, job_id: int, exc: errors.BatchfitError) -> Reply:
        fields = {k: _jsonable(v) for k, v in exc.fields().items()}
        return cls(job_id, ReplyKind.ERROR, fields, type(exc).__name__)

    def error(self) -> errors.BatchfitError:
        """The error an ERROR reply carries, rebuilt as its own type."""
        cls = getattr(errors, self.error_type, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.BatchfitError)):
            return errors.BatchfitError(f"{self.error_type}: {self.payload}")
        return cls.from_fields(self.payload)


def serve(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Defence in depth, read when huggingface_hub is first imported (below, not before): a request that
    # names a file or a Hub id is refused before any library sees it (estimator/request/allowed.py).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from estimator import (
        check_profile,
        estimate,
        estimate_from_profile,
        snapshot,
        timeline,
        to_json,
        validate_on_gpu,
        validation_json,
        warm_up,
    )

    warm_up()  # the model libraries imported once here rather than in each cold estimate; torch's lazy state set up
    # what the imports made lives as long as the worker: out of the collector's way (its full collections no longer
    # scan it: ~0.3 s each inside an estimate of a deep model), and of forked children's (estimator.simulate.background)
    gc.freeze()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        job_id, kind, body = message
        try:
            if isinstance(body, ProfileJob):  # answered from the profile's traces: no model, no simulation
                profile = check_profile(body.profile)
                reply = Reply(job_id, ReplyKind.OK, to_json(estimate_from_profile(profile, **body.options)))
            elif kind == JobKind.TIMELINE:
                reply = Reply(job_id, ReplyKind.OK, dataclasses.asdict(timeline(_checked(body))))
            elif kind == JobKind.SNAPSHOT:
                reply = Reply(job_id, ReplyKind.OK, pickle.dumps(snapshot(_checked(body))))
            elif (request := _checked(body)).validate_step:
                response, validation = validate_on_gpu(request)
                reply = Reply(job_id, ReplyKind.OK, {**to_json(response), "validation": validation_json(validation)})
            else:
                reply = Reply(job_id, ReplyKind.OK, to_json(estimate(request, progress=_progress(conn, job_id))))
        except errors.BatchfitError as exc:
            reply = Reply.failed(job_id, exc)
        except MemoryError:
            reply = Reply.failed(job_id, errors.LimitExceeded("memory", "the estimate ran out of memory in the "
                                                                       "worker"))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the worker lives on
            reply = Reply(job_id, ReplyKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def _checked(body: Any) -> Any:
    """The request a job carries, checked here as in the route: data only, no local code."""
    from estimator import check_request, parse_request

    if isinstance(body, EstimateRequest):
        return check_request(body, allow_local_code=False)
    return parse_request(body, allow_local_code=False)


def _progress(conn: Connection, job_id: int) -> Any:
    """What ``estimate`` calls after each full simulation: a ``Progress`` to the parent, counted over the job."""
    count = [0]

    def tell(done: int, note: str) -> None:
        count[0] += 1
        conn.send(Progress(job_id, count[0], note))
    return tell


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
