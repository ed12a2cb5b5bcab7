"""The worker process side of the pool: one estimate at a time, never crashing the parent.

Each worker imports torch once (warm) and answers ``(job_id, request_json)``
messages with ``(job_id, kind, payload)``: ``ok`` with the API.md response,
``spec`` with (field, value, expected), ``simulation`` with (message, where),
``error`` with a message. Requests come as JSON data only: custom factories
are refused by ``parse_request`` (no local code over the network).
"""

from __future__ import annotations

import json
import os
import signal
from multiprocessing.connection import Connection
from typing import Any


def serve(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from estimator.errors import SimulationError, SpecError
    from estimator.estimate import estimate
    from estimator.spec import parse_request
    from estimator.validate import NoGPUError

    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        job_id, body = message
        try:
            request = parse_request(body, allow_local_code=False)
            if request.validate_step:
                from estimator.validate import as_json, validate

                response, validation = validate(request)
                reply: tuple[Any, ...] = (job_id, "ok", {**json.loads(response.model_dump_json()),
                                                         "validation": as_json(validation)})
            else:
                response = estimate(request)
                reply = (job_id, "ok", json.loads(response.model_dump_json()))
        except SpecError as exc:
            reply = (job_id, "spec", (exc.field, _jsonable(exc.value), exc.expected))
        except NoGPUError as exc:
            reply = (job_id, "nogpu", str(exc))
        except SimulationError as exc:
            reply = (job_id, "simulation", (str(exc), exc.where))
        except MemoryError:
            reply = (job_id, "memory", "the estimate ran out of memory in the worker")
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the worker lives on
            reply = (job_id, "error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
