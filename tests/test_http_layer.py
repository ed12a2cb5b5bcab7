"""The HTTP layer: a client that leaves cancels its estimate, invalid JSON and a wrong Content-Type are
named, and every non-2xx answer as application/problem+json.

The cancellation tests run the service under uvicorn (a real socket, closed by the client) with one
worker and a real estimate that takes several seconds (GPT-2 with 24 layers); they assert on what the
service did and in which order (worker replaced, counters, which answer came first), never on how long
it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from support import PROBLEM, paused_workers

from app.cache import SingleFlight, cache_key
from app.errors import HTTP_PROBLEMS
from app.main import create_app
from app.ready import wait_ready
from app.settings import Settings
from estimator import EstimateRequest, EstimateResponse

pytestmark = pytest.mark.service


SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
         "planner": {"confirm": "none", "curve_points": 0}}
# a real estimate of several simulations (half a second on a quiet host), held in the middle by paused_workers
SLOW = {"model": {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 24}}, "input": {"seq_len": 64},
        "gpus": ["T4-16GB"], "planner": {"confirm": "none", "curve_points": 0}}
CANCELLED = "batchfit_estimates_cancelled_total"
BUSY = "batchfit_workers_busy"  # callers in the pool: running or queued
RESPONSE = TypeAdapter(EstimateResponse)
LEFT = 'batchfit_requests_total{route="/estimate",status="499"}'


# --- invalid JSON and the Content-Type ---------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    # no workers: every request here is answered before a worker would be asked (queue_size 0: Busy)
    app = create_app(Settings(workers=1, cache_path="", queue_size=0), start_workers=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_invalid_json_is_a_400_naming_line_and_column(client) -> None:
    body = b'{\n  "model": {"source": "torchvision", "name": "resnet18"}\n  "gpus": ["T4-16GB"]\n}'
    r = client.post("/estimate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == PROBLEM
    doc = r.json()
    assert doc["field"] == "(body)"
    assert doc["expected"] == "valid JSON: Expecting ',' delimiter at line 3 column 3 (char 61)"  # as json.loads says
    assert '"gpus"' in doc["value"] and len(doc["value"]) <= 200
    assert doc["detail"] == f"(body): got {doc['value']!r}; expected {doc['expected']}"


def test_invalid_json_echoes_at_most_200_characters(client) -> None:
    body = b'{"model": {"source": "torchvision", "name": "' + b"x" * 100_000 + b'"} oops}'
    r = client.post("/estimate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["expected"].startswith("valid JSON: Expecting ',' delimiter")
    assert len(r.json()["value"]) <= 200 and len(r.content) < 2000


@pytest.mark.parametrize("content_type, body", [
    ("text/plain", b'{"model": {"source": "torchvision", "name": "resnet18"}}'),
    ("application/x-www-form-urlencoded", b"model=resnet18"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--x--\r\n'),
    (None, b'{"model": {"source": "torchvision", "name": "resnet18"}}'),
])
def test_a_wrong_content_type_is_a_415_naming_it(client, content_type, body) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/estimate", content=body, headers=headers)
    assert r.status_code == 415 and r.headers["content-type"] == PROBLEM
    assert r.headers["accept-post"] == "application/json"
    doc = r.json()
    assert doc["type"].endswith("/unsupported-media-type") and doc["field"] == "Content-Type"
    assert doc["value"] == content_type and doc["expected"] == "application/json"
    assert (repr(content_type) if content_type else "no Content-Type") in doc["detail"]


def test_a_chunked_body_without_content_type_is_a_415(client) -> None:
    r = client.post("/estimate", content=iter([b'{"model": ', b'{"source": "torchvision", "name": "resnet18"}}']))
    assert r.status_code == 415 and r.json()["value"] is None


def test_a_long_content_type_is_echoed_cut_to_200(client) -> None:
    r = client.post("/estimate", content=b"{}", headers={"content-type": "text/" + "x" * 5000})
    assert r.status_code == 415 and len(r.json()["value"]) == 200


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/merge-patch+json"])
def test_json_content_types_are_read(client, content_type) -> None:
    body = json.dumps({"model": {"source": "torchvision", "name": 5}}).encode()
    r = client.post("/estimate", content=body, headers={"content-type": content_type})
    assert r.status_code == 422 and r.json()["field"] == "model.name"  # read as JSON, refused by the schema


def test_the_table_names_every_status_the_service_answers() -> None:
    assert {400, 404, 405, 413, 415, 422, 500, 503} <= set(HTTP_PROBLEMS)
    assert all(kind and title for kind, title in HTTP_PROBLEMS.values())


def _broken_catalog() -> dict:
    raise RuntimeError("the catalog broke")


@pytest.mark.parametrize("status, send", [
    (400, lambda c: c.post("/estimate", content=b'{"model": "\xff"}', headers={"content-type": "application/json"})),
    (400, lambda c: c.post("/estimate", content=b"{", headers={"content-type": "application/json"})),
    (404, lambda c: c.get("/nowhere")),
    (405, lambda c: c.delete("/estimate")),
    (413, lambda c: c.post("/estimate", content=b" " * (2**20 + 1), headers={"content-type": "application/json"})),
    (415, lambda c: c.post("/estimate", content=b"{}", headers={"content-type": "text/plain"})),
    (422, lambda c: c.post("/estimate", json={"model": {"source": "torchvision", "name": 5}})),
    (500, lambda c: c.get("/gpus")),  # the catalog is broken below: a defect
    (503, lambda c: c.post("/estimate", json=SMALL)),  # no idle worker and no room in the queue: busy
])
def test_every_error_is_a_problem(client, monkeypatch, status, send) -> None:
    monkeypatch.setattr("app.routes.catalog", _broken_catalog)
    r = send(client)
    assert r.status_code == status and r.headers["content-type"] == PROBLEM, r.text[:300]
    doc = r.json()
    assert doc["status"] == status and doc["type"].startswith("https://batchfit.dev/problems/") and doc["title"]
    assert len(doc["detail"]) <= 2000
    if status == 400:
        assert doc["detail"] != "There was an error parsing the body"  # it says why
    if status == 500:
        assert "RuntimeError: the catalog broke" in doc["detail"]
        assert 'route="/gpus",status="500"' in client.get("/metrics").text


def test_the_openapi_schema_lists_400_413_and_415(client) -> None:
    responses = client.get("/openapi.json").json()["paths"]["/estimate"]["post"]["responses"]
    assert {"400", "413", "415", "422", "503"} <= set(responses)
    assert PROBLEM in responses["415"]["content"]


# --- a client that leaves -----------------------------------------------------------------------------

def test_single_flight_goes_on_while_a_caller_waits_and_stops_when_none_does() -> None:
    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def main() -> dict:
        flights, events = SingleFlight(), {"started": 0, "finished": 0, "cancelled": 0}
        gate = asyncio.Event()

        async def compute() -> str:
            events["started"] += 1
            try:
                await gate.wait()
            except asyncio.CancelledError:
                events["cancelled"] += 1
                raise
            events["finished"] += 1
            return "answer"

        first = asyncio.ensure_future(flights.run("k", compute))  # the caller that started it leaves
        second = asyncio.ensure_future(flights.run("k", compute))
        await settle()
        assert flights.waiting("k") == 2 and events["started"] == 1
        first.cancel()
        await settle()
        assert flights.waiting("k") == 1 and events["cancelled"] == 0
        gate.set()
        assert await second == "answer" and first.cancelled()
        gate.clear()
        alone = asyncio.ensure_future(flights.run("k", compute))
        await settle()
        alone.cancel()  # nobody else waits: the computation is cancelled
        await settle()
        assert flights.waiting("k") == 0
        gate.set()
        again = await flights.run("k", compute)  # a new caller starts afresh
        return {**events, "again": again}

    assert asyncio.run(main()) == {"started": 3, "finished": 2, "cancelled": 1, "again": "answer"}


@pytest.fixture(scope="module")
def service():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Settings(workers=1, cache_path="", queue_size=4, request_timeout_s=600))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    yield url, app
    server.should_exit = True
    thread.join(60)


def _metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until(what: str, done: Callable[[], bool]) -> None:
    """Wait for a state of the service (a bound against hanging, not a timing check)."""
    deadline = time.monotonic() + 600
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def _send(url: str, body: dict) -> socket.socket:
    """POST /estimate on a raw socket, left unread: the caller closes it to leave."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /estimate HTTP/1.1\r\nHost: batchfit\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _worker_pids() -> set[int]:
    """This process's children that run a multiprocessing spawn (the service's workers), from /proc."""
    me, pids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
        if ppid == me and spawned:
            pids.add(int(entry))
    return pids


def test_a_running_estimate_whose_client_left_is_cancelled_and_its_worker_replaced(service) -> None:
    url, app = service
    pids, cancelled, left = _worker_pids(), _metric(url, CANCELLED), _metric(url, LEFT)
    assert len(pids) == 1
    with paused_workers(app):  # the estimate is still running when its client leaves, however fast it is
        sock = _send(url, SLOW)
        _until("the slow estimate runs", lambda: _metric(url, BUSY) == 1)
        sock.close()
        _until("the slow estimate is over (cancelled, or finished)", lambda: _metric(url, BUSY) == 0)
    assert _metric(url, CANCELLED) == cancelled + 1  # cancelled, not finished
    small = httpx.post(f"{url}/estimate", json=SMALL, timeout=600)  # waits for the fresh worker
    assert small.status_code == 200
    RESPONSE.validate_json(small.content)
    after = _worker_pids()
    assert len(after) == 1 and after != pids  # the slow one's worker was killed, a fresh one answered
    assert _metric(url, LEFT) == left + 1
    assert _metric(url, CANCELLED) == cancelled + 1


def test_a_queued_request_whose_client_left_leaves_the_queue_and_a_shared_estimate_goes_on(service) -> None:
    url, app = service
    key = cache_key(EstimateRequest.model_validate(SLOW).model_dump(mode="json"))
    pids, cancelled, left = _worker_pids(), _metric(url, CANCELLED), _metric(url, LEFT)
    answers: dict[str, httpx.Response] = {}
    stayer = threading.Thread(target=lambda: answers.setdefault(
        "slow", httpx.post(f"{url}/estimate", json=SLOW, timeout=600)), daemon=True)  # the same: shares it
    with paused_workers(app):  # the slow estimate runs until all below has happened, however fast it is
        starter = _send(url, SLOW)  # starts the slow estimate (and leaves it below)
        _until("the slow estimate runs", lambda: _metric(url, BUSY) == 1)
        queued = _send(url, {**SMALL, "gpus": ["A100-80GB"]})
        _until("the small request is queued", lambda: _metric(url, BUSY) == 2)
        queued.close()
        _until("the small request left the queue (or got the worker)", lambda: _metric(url, BUSY) == 1)
        assert _metric(url, CANCELLED) == cancelled + 1  # it left the queue, while the slow estimate runs
        assert app.state.flights.waiting(key) == 1
        stayer.start()
        _until("a second caller waits for the same estimate", lambda: app.state.flights.waiting(key) == 2)
        starter.close()  # the caller that started it leaves; the second still waits: it goes on
        _until("the starter left", lambda: app.state.flights.waiting(key) == 1)
    stayer.join()
    assert answers["slow"].status_code == 200
    RESPONSE.validate_json(answers["slow"].content)
    assert _worker_pids() == pids  # the worker ran the shared estimate to its end: never killed
    assert _metric(url, CANCELLED) == cancelled + 1  # the queued one only
    _until("both leavers are counted", lambda: _metric(url, LEFT) == left + 2)


# --- progress as server-sent events ----------------------------------------------------------------------

def _events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of a text/event-stream body; comments (keep-alives) skipped."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if lines:
            name = next(line[7:] for line in lines if line.startswith("event: "))
            out.append((name, json.loads(next(line[6:] for line in lines if line.startswith("data: ")))))
    return out


def test_a_client_that_asks_for_events_hears_each_simulation_then_the_answer(service) -> None:
    url, _app = service
    body = {**SMALL, "gpus": ["L4-24GB"]}  # not cached yet
    streamed = httpx.post(f"{url}/estimate", json=body, headers={"Accept": "text/event-stream"}, timeout=600)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = _events(streamed.text)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"progress"} and len(kinds) > 1
    progress = [d for k, d in events if k == "progress"]
    assert [p["simulations"] for p in progress] == list(range(1, len(progress) + 1))
    assert progress[0]["note"].startswith("batch 1 on L4-24GB (")
    answer = events[-1][1]
    assert answer["provenance"]["simulations"] == len(progress)
    plain = httpx.post(f"{url}/estimate", json=body, timeout=600).json()  # the same answer, plainly
    for doc in (plain, answer):
        del doc["provenance"]["seconds"]
    assert plain == answer


def test_a_bad_request_is_refused_before_the_stream_and_a_failed_one_ends_it_with_its_problem(service) -> None:
    url, _app = service
    accept = {"Accept": "text/event-stream"}
    bad = httpx.post(f"{url}/estimate", json={**SMALL, "gpus": ["A100-90GB"]}, headers=accept, timeout=60)
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM and bad.json()["field"] == "gpus[0]"
    failed = httpx.post(f"{url}/estimate", json={**SMALL, "model": {"source": "torchvision", "name": "resnet5"}},
                        headers=accept, timeout=600)  # refused in the worker, after the stream began
    (name, problem), = _events(failed.text)
    assert name == "error" and problem["status"] == 422 and problem["field"] == "model.name"


def test_closing_an_event_stream_cancels_its_estimate(service) -> None:
    url, app = service
    pids, cancelled = _worker_pids(), _metric(url, CANCELLED)
    # every card's max confirmed by two full simulations: many more after the first than the pause below needs
    slower = {**SLOW, "gpus": ["T4-16GB", "L4-24GB", "A10G-24GB", "A100-40GB", "A100-80GB", "H100-80GB"],
              "planner": {"confirm": "every-card", "curve_points": 0}}
    with contextlib.ExitStack() as paused:
        with httpx.stream("POST", f"{url}/estimate", json=slower, headers={"Accept": "text/event-stream"},
                          timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: progress"):
                    break  # one simulation heard: leave in the middle
            paused.enter_context(paused_workers(app))  # held there (the rest takes a fraction of a second)
        _until("the slow estimate is over (cancelled, or finished)", lambda: _metric(url, BUSY) == 0)
    assert _metric(url, CANCELLED) == cancelled + 1
    _until("a fresh worker replaces the killed one", lambda: len(_worker_pids()) == 1 and _worker_pids() != pids)
