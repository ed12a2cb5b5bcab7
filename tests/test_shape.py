"""The body's shape, checked on the raw bytes before parsing (nesting and key counts limited
before any parsing into Python objects): deep, wide and long-number bodies are refused in one linear pass."""

from __future__ import annotations

import json

import pytest

from app.shape import MAX_BODY_DEPTH, MAX_ITEMS, MAX_NUMBER_CHARS, check_shape
from estimator.errors import SpecError

pytestmark = pytest.mark.unit


def test_a_real_request_passes() -> None:
    body = {"model": {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 2, "architectures": ["x"]}},
            "gpus": [{"name": f"card {i}", "memory_gib": 16} for i in range(64)], "input": {"seq_len": 1024}}
    check_shape(json.dumps(body).encode())


@pytest.mark.parametrize("body, expected", [
    (b"[" * (MAX_BODY_DEPTH + 1) + b"]" * (MAX_BODY_DEPTH + 1), f"nested at most {MAX_BODY_DEPTH}"),
    (b"[" * 1_000_000, f"nested at most {MAX_BODY_DEPTH}"),  # Python's parser would recurse a million deep
    (b"[" + b"0," * (MAX_ITEMS + 1) + b"0]", f"at most {MAX_ITEMS} separators"),
    (json.dumps({f"k{i}": 0 for i in range(MAX_ITEMS + 1)}).encode(), f"at most {MAX_ITEMS} separators"),
    (b'{"a": 1' + b"0" * 5000 + b"}", f"numbers of at most {MAX_NUMBER_CHARS} characters"),
])
def test_hostile_shapes_are_refused_at_the_body(body: bytes, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        check_shape(body)
    assert err.value.field == "(body)" and expected in err.value.expected
    assert len(repr(err.value.value)) < 100  # never the body itself


@pytest.mark.parametrize("body", [
    b'{"name": "' + b"[{,:" * 100_000 + b'"}',  # brackets and separators inside a string do not count
    b'{"name": "\\"' + b"[" * 1000 + b'"}',  # nor after an escaped quote
    b'"' * 1_000_000,  # many empty strings: one pass
    b'["' + b'\\"' * 500_000,  # an unterminated string runs to the end (the parser then says where it broke)
    b"{not json at all",
])
def test_strings_and_malformed_bodies_pass_to_the_parser(body: bytes) -> None:
    check_shape(body)


@pytest.mark.parametrize("content, expected", [
    ("[" * 1100 + "]" * 1100, "nested at most"),  # Python's parser alone: a 400 after recursing 1000 deep
    ('{"model": {"source": "torchvision", "name": "resnet18", "kwargs": {' +
     ", ".join(f'"k{i}": 0' for i in range(MAX_ITEMS)) + "}}}", "separators"),
    ('{"batch_size": ' + "9" * 5000 + "}", "numbers of at most"),
])
def test_the_service_refuses_the_shape_before_parsing(content: str, expected: str) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    with TestClient(create_app(Settings(workers=1, cache_path=""), start_workers=False)) as client:
        r = client.post("/estimate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text[:300]
    body = r.json()
    assert body["field"] == "(body)" and expected in body["expected"], body
