"""A portable profile's strict schema: every field's type, length and range, before anything reads it.

>>> check_profile_doc({"schema": "batchfit.profile", "version": 2})          # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
estimator.errors.SpecError: profile.version: got 2; expected 3: a profile of this batchfit's schema (re-run ...

A profile is data that crosses machines (the service stores what a client
sends, a pod names it by id), so it is read as hostile: numbers are ints
(never bools, never floats, so never NaN or infinity) within bounds, arrays
are no longer than their allocations allow, an event names an allocation
the trace has, and no string a program reads (a name, a label, a backend
signature, a category) is a path or a URL. The assumptions are sentences for
people, never interpreted: bounded in count and length only (one names
NCCL's documentation by URL). The request a profile carries is checked by the
request's own schema (``estimator.request.profile``). ``profile_id`` is the
service's key: the sha256 of the canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from estimator.errors import SpecError
from estimator.models.allowed import looks_like_path
from estimator.plan.affine import SCHEMA_VERSION
from estimator.trace import Category

PROFILE_SCHEMA = "batchfit.profile"
ID_PATTERN = r"^sha256:[0-9a-f]{64}$"
MAX_ALLOCATIONS = 2**21  # a llama-3-70b step on one rank holds ~60,000; 35x that
MAX_BYTES = 2**50  # one allocation (1 PiB): larger than any card
MAX_SIGNATURES = 64  # attention-backend signatures (the catalog gives a handful)
MAX_NAME_CHARS = 512  # a module path, a model label, a signature
MAX_SENTENCES, MAX_SENTENCE_CHARS = 2000, 4000
MAX_SDPA_CALLS = 10_000
MAX_FLOPS = 2**90
MAX_STREAM = 2**16
TOP_FIELDS = ("schema", "version", "versions", "request", "model", "parameter_count", "start", "flops",
              "sdpa_calls", "assumptions", "capability_thresholds", "steps", "first_steps")
TRACE_FIELDS = ("schema", "const", "per_sample", "categories", "events", "phases", "modules", "min_batch", "streams")
CATEGORIES = frozenset(c.value for c in Category if c != Category.UNKNOWN)
_MAX_BATCH = 2**20  # estimator.options.MAX_BATCH (the profile's smallest batch is a batch)


def profile_id(doc: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON (sorted keys, no spaces): the same profile, the same id.

    >>> profile_id({"b": 1, "a": [1, 2]}) == profile_id({"a": [1, 2], "b": 1})
    True
    """
    return "sha256:" + hashlib.sha256(canonical_json(doc)).hexdigest()


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def check_profile_doc(doc: Any, field: str = "profile") -> None:
    """``SpecError`` naming the first field of ``doc`` that is not a batchfit profile's (module docstring);
    another schema version says to re-run ``batchfit profile``. The request inside is left to its schema."""
    if not isinstance(doc, dict) or doc.get("schema") != PROFILE_SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise SpecError(f"{field}.schema" if isinstance(doc, dict) else field, got,
                        f"a batchfit profile (schema {PROFILE_SCHEMA!r}, as `batchfit profile` writes it)")
    if doc.get("version") != SCHEMA_VERSION or isinstance(doc.get("version"), bool):
        raise SpecError(f"{field}.version", doc.get("version"), f"{SCHEMA_VERSION}: a profile of this batchfit's "
                        "schema (re-run `batchfit profile` with this version to write one)")
    _fields(doc, field, TOP_FIELDS, TOP_FIELDS)
    _mapping(doc["versions"], f"{field}.versions", 16, lambda v, p: _name(v, p, 64))
    if not isinstance(doc["request"], dict):
        raise SpecError(f"{field}.request", type(doc["request"]).__name__, "an object (the request it was made for)")
    _name(doc["model"], f"{field}.model")
    _int(doc["parameter_count"], f"{field}.parameter_count", 0, MAX_BYTES)
    _int(doc["start"], f"{field}.start", 1, _MAX_BATCH)
    _array(doc["sdpa_calls"], f"{field}.sdpa_calls", MAX_SDPA_CALLS, _sdpa_call)
    _array(doc["assumptions"], f"{field}.assumptions", MAX_SENTENCES, _sentence)
    _array(doc["capability_thresholds"], f"{field}.capability_thresholds", 64,
           lambda v, p: _pair(v, p, 0, 99))
    steps = _mapping(doc["steps"], f"{field}.steps", MAX_SIGNATURES, _trace)
    if not steps:
        raise SpecError(f"{field}.steps", {}, "at least one attention-backend signature's affine trace")
    for name in ("first_steps", "flops"):
        check = _trace if name == "first_steps" else (lambda v, p: _pair(v, p, 0, MAX_FLOPS))
        got = _mapping(doc[name], f"{field}.{name}", MAX_SIGNATURES, check)
        if set(got) != set(steps):
            raise SpecError(f"{field}.{name}", sorted(got), f"the signatures of {field}.steps ({sorted(steps)})")


def _fields(doc: dict[str, Any], path: str, known: tuple[str, ...], required: tuple[str, ...]) -> None:
    for key in doc:
        if key not in known:
            raise SpecError(f"{path}.{key}", _shown(doc[key]), f"no such field (a profile has {', '.join(known)})")
    for key in required:
        if key not in doc:
            raise SpecError(f"{path}.{key}", None, "a value (the field is required)")


def _trace(doc: Any, path: str) -> None:
    """An affine trace (``estimator.plan.affine.AffineTrace.to_json``): n allocations, each list n long, the
    events at most two per allocation (its allocation and its free), each naming one of them."""
    if not isinstance(doc, dict):
        raise SpecError(path, _shown(doc), "an affine trace object")
    _fields(doc, path, TRACE_FIELDS, ("schema", "const", "per_sample", "categories", "events"))
    if doc["schema"] != SCHEMA_VERSION or isinstance(doc["schema"], bool):
        raise SpecError(f"{path}.schema", doc["schema"], f"{SCHEMA_VERSION} (re-run `batchfit profile`)")
    const = _array(doc["const"], f"{path}.const", MAX_ALLOCATIONS, lambda v, p: _int(v, p, 0, MAX_BYTES))
    n = len(const)
    _array(doc["per_sample"], f"{path}.per_sample", n, lambda v, p: _int(v, p, 0, MAX_BYTES), exactly=True)
    _array(doc["categories"], f"{path}.categories", n, _category, exactly=True)
    for name in ("phases", "modules"):
        if name in doc and doc[name] != []:  # a trace may leave them out: its report names no phase or module
            _array(doc[name], f"{path}.{name}", n, lambda v, p: _name(v, p), exactly=True)
    if doc.get("streams") is not None:
        _array(doc["streams"], f"{path}.streams", n, lambda v, p: _int(v, p, 0, MAX_STREAM), exactly=True)
    if "min_batch" in doc:
        _int(doc["min_batch"], f"{path}.min_batch", 1, _MAX_BATCH)
    seen = [0] * n  # 0: not yet allocated, 1: live, 2: freed
    events = _array(doc["events"], f"{path}.events", 2 * n, lambda v, p: _event(v, p, n))
    for i, (alloc, k) in enumerate(events):
        if seen[k] != (0 if alloc else 1):
            raise SpecError(f"{path}.events[{i}]", [alloc, k], f"allocation {k} allocated once, then freed at most "
                            "once after it")
        seen[k] += 1


def _event(value: Any, path: str, n: int) -> tuple[int, int]:
    """``[1, k]`` (allocation ``k``) or ``[0, k]`` (its free), ``k`` < n."""
    if not isinstance(value, list) or len(value) != 2:
        raise SpecError(path, _shown(value), "an event [1 or 0 (allocation or free), the allocation's index]")
    return _int(value[0], f"{path}[0]", 0, 1), _int(value[1], f"{path}[1]", 0, n - 1)


def _sdpa_call(value: Any, path: str) -> None:
    if not isinstance(value, dict):
        raise SpecError(path, _shown(value), "an object {dtype, dim, head_dims, has_mask, requires_grad}")
    _fields(value, path, ("dtype", "dim", "head_dims", "has_mask", "requires_grad"),
            ("dtype", "dim", "head_dims", "has_mask", "requires_grad"))
    _name(value["dtype"], f"{path}.dtype", 32)
    _int(value["dim"], f"{path}.dim", 0, 8)
    _array(value["head_dims"], f"{path}.head_dims", 3, lambda v, p: _int(v, p, 0, 2**16), exactly=True)
    for name in ("has_mask", "requires_grad"):
        if not isinstance(value[name], bool):
            raise SpecError(f"{path}.{name}", _shown(value[name]), "true or false")


def _category(value: Any, path: str) -> None:
    if value not in CATEGORIES:
        raise SpecError(path, _shown(value), f"one of {', '.join(sorted(CATEGORIES))}")


def _pair(value: Any, path: str, lo: int, hi: int) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise SpecError(path, _shown(value), "a pair of integers [a, b]")
    return _int(value[0], f"{path}[0]", lo, hi), _int(value[1], f"{path}[1]", lo, hi)


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, _shown(value), f"an integer from {lo} to {hi}")
    if not lo <= value <= hi:
        raise SpecError(path, value if abs(value) < 10**30 else "(a huge integer)", f"an integer from {lo} to {hi}")
    return value


def _name(value: Any, path: str, limit: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise SpecError(path, _shown(value), f"a string of at most {limit} characters")
    if looks_like_path(value):
        raise SpecError(path, value, "a name, not a path or URL: a profile is data, and batchfit reads no files "
                        "and fetches nothing for it")
    return value


def _sentence(value: Any, path: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_SENTENCE_CHARS:
        raise SpecError(path, _shown(value), f"a string of at most {MAX_SENTENCE_CHARS} characters")


def _array(value: Any, path: str, limit: int, check: Callable[[Any, str], Any], *, exactly: bool = False) -> list[Any]:
    """``value`` as a list of at most ``limit`` items (exactly ``limit`` when ``exactly``), each checked; the
    length is checked before any item is."""
    if not isinstance(value, list):
        raise SpecError(path, _shown(value), "an array")
    if len(value) > limit or (exactly and len(value) != limit):
        raise SpecError(path, f"({len(value)} items)", f"{'exactly' if exactly else 'at most'} {limit} items")
    return [check(v, f"{path}[{i}]") for i, v in enumerate(value)]


def _mapping(value: Any, path: str, limit: int, check: Callable[[Any, str], Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(path, _shown(value), "an object")
    if len(value) > limit:
        raise SpecError(path, f"({len(value)} keys)", f"at most {limit} keys")
    out = {}
    for key, v in value.items():
        _name(key, f"{path}[{json.dumps(key)}]", MAX_NAME_CHARS)
        out[key] = check(v, f"{path}[{json.dumps(key)}]")
    return out


def _shown(value: Any) -> Any:
    """What a refusal echoes: scalars as they are (NaN and infinity as text), containers by type."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, bool)) or value is None:
        return value if not isinstance(value, int) or abs(value) < 10**30 else "(a huge integer)"
    if isinstance(value, str):
        return value[:80]
    return f"({type(value).__name__})"
