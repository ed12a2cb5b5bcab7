"""Hostile HTTP requests: non-finite numbers, deep nesting, bodies over the limit, routing and parser errors,
the docs behind the key, echoed values cut short and empty API keys.

Every non-2xx answer is application/problem+json; nothing here needs a worker (the errors come first),
so the app runs without its pool.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from support import PROBLEM, service

from app.settings import Settings

pytestmark = pytest.mark.service


SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"]}


@pytest.fixture(scope="module")
def client():
    with service(start_workers=False) as c:
        yield c


def _problem(r, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"] == PROBLEM, r.headers["content-type"]
    body = r.json()
    assert body["type"].endswith(f"/{kind}") and body["status"] == status
    return body


@pytest.mark.parametrize("body, field", [
    ('{"model": {"source": "torchvision", "name": "resnet18"}, "planner": {"efficiency": NaN}}', "planner.efficiency"),
    ('{"model": {"source": "torchvision", "name": "resnet18"}, "planner": {"headroom": Infinity}}', "planner.headroom"),
    ('{"model": {"source": "torchvision", "name": "resnet18", "kwargs": {"dropout": NaN}}}', "model.kwargs.dropout"),
    ('{"model": {"source": "transformers", "preset": "gpt2", "config": {"layer_norm_epsilon": -Infinity}}}',
     "model.config.layer_norm_epsilon"),
])
def test_non_finite_numbers_are_422_naming_the_field(client, body, field) -> None:
    r = client.post("/estimate", content=body, headers={"content-type": "application/json"})
    assert _problem(r, 422, "invalid-request")["field"] == field


@pytest.mark.parametrize("levels, field, expected", [
    (40, "model.kwargs.x[0]", "nested at most 32"),  # within the body's shape (app/shape.py): the free-form limit
    (300, "(body)", "nested at most 48"),  # past it: refused on the raw bytes, before parsing
])
def test_deep_nesting_in_free_form_json_is_a_422(client, levels, field, expected) -> None:
    deep: object = 1
    for _ in range(levels):
        deep = [deep]
    r = client.post("/estimate", json={"model": {"source": "torchvision", "name": "resnet18", "kwargs": {"x": deep}}})
    body = _problem(r, 422, "invalid-request")
    assert body["field"].startswith(field) and expected in body["expected"], body


def test_a_body_over_the_limit_is_a_413_before_it_is_read() -> None:
    with service(start_workers=False, max_body_bytes=4096) as c:
        big = json.dumps({**SMALL, "model": {**SMALL["model"], "name": "x" * 10_000}})
        _problem(c.post("/estimate", content=big, headers={"content-type": "application/json"}), 413, "too-large")

        def chunks():  # no Content-Length: counted as it streams in
            yield big[:3000].encode()
            yield big[3000:].encode()

        r = c.post("/estimate", content=chunks(), headers={"content-type": "application/json"})
        _problem(r, 413, "too-large")
        small = c.post("/estimate", json={"model": {"source": "nope"}})
        _problem(small, 422, "invalid-request")  # under the limit: parsed as before


@pytest.mark.parametrize("method, path, content, status, kind", [
    ("GET", "/nowhere", None, 404, "not-found"),
    ("DELETE", "/estimate", None, 405, "method-not-allowed"),
    ("POST", "/estimate", b'{"model": "\xff\xfe"}', 400, "bad-request"),
])
def test_routing_and_body_errors_are_problem_json(client, method, path, content, status, kind) -> None:
    headers = {"content-type": "application/json"} if content is not None else {}
    _problem(client.request(method, path, content=content, headers=headers), status, kind)


@pytest.mark.parametrize("content", ["[" * 1100 + "]" * 1100, '{"batch_size": ' + "9" * 5000 + "}"])
def test_json_the_parser_refuses_is_problem_json(client, content) -> None:
    r = client.post("/estimate", content=content, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and r.headers["content-type"] == PROBLEM


def test_docs_need_the_key_when_keys_are_set() -> None:
    with service(start_workers=False, api_keys="s3cret") as c:
        for path in ("/docs", "/openapi.json", "/gpus"):
            _problem(c.get(path), 401, "unauthorized")
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/healthz").status_code == 200


def test_echoed_values_are_cut_short(client) -> None:
    r = client.post("/estimate", json={**SMALL, "training": {"precision": "y" * 500_000}})
    body = _problem(r, 422, "invalid-request")
    assert len(r.content) < 5_000 and body["field"] == "training.precision"
    assert body["value"] == "y" * 200 and len(body["detail"]) < 2_000


@pytest.mark.parametrize("keys", [" , ", "a,,b", "a, "])
def test_empty_api_keys_are_a_startup_error(keys) -> None:
    with pytest.raises(ValidationError, match="every comma-separated key must be non-empty"):
        Settings(api_keys=keys)
    assert Settings(api_keys="").keys() == [] and Settings(api_keys="a, b").keys() == ["a", "b"]
