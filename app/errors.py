"""Every error as application/problem+json (RFC 9457), naming the field, the value and what was expected.

One table maps each of batchfit's error types to its HTTP status, problem
type and title; one handler renders them all (``on_batchfit_error``). The
most specific type in the table wins, as in httpx's exception mapping.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from estimator import describe_validation_error
from estimator.errors import (
    BatchfitError,
    Busy,
    LimitExceeded,
    MissingExtraError,
    NoGPUError,
    NotStored,
    SimulationError,
    SpecError,
    StoreUnavailable,
    Unauthorized,
    WorkerDied,
)

PROBLEM = "application/problem+json"

# error type -> (status, problem type, title)
PROBLEMS: dict[type[BatchfitError], tuple[int, str, str]] = {
    BatchfitError: (500, "internal", "batchfit failed"),
    SpecError: (422, "invalid-request", "The request has a field batchfit cannot use"),
    SimulationError: (422, "simulation", "The model could not be simulated"),
    NoGPUError: (503, "no-gpu", "No CUDA GPU on this node"),
    MissingExtraError: (503, "missing-extra", "This node lacks an optional part of batchfit"),
    Unauthorized: (401, "unauthorized", "An API key is required"),
    Busy: (503, "busy", "Every worker is busy"),
    LimitExceeded: (422, "limit", "The estimate ran past a limit of the service"),
    WorkerDied: (503, "worker-died", "The estimate's worker died"),
    NotStored: (404, "profile-not-found", "No such stored profile"),
    StoreUnavailable: (503, "store-unavailable", "The profile store cannot be used now"),
}


class Problem(BaseModel):
    """RFC 9457 problem details; request errors add ``field``, ``value`` and ``expected``."""

    type: str
    title: str
    status: int
    detail: str
    field: str | None = None
    value: Any = None
    expected: str | None = None
    where: str | None = None


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "a body that is not valid JSON (`field` \"(body)\", `expected` names the line and column) "
                 "or cannot be decoded", 401: "missing or wrong API key",
            404: "no stored profile of that id",
            413: "a body over BATCHFIT_MAX_BODY_BYTES (a profile's: BATCHFIT_MAX_PROFILE_BYTES)",
            415: "a body that is not application/json",
            422: "a field batchfit cannot use, a model that cannot be simulated, "
                 "or an estimate past the service's limits",
            503: "every worker busy and the queue full (Retry-After), or the profile store down",
            500: "a batchfit defect (never for bad input)"}
    return {c: {"model": Problem, "description": text[c], "content": {PROBLEM: {}}} for c in codes}


def problem(status: int, kind: str, title: str, detail: str, headers: dict[str, str] | None = None,
            **extra: Any) -> JSONResponse:
    body = {"type": f"https://batchfit.dev/problems/{kind}", "title": title, "status": status, "detail": detail,
            **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def _mapped(exc: BatchfitError) -> tuple[int, str, str]:
    found: type[BatchfitError] = BatchfitError
    for kind in PROBLEMS:
        if isinstance(exc, kind) and issubclass(kind, found):
            found = kind
    return PROBLEMS[found]


def error_problem(exc: BatchfitError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The problem+json response for one of batchfit's errors."""
    status, kind, title = _mapped(exc)
    extra: dict[str, Any] = {}
    detail = str(exc)
    if isinstance(exc, SpecError):
        value = _safe(exc.value)
        extra = {"field": exc.field, "value": value, "expected": exc.expected}
        detail = f"{exc.field}: got {value!r}; expected {exc.expected}"  # the value as echoed, cut short
    elif isinstance(exc, SimulationError):
        extra = {"where": exc.where}
    elif isinstance(exc, NotStored):
        extra = {"field": exc.field, "value": _safe(exc.value)}
    elif isinstance(exc, LimitExceeded):
        kind = f"{exc.limit}-limit"
    return problem(status, kind, title, detail[:2000], headers, **extra)


# The answers of the HTTP layer (routing, body parsing, the middleware) by status: kind and title.
HTTP_PROBLEMS = {
    400: ("bad-request", "The request body cannot be read"),
    404: ("not-found", "No such route"),
    405: ("method-not-allowed", "The route does not take this method"),
    413: ("too-large", "The request body is too large"),
    415: ("unsupported-media-type", "The request body must be application/json"),
    422: PROBLEMS[SpecError][1:],
    499: ("client-closed", "The client closed the connection before the answer"),
    500: PROBLEMS[BatchfitError][1:],
    503: ("unavailable", "The service cannot answer now"),
}


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's HTTPException (404, 405, a body FastAPI cannot decode: 400) as problem+json; a 400
    names why the body could not be read (not UTF-8, nested too deep, an integer too long)."""
    assert isinstance(exc, StarletteHTTPException)
    kind, title = HTTP_PROBLEMS.get(exc.status_code, ("http-error", "The request failed"))
    detail = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:
        detail = f"{detail}: {type(exc.__cause__).__name__}: {exc.__cause__}"
    return problem(exc.status_code, kind, title, detail[:200], dict(exc.headers or {}) or None)


def unsupported_media_type(received: str | None) -> JSONResponse:
    """415 for a body sent as anything but JSON (``application/json``, parameters allowed, or
    ``application/*+json``), before the body is read."""
    kind, title = HTTP_PROBLEMS[415]
    value = _safe(received)
    got = "no Content-Type" if received is None else f"Content-Type {value!r}"
    return problem(415, kind, title, f"the body came with {got}; expected application/json",
                   {"Accept-Post": "application/json"}, field="Content-Type", value=value,
                   expected="application/json")


async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception (a batchfit defect) as a 500 problem; Starlette re-raises it afterwards, so
    the server logs its traceback."""
    kind, title = HTTP_PROBLEMS[500]
    return problem(500, kind, title, f"{type(exc).__name__}: {exc}"[:200])


async def on_batchfit_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BatchfitError)
    return error_problem(exc)


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return _invalid_json(first, exc.body)
    err = describe_validation_error(first)
    value = _safe(err.value)
    status, kind, title = PROBLEMS[SpecError]
    return problem(status, kind, title, f"{err.field}: got {value!r}; expected {err.expected}", field=err.field,
                   value=value, expected=err.expected)


def _invalid_json(err: dict[str, Any], doc: Any) -> JSONResponse:
    """400 for a body that is not JSON: where it stops being JSON (line, column, character) and why, with
    the text around that place as ``value``."""
    pos = err["loc"][-1] if isinstance(err["loc"][-1], int) else 0
    text = doc if isinstance(doc, str) else ""
    line, column = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
    why = (err.get("ctx") or {}).get("error", "not JSON")
    expected = f"valid JSON: {why} at line {line} column {column} (char {pos})"
    value = _safe(text[max(0, pos - 30):pos + 30])
    kind, title = HTTP_PROBLEMS[400]
    return problem(400, kind, title, f"(body): got {value!r}; expected {expected}", field="(body)", value=value,
                   expected=expected)


def _safe(value: Any) -> Any:
    """The offending value, small enough to echo back (and renderable: NaN and infinities as text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**200:
        return repr(value)[:200]
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, str):
        return value[:200]
    return repr(value)[:200]
