"""Every error as application/problem+json (RFC 9457), naming the field, the value and what was expected."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from estimator.errors import SpecError
from estimator.spec import _expected, _path

PROBLEM = "application/problem+json"


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


def problem_responses(*codes: int) -> dict:
    text = {401: "missing or wrong API key", 422: "a field batchfit cannot use, a model that cannot be simulated, "
            "or an estimate past the service's limits", 503: "every worker busy and the queue full (Retry-After)",
            500: "a batchfit defect (never for bad input)"}
    return {c: {"model": Problem, "description": text[c], "content": {PROBLEM: {}}} for c in codes}


def problem(status: int, kind: str, title: str, detail: str, headers: dict | None = None, **extra: Any) -> JSONResponse:
    body = {"type": f"https://batchfit.dev/problems/{kind}", "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def spec_problem(exc: SpecError) -> JSONResponse:
    return problem(422, "invalid-request", "The request has a field batchfit cannot use", str(exc),
                   field=exc.field, value=_safe(exc.value), expected=exc.expected)


async def on_spec_error(request: Request, exc: SpecError) -> JSONResponse:
    return spec_problem(exc)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = tuple(err["loc"])[1:] if err["loc"] and err["loc"][0] == "body" else tuple(err["loc"])
    field = _path(loc) or "(body)"
    value = None if err["type"] == "missing" else err.get("input")
    expected = _expected(err)
    return problem(422, "invalid-request", "The request has a field batchfit cannot use",
                   f"{field}: got {_safe(value)!r}; expected {expected}", field=field, value=_safe(value),
                   expected=expected)


def _safe(value: Any) -> Any:
    """The offending value, small enough to echo back."""
    text = repr(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, str):
        return value[:200]
    return text[:200]
