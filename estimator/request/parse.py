"""The seam where a decoded JSON request becomes an ``EstimateRequest``, or a ``SpecError`` naming the field path
(``model.name``, ``gpus[1]``), the value and what was expected: pydantic's errors are translated here, once.

>>> parse_request({"model": {"source": "timm", "name": "resnet18"}, "gpus": "T4-16GB"})   # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
estimator.errors.SpecError: gpus: got 'T4-16GB'; expected a valid list
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from estimator.errors import SpecError
from estimator.models.registry import sources
from estimator.request.spec import EstimateRequest, check_request

# union branches: the model sources, JSON types, a card entry's kinds, POST /estimate's two bodies
_BRANCHES = {*sources(), "str", "int", "float", "bool", "CustomGPUSpec", "EstimateRequest", "ProfileEstimateRequest"}
FIXED_ERROR = "fixed_by_profile"  # estimator.request.profile's error type: the fields a profile fixes
M = TypeVar("M", bound=BaseModel)


def _is_branch(part: object) -> bool:
    """A union branch name pydantic puts in an error's location, not a field."""
    return isinstance(part, str) and (part in _BRANCHES or part.startswith(("literal[", "list[", "dict[")))


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_branch(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _lookup(data: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        elif _is_branch(part):
            continue
        else:
            return None
    return data


def parse_request(data: Any, *, allow_local_code: bool = False) -> EstimateRequest:
    """Validate a decoded JSON request; ``SpecError`` names the first bad field."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SpecError("(body)", data[:80], f"a JSON object ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise SpecError("(body)", data, "a JSON object with at least 'model'")
    return check_request(validated(EstimateRequest, data), allow_local_code=allow_local_code)


def validated(schema: type[M], data: Any) -> M:
    """``schema.model_validate(data)``, its first error as a ``SpecError`` naming the field."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == FIXED_ERROR:  # fields a profile fixes, named at once
            raise describe_validation_error(dict(errors[0])) from exc
        # A union reports one error per branch: keep the deepest (the branch
        # the value was meant for); equally deep ones are alternatives.
        first = _path(errors[0]["loc"])
        same = [e for e in errors if _path(e["loc"]).startswith(first)] or errors[:1]
        deepest = max(len(e["loc"]) for e in same)
        chosen = [e for e in same if len(e["loc"]) == deepest]
        err = chosen[0]
        loc = tuple(err["loc"])
        value = None if err["type"] == "missing" else err.get("input", _lookup(data, loc))
        expected = " or ".join(dict.fromkeys(_expected(e) for e in chosen))
        raise SpecError(_path(loc) or "(body)", value, expected) from exc


def _expected(err: Mapping[str, Any]) -> str:
    kind, ctx, msg = err["type"], err.get("ctx", {}), err["msg"]
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "extra_forbidden":
        return "no such field (the request's fields are listed at GET /docs)"
    if kind in ("literal_error", "enum"):
        return f"one of {ctx.get('expected', '')}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return msg.replace("Input should be ", "a number ")
    if kind == "union_tag_invalid":
        return f"model.source one of {ctx.get('expected_tags', '')}"
    if kind == "union_tag_not_found":
        remote = [name for name, s in sources().items() if not s.local_code]
        return f"a 'source' field: {', '.join(remote[:-1])} or {remote[-1]}"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "model_type" or kind == "dict_type":
        return "an object {name, memory_bytes, compute_capability}" if "CustomGPUSpec" in err["loc"] else "an object"
    return msg.replace("Input should be ", "")


def describe_validation_error(err: dict[str, Any]) -> SpecError:
    """One pydantic error (FastAPI's, its location under ``body``) as a ``SpecError``: field, value, expected."""
    loc = tuple(err["loc"])
    loc = loc[1:] if loc and loc[0] == "body" else loc
    if err["type"] == FIXED_ERROR:  # the first of them is the field; all of them the value
        fields = err["ctx"]["fields"].split(", ")
        return SpecError(fields[0], fields, err["ctx"]["expected"])
    value = None if err["type"] == "missing" else err.get("input")
    return SpecError(_path(loc) or "(body)", value, _expected(err))
