"""The service: every route, every error path, limits, the cache and auth (httpx against the app)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from support import PROBLEM, paused_workers, service

from app.main import create_app
from app.settings import Settings
from estimator.gpus import CATALOG

pytestmark = pytest.mark.service

SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
         "planner": {"confirm": "none", "curve_points": 0}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with service(tmp_path_factory.mktemp("cache") / "cache.sqlite", queue_size=0, request_timeout_s=300) as c:
        yield c


def test_healthz_readyz_gpus_models_metrics(client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"workers": True, "live_workers": 1, "cache": "ok", "cache_error": None}
    gpus = client.get("/gpus").json()
    assert [g["name"] for g in gpus["gpus"]] == list(CATALOG)
    models = client.get("/models").json()
    assert "resnet50" in models["torchvision"]["classification"]
    assert "llama-3-8b" in models["transformers"]["presets"] and len(models["timm"]["names"]) > 1000
    metrics = client.get("/metrics").text
    assert "batchfit_requests_total" in metrics and 'route="/gpus",status="200"' in metrics


def test_estimate_then_cache_hit(client) -> None:
    first = client.post("/estimate", json=SMALL)
    assert first.status_code == 200 and first.headers["x-batchfit-cache"] == "miss"
    second = client.post("/estimate", json=SMALL)
    assert second.status_code == 200 and second.headers["x-batchfit-cache"] == "hit"
    assert first.json() == second.json()
    assert first.json()["results"][0]["max_batch_size"] > 100
    assert "batchfit_cache_hits_total 1.0" in client.get("/metrics").text
    assert first.headers["x-request-id"]


@pytest.mark.parametrize("body, field", [
    ({"model": {"source": "torchvision", "name": "resnet5"}, "gpus": ["T4-16GB"]}, "model.name"),   # in the worker
    ({"model": {"source": "torchvision", "name": 5}}, "model.name"),                               # by FastAPI
    ({"model": {"source": "custom", "factory": "os:system"}}, "model.source"),                     # never over HTTP
    ({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-90GB"]}, "gpus[0]"),
    ({"model": {"source": "transformers", "preset": "gpt2", "config": {"auto_map": {"x": "y"}}}},
     "model.config.auto_map"),
    ({"model": {"source": "torchvision", "name": "resnet18"}, "batch_size": 0}, "batch_size"),
    ({"gpus": ["T4-16GB"]}, "model"),
    ({"model": {"source": "torchvision", "name": "resnet18"}, "trainig": {}}, "trainig"),
])
def test_bad_requests_are_422_problems(client, body, field) -> None:
    r = client.post("/estimate", json=body)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM
    doc = r.json()
    assert doc["field"] == field and doc["detail"].startswith(f"{field}: got ")


def test_not_json_is_a_400(client) -> None:
    r = client.post("/estimate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == PROBLEM and r.json()["field"] == "(body)"


def test_simulation_failure_is_a_422(client) -> None:
    body = {**SMALL, "model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [1, 224, 224]}}
    r = client.post("/estimate", json=body)  # 1 channel into a 3-channel stem
    assert r.status_code == 422 and r.json()["type"].endswith("/simulation")
    assert "conv1" in r.json()["where"] or "forward" in r.json()["where"]


def test_queue_full_is_503_with_retry_after(client) -> None:
    slow = {**SMALL, "model": {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 24}},
            "input": {"seq_len": 64}}
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("slow", client.post("/estimate", json=slow)))
    with paused_workers(client.app):  # the one worker stays busy with it until the second is refused
        t.start()
        deadline = time.time() + 30
        while time.time() < deadline:  # wait until the one worker is busy
            if "batchfit_workers_busy 1.0" in client.get("/metrics").text:
                break
            time.sleep(0.05)
        other = {**SMALL, "gpus": ["A100-80GB"]}
        r = client.post("/estimate", json=other)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.headers["content-type"] == PROBLEM
    t.join()
    assert results["slow"].status_code == 200
    assert client.get("/healthz").status_code == 200


def test_runaway_request_is_stopped_and_the_next_is_served(tmp_path) -> None:
    app = create_app(Settings(workers=1, cache_path="", request_timeout_s=15))
    runaway = {"model": {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 100_000}},
               "input": {"seq_len": 16}, "gpus": ["T4-16GB"]}
    with TestClient(app) as c:
        t0 = time.time()
        r = c.post("/estimate", json=runaway)
        assert r.status_code == 422 and r.json()["type"].endswith("/time-limit")
        assert time.time() - t0 < 60
        ok = c.post("/estimate", json=SMALL)
        assert ok.status_code == 200
        assert "batchfit_worker_restarts_total 1.0" in c.get("/metrics").text


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("Basic s3cret", 401),
                                            ("Bearer s3cret", 200)])
def test_api_keys(header, status) -> None:
    with service(start_workers=False, api_keys="other, s3cret") as c:
        headers = {"Authorization": header} if header else {}
        r = c.get("/gpus", headers=headers)
        assert r.status_code == status
        if status == 401:
            assert r.headers["content-type"] == PROBLEM and r.headers["www-authenticate"] == "Bearer"
        assert c.get("/healthz").status_code == 200          # open without a key
        assert c.get("/readyz").status_code == 503           # open; no workers started here


def test_openapi_has_examples(client) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/estimate"]["post"]["requestBody"]["content"]["application/json"]
    assert body["examples"]["resnet50"]["value"]["model"]["name"] == "resnet50"
    assert "EstimateResponse" in schema["components"]["schemas"]


def test_worker_past_the_memory_limit_is_replaced() -> None:
    # 256 MiB: less than a worker holds once torch is imported, so the first estimate passes it
    app = create_app(Settings(workers=1, cache_path="", worker_memory_bytes=2**28))
    with TestClient(app) as c:
        r = c.post("/estimate", json=SMALL)
        assert r.status_code == 422 and r.json()["type"].endswith("/memory-limit")
        assert "256 MiB" in r.json()["detail"]
        assert c.get("/healthz").status_code == 200
        assert "batchfit_worker_restarts_total 1.0" in c.get("/metrics").text


def test_a_killed_worker_is_a_503_and_is_replaced() -> None:
    """A worker SIGKILLed mid-estimate (as the OOM killer does) gives its caller a 503 problem
    with Retry-After; the worker is replaced, and the next 20 requests, each computed, all succeed."""
    import os
    import signal

    app = create_app(Settings(workers=1, cache_path="", request_timeout_s=300))
    slow = {"model": {"source": "torchvision", "name": "resnet50"}}  # the whole catalog
    results = {}
    with TestClient(app) as c:
        t = threading.Thread(target=lambda: results.setdefault("slow", c.post("/estimate", json=slow)))
        pool = app.state.pool
        with paused_workers(app) as (pid,):  # the job is sent and the worker is still at it, however fast it runs
            t.start()
            deadline = time.time() + 60
            while pool.busy == 0 and time.time() < deadline:
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
        t.join(120)
        r = results["slow"]
        assert r.status_code == 503 and r.headers["content-type"] == PROBLEM, r.text
        assert r.json()["type"].endswith("/worker-died") and r.headers["retry-after"] == "5"
        assert "killed by signal 9" in r.json()["detail"]
        ready = c.get("/readyz").json()
        assert ready["workers"] and ready["live_workers"] == 1
        for b in range(2, 22):  # resnet18 at 32 px: batch norm needs 2 (1x1 maps)
            ok = c.post("/estimate", json={**SMALL, "input": {"image_size": [3, 32, 32]}, "batch_size": b})
            assert ok.status_code == 200, (b, ok.text)
            assert ok.headers["x-batchfit-cache"] == "miss"
        assert "batchfit_worker_restarts_total 1.0" in c.get("/metrics").text


def test_logs_are_json_lines_with_the_request_id() -> None:
    import json
    import logging

    from app.logs import JSONFormatter

    record = logging.LogRecord("batchfit", logging.INFO, __file__, 1, "request", None, None)
    record.fields = {"request_id": "abc", "route": "/estimate", "status": 200}
    doc = json.loads(JSONFormatter().format(record))
    assert doc["msg"] == "request" and doc["request_id"] == "abc" and doc["status"] == 200


def test_a_cached_answer_streams_at_once(client) -> None:
    body = {**SMALL, "gpus": ["A10G-24GB"]}
    plain = client.post("/estimate", json=body)
    assert plain.status_code == 200
    streamed = client.post("/estimate", json=body, headers={"Accept": "text/event-stream"})
    assert streamed.headers["x-batchfit-cache"] == "hit"
    assert streamed.text == "event: result\ndata: " + json.dumps(plain.json(), separators=(",", ":")) + "\n\n"
