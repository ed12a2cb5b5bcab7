"""POST /timeline and POST /snapshot: the first card's step through the worker pool, cached like /estimate, bad
input answered as problems (httpx against the app, one worker process)."""

from __future__ import annotations

import pickle

import pytest
from support import PROBLEM, service

pytestmark = pytest.mark.service

SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
         "gpus": ["A100-80GB"], "planner": {"confirm": "none", "curve_points": 0}, "batch_size": 16}

TIMELINE_KEYS = ["gpu", "batch_size", "capacity_bytes", "usable_bytes", "allocated_peak_bytes", "reserved_peak_bytes",
                 "device_peak_bytes", "peak_event", "peak_phase", "events", "points", "categories", "allocated",
                 "reserved", "phases"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with service(tmp_path_factory.mktemp("cache") / "cache.sqlite", queue_size=4, request_timeout_s=300) as c:
        yield c


def test_timeline_at_batch_size_then_a_cache_hit(client) -> None:
    first = client.post("/timeline", json=SMALL)
    assert first.status_code == 200 and first.headers["x-batchfit-cache"] == "miss", first.text
    doc = first.json()
    assert list(doc) == TIMELINE_KEYS
    assert (doc["gpu"], doc["batch_size"], len(doc["points"])) == ("A100-80GB", 16, doc["events"])
    assert doc["allocated"][doc["peak_event"]] == doc["allocated_peak_bytes"]
    assert doc["phases"][0] == {"phase": "setup", "iteration": 0, "start": 0}
    # the estimate's memory at the same batch: the same step, the same replay
    memory = client.post("/estimate", json=SMALL).json()["results"][0]["memory"]
    assert [doc[k] for k in ("allocated_peak_bytes", "reserved_peak_bytes", "device_peak_bytes")] == [
        memory[k] for k in ("allocated_peak_bytes", "reserved_peak_bytes", "device_peak_bytes")]
    second = client.post("/timeline", json=SMALL)
    assert second.headers["x-batchfit-cache"] == "hit" and second.json() == doc
    assert 'route="/timeline",status="200"' in client.get("/metrics").text


def test_timeline_without_a_batch_is_at_the_recommended_batch(client) -> None:
    body = {k: v for k, v in SMALL.items() if k != "batch_size"}
    doc = client.post("/timeline", json=body).json()
    assert doc["batch_size"] == client.post("/estimate", json=body).json()["results"][0]["recommended_batch_size"]
    assert doc["device_peak_bytes"] <= doc["capacity_bytes"]


def test_snapshot_is_a_pickle_attachment_that_adds_up(client) -> None:
    r = client.post("/snapshot", json=SMALL)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == 'attachment; filename="step.pickle"'
    assert r.headers["x-batchfit-cache"] == "miss"
    snap = pickle.loads(r.content)  # our own service's answer
    allocated = peak = 0
    for e in snap["device_traces"][0]:
        allocated += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, allocated)
    assert peak == client.post("/timeline", json=SMALL).json()["allocated_peak_bytes"]
    again = client.post("/snapshot", json=SMALL)
    assert again.headers["x-batchfit-cache"] == "hit" and again.content == r.content


@pytest.mark.parametrize("route", ["/timeline", "/snapshot"])
@pytest.mark.parametrize("body, field", [
    ({"model": {"source": "torchvision", "name": "resnet5"}, "gpus": ["T4-16GB"]}, "model.name"),  # in the worker
    ({"model": {"source": "torchvision", "name": 5}}, "model.name"),                              # by FastAPI
    ({"model": {"source": "custom", "factory": "os:system"}}, "model.source"),                    # never over HTTP
    ({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-90GB"]}, "gpus[0]"),
    ({"model": {"source": "torchvision", "name": "resnet18"}, "batch_size": 0}, "batch_size"),
    ({"model": {"source": "torchvision", "name": "resnet18"}, "validate": True}, "validate"),   # a view, no GPU run
])
def test_bad_requests_are_422_problems(client, route, body, field) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text
    doc = r.json()
    assert doc["field"] == field and doc["detail"].startswith(f"{field}: got ")


@pytest.mark.parametrize("route", ["/timeline", "/snapshot"])
def test_a_body_not_json_is_refused(client, route) -> None:
    r = client.post(route, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == PROBLEM and r.json()["field"] == "(body)"
    r = client.post(route, content=b"model=resnet18", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.headers["content-type"] == PROBLEM


def test_a_model_that_cannot_be_simulated_is_a_422(client) -> None:
    body = {**SMALL, "input": {"image_size": [1, 64, 64]}}  # 1 channel into a 3-channel stem
    r = client.post("/snapshot", json=body)
    assert r.status_code == 422 and r.json()["type"].endswith("/simulation")


def test_the_schema_documents_both_routes(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "Timeline" in paths["/timeline"]["post"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"]
    assert "application/octet-stream" in paths["/snapshot"]["post"]["responses"]["200"]["content"]
