"""A request body's shape, checked on the raw bytes before any JSON parser builds Python objects.

A hostile body can cost the parser more than the estimate: 100,000 nested
arrays (Python's ``json`` recurses), a million keys, an integer of 100,000
digits (``int()`` is quadratic; CPython refuses past 4300 digits). The scan
runs in C-speed regular expressions over at most ``BATCHFIT_MAX_BODY_BYTES``:

>>> check_shape(b'{"model": {"kwargs": {"x": [[1]]}}}')
>>> check_shape(b'[' * 100 + b']' * 100)
Traceback (most recent call last):
  ...
estimator.errors.SpecError: (body): got '(nested deeper)'; expected JSON nested at most 48 levels
"""

from __future__ import annotations

import re

from estimator.errors import SpecError
from estimator.options import MAX_JSON_DEPTH

# The schema's own nesting (body -> model -> config -> ...) plus the free-form part's limit.
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 16
MAX_ITEMS = 20_000  # ',' and ':' in the whole body; a 64-card request with an inline config uses < 2,000
MAX_NUMBER_CHARS = 400  # digits, sign, point and exponent of one number literal

# possessive, and an unterminated string runs to the end: one linear pass whatever the body
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\Z)', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")
_SEPARATOR = re.compile(rb"[,:]")
_NUMBER = re.compile(rb"[-+0-9.eE]{%d,}" % (MAX_NUMBER_CHARS + 1))


def check_shape(body: bytes, max_items: int = MAX_ITEMS) -> None:
    """``SpecError`` at ``(body)`` when ``body`` nests deeper than ``MAX_BODY_DEPTH``, holds more than
    ``max_items`` keys and elements, or a number longer than ``MAX_NUMBER_CHARS``; malformed JSON passes
    (the parser names where it breaks)."""
    bare = _STRING.sub(b'""', body)  # brackets, commas and digits inside strings do not count
    depth = deepest = 0
    for match in _BRACKET.finditer(bare):
        depth += 1 if match.group() in (b"[", b"{") else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_BODY_DEPTH:
                raise SpecError("(body)", "(nested deeper)", f"JSON nested at most {MAX_BODY_DEPTH} levels")
    items = sum(1 for _ in _SEPARATOR.finditer(bare))  # a key has its ':', an element after the first its ','
    if items > max_items:
        raise SpecError("(body)", f"({items} ',' and ':')", f"at most {max_items} separators (keys and elements)")
    long_number = _NUMBER.search(bare)
    if long_number is not None:
        raise SpecError("(body)", long_number.group()[:40].decode("ascii", "replace") + "...",
                        f"numbers of at most {MAX_NUMBER_CHARS} characters")
