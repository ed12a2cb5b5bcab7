"""Stored profiles in the service: POST/GET/HEAD /profiles, POST /estimate by a profile's id or inline, tampered
profiles refused with nothing stored, ``batchfit profile push`` against a real server, and the Kubernetes
routes answering a pod by its ``batchfit.io/profile`` as by the equivalent ``batchfit.io/spec``.

The profile of a user's own factory (``--model mypkg:make``) is made by the CLI in a folder that is then
deleted, so everything after answers without the code that made it.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import os
import re
import shutil
import socket
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from support import PROBLEM, metric, service

from estimator.cli.main import main
from estimator.portable.schema import profile_id

pytestmark = pytest.mark.service
BODIES = Path(__file__).parent / "k8s"
CARDS = ["T4-16GB", "A100-80GB", "L4-24GB"]
FACTORY = '''
import torch.nn as nn


def make(width=24, classes=10):
    """A user's own network: batchfit's service never sees this code."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, classes))
'''


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def custom(tmp_path_factory) -> dict[str, Any]:
    """The profile of ``mypkg:make`` by ``batchfit profile --model``, and the CLI's ``--profile`` answer on three
    cards, given after ``mypkg`` is gone (its folder deleted, its modules forgotten)."""
    code_dir, out_dir = tmp_path_factory.mktemp("code"), tmp_path_factory.mktemp("profile")
    (code_dir / "mypkg").mkdir()
    (code_dir / "mypkg" / "__init__.py").write_text(FACTORY)
    (code_dir / "job.json").write_text(json.dumps({"model": {"source": "torchvision", "name": "resnet18"},
                                                   "input": {"image_size": [3, 32, 32]},
                                                   "planner": {"curve_points": 4}}))
    path = out_dir / "p.json"
    was = os.getcwd()
    os.chdir(code_dir)
    try:
        code, out, err = run_cli("profile", "--spec", "job.json", "--model", "mypkg:make", "-o", str(path), "--quiet")
    finally:
        os.chdir(was)
        if str(code_dir) in sys.path:
            sys.path.remove(str(code_dir))
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]
        shutil.rmtree(code_dir)
    assert code == 0, err
    assert "custom:mypkg:make" in out
    code, out, err = run_cli("estimate", "--profile", str(path), "--gpus", *CARDS, "--json")
    assert code == 0, err  # answered without the code (it raised "model.source: got 'custom'" before)
    return {"path": path, "doc": json.loads(path.read_text()), "cli": json.loads(out)}


@pytest.fixture(scope="module")
def cache_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache") / "cache.sqlite"


@pytest.fixture(scope="module")
def client(cache_file):
    with service(cache_file, queue_size=8, request_timeout_s=300, k8s_deadline_s=30,
                 max_profile_bytes=4 * 2**20) as c:
        yield c


def stored(cache_file: Path) -> int:
    with contextlib.closing(sqlite3.connect(cache_file)) as db:
        (count,) = db.execute("SELECT COUNT(*) FROM profiles").fetchone()
    return int(count)


def test_a_custom_factorys_profile_is_answered_by_the_cli_without_its_code(custom) -> None:
    assert custom["doc"]["request"]["model"] == {"source": "custom", "factory": "mypkg:make", "kwargs": {}}
    results = custom["cli"]["results"]
    assert [r["gpu"] for r in results] == CARDS
    assert all(r["search"]["method"] == "profile" for r in results)
    assert all(r["max_batch_size"] > r["recommended_batch_size"] > 0 for r in results)
    assert custom["cli"]["provenance"]["simulations"] == 0


def test_post_get_and_head_a_profile(client, custom, cache_file) -> None:
    doc = custom["doc"]
    r = client.post("/profiles", json=doc)
    assert r.status_code == 201 and r.json() == {"id": profile_id(doc)}
    key = r.json()["id"]
    assert r.headers["location"] == f"/profiles/{key}"
    again = client.post("/profiles", content=json.dumps(doc, indent=2), headers={"content-type": "application/json"})
    assert again.status_code == 201 and again.json()["id"] == key  # the canonical JSON: spacing is no part of it
    assert stored(cache_file) >= 1
    got = client.get(f"/profiles/{key}")
    assert got.status_code == 200 and got.json() == doc
    assert client.head(f"/profiles/{key}").status_code == 200
    unknown = "sha256:" + "0" * 64
    misses = metric(client, 'batchfit_requests_total{route="/profiles/{id}",status="404"}')
    assert client.head(f"/profiles/{unknown}").status_code == 404
    missing = client.get(f"/profiles/{unknown}")
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM
    assert missing.json()["field"] == "profile_id" and missing.json()["value"] == unknown
    assert metric(client, 'batchfit_requests_total{route="/profiles/{id}",status="404"}') == misses + 2


def test_estimate_by_id_answers_as_the_cli_does_from_the_file(client, custom) -> None:
    key = client.post("/profiles", json=custom["doc"]).json()["id"]
    r = client.post("/estimate", json={"profile": key, "gpus": CARDS})
    assert r.status_code == 200, r.text
    answer = r.json()
    for mine, cli in zip(answer["results"], custom["cli"]["results"], strict=True):
        assert (mine["gpu"], mine["max_batch_size"], mine["recommended_batch_size"]) == \
               (cli["gpu"], cli["max_batch_size"], cli["recommended_batch_size"])
        assert mine["search"] == {"method": "profile", "checked_batch": None}
    assert answer["results"] == custom["cli"]["results"]  # every number, not only the batches
    assert client.post("/estimate", json={"profile": key, "gpus": CARDS}).headers["x-batchfit-cache"] == "hit"
    inline = client.post("/estimate", json={"profile": custom["doc"], "gpus": CARDS})
    assert inline.status_code == 200 and inline.json()["results"] == answer["results"]
    planned = client.post("/estimate", json={"profile": key, "gpus": ["T4-16GB"], "batch_size": 8,
                                             "planner": {"headroom": 0.3}})
    assert planned.status_code == 200
    t4 = planned.json()["results"][0]
    assert t4["memory"]["batch_size"] == 8
    assert t4["recommended_batch_size"] < custom["cli"]["results"][0]["recommended_batch_size"]  # more headroom


@pytest.mark.parametrize("extra, named", [
    ({"model": {"source": "torchvision", "name": "resnet18"}}, ["model"]),
    ({"training": {"precision": "bf16"}, "input": {"image_size": [3, 64, 64]}}, ["input", "training"]),
    ({"validate": True}, ["validate"]),
])
def test_fields_a_profile_fixes_are_refused_beside_it(client, extra, named) -> None:
    r = client.post("/estimate", json={"profile": "sha256:" + "1" * 64, **extra})
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["field"] == named[0]
    assert all(name in problem["value"] for name in named)


def test_estimate_by_an_unknown_id_is_a_404_and_a_bad_id_a_422(client) -> None:
    r = client.post("/estimate", json={"profile": "sha256:" + "2" * 64, "gpus": ["T4-16GB"]})
    assert r.status_code == 404 and r.json()["field"] == "profile"
    bad = client.post("/estimate", json={"profile": "md5:abc"})
    assert bad.status_code == 422 and bad.json()["field"] == "profile"


def _deep_type(doc: dict[str, Any]) -> None:
    doc["steps"][""]["events"][3][1] = "2"


def _path_like(doc: dict[str, Any]) -> None:
    doc["steps"][""]["modules"][0] = "../../etc/passwd"


def _other_version(doc: dict[str, Any]) -> None:
    doc["version"] = 2


def _factory_path(doc: dict[str, Any]) -> None:
    doc["request"]["model"]["factory"] = "http://example.com/evil:make"


def _unknown_category(doc: dict[str, Any]) -> None:
    doc["first_steps"][""]["categories"][0] = "weights"


def _free_before_alloc(doc: dict[str, Any]) -> None:
    events = doc["steps"][""]["events"]
    events[0] = [0, events[0][1]]


@pytest.mark.parametrize("tamper, field, expected", [
    (_deep_type, 'profile.steps[""].events[3][1]', "an integer"),
    (_path_like, 'profile.steps[""].modules[0]', "not a path or URL"),
    (_other_version, "profile.version", "re-run `batchfit profile`"),
    (_factory_path, "profile.request.model.factory", "not a path or URL"),
    (_unknown_category, 'profile.first_steps[""].categories[0]', "one of"),
    (_free_before_alloc, 'profile.steps[""].events[0]', "allocated once"),
])
def test_a_tampered_profile_is_refused_and_nothing_is_stored(client, custom, cache_file, tamper, field,
                                                             expected) -> None:
    doc = copy.deepcopy(custom["doc"])
    tamper(doc)
    before = stored(cache_file)
    r = client.post("/profiles", json=doc)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text
    assert r.json()["field"] == field and expected in r.json()["expected"]
    assert stored(cache_file) == before
    assert client.head(f"/profiles/{profile_id(doc)}").status_code == 404
    inline = client.post("/estimate", json={"profile": doc, "gpus": ["T4-16GB"]})
    assert inline.status_code == 422 and inline.json()["field"] == field  # inline: the same check


def test_nan_and_a_ten_million_element_array_are_refused_unread(client, custom, cache_file) -> None:
    before = stored(cache_file)
    text = re.sub(r'"parameter_count": \d+', '"parameter_count": NaN', json.dumps(custom["doc"]), count=1)
    r = client.post("/profiles", content=text, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "profile.parameter_count"
    huge = copy.deepcopy(custom["doc"])
    huge["steps"][""]["const"] = [0] * 10**7  # 20 MB of JSON: past BATCHFIT_MAX_PROFILE_BYTES
    r = client.post("/profiles", content=json.dumps(huge, separators=(",", ":")),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "BATCHFIT_MAX_PROFILE_BYTES" in r.json()["detail"]
    not_json = client.post("/profiles", content=b'{"schema": ', headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["field"] == "(body)"
    assert client.post("/profiles", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    assert stored(cache_file) == before


def test_profile_push_prints_the_id(custom, tmp_path) -> None:
    """``batchfit profile push`` against the service on a real port (uvicorn), with and without its key."""
    import uvicorn

    from app.main import create_app
    from app.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Settings(workers=1, cache_path=str(tmp_path / "c.sqlite"), api_keys="k-1"), start_workers=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        code, out, err = run_cli("profile", "push", str(custom["path"]), "--url", url, "--api-key", "k-1")
        assert code == 0, err
        assert out.strip() == profile_id(custom["doc"])
        code, out, err = run_cli("profile", "push", str(custom["path"]), "--url", url)
        assert code == 3 and "401" in err  # no key
        bad = tmp_path / "bad.json"
        tampered = copy.deepcopy(custom["doc"])
        _other_version(tampered)
        bad.write_text(json.dumps(tampered))
        code, out, err = run_cli("profile", "push", str(bad), "--url", url, "--api-key", "k-1")
        assert code == 2 and "profile.version" in err and "re-run `batchfit profile`" in err
        code, _, err = run_cli("profile", "push", str(custom["path"]), "--url", "ftp://x")
        assert code == 2 and "--url" in err
    finally:
        server.should_exit = True
        thread.join(30)


# --- Kubernetes: batchfit.io/profile for batchfit.io/spec ------------------------------------------------------


@pytest.fixture(scope="module")
def filter_profile(client) -> str:
    """The id of the stored profile of tests/k8s/filter.json's spec (the same request, traced once)."""
    from estimator import make_profile, parse_request

    args = json.loads((BODIES / "filter.json").read_text())
    spec = json.loads(args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"])
    doc = make_profile(parse_request(spec)).to_json()
    r = client.post("/profiles", json=doc)
    assert r.status_code == 201
    key: str = r.json()["id"]
    return key


def _by_profile(args: dict[str, Any], key: str) -> dict[str, Any]:
    notes = args["Pod"]["metadata"]["annotations"]
    del notes["batchfit.io/spec"]
    notes["batchfit.io/profile"] = key
    return args


@pytest.mark.parametrize("batch", ["64", None])
def test_the_filter_fails_the_same_nodes_by_profile_as_by_spec(client, filter_profile, batch) -> None:
    by_spec = json.loads((BODIES / "filter.json").read_text())
    if batch is None:
        del by_spec["Pod"]["metadata"]["annotations"]["batchfit.io/batch-size"]
    by_profile = _by_profile(copy.deepcopy(by_spec), filter_profile)
    spec_out = client.post("/k8s/filter", json=by_spec).json()
    profile_out = client.post("/k8s/filter", json=by_profile).json()
    assert spec_out["FailedAndUnresolvableNodes"].keys() == {"gpu-t4-1"}  # the T4 cannot hold the pod's batch
    assert profile_out["FailedAndUnresolvableNodes"] == spec_out["FailedAndUnresolvableNodes"]
    assert profile_out["NodeNames"] == spec_out["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1"]
    assert profile_out["FailedNodes"] == {} and profile_out["Error"] == ""
    ranked = client.post("/k8s/prioritize", json=_by_profile(json.loads((BODIES / "prioritize.json").read_text()),
                                                             filter_profile)).json()
    assert [p["Host"] for p in ranked] == ["gpu-a100-80-1", "gpu-l4-1"] and ranked[0]["Score"] == 10


def test_a_pod_naming_a_profile_not_stored_is_not_opted_in(client) -> None:
    args = _by_profile(json.loads((BODIES / "filter.json").read_text()), "sha256:" + "3" * 64)
    missing = metric(client, 'batchfit_k8s_profile_missing_total{verb="filter"}')
    not_in = metric(client, 'batchfit_k8s_calls_total{outcome="not-opted-in",verb="filter"}')
    started = metric(client, "batchfit_k8s_estimates_total")
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"] and out["FailedAndUnresolvableNodes"] == {}
    assert metric(client, 'batchfit_k8s_profile_missing_total{verb="filter"}') == missing + 1
    assert metric(client, 'batchfit_k8s_calls_total{outcome="not-opted-in",verb="filter"}') == not_in + 1
    assert metric(client, "batchfit_k8s_estimates_total") == started  # nothing to estimate
    review = json.loads((BODIES / "admission_pinned.json").read_text())
    _by_profile({"Pod": review["request"]["object"]}, "sha256:" + "3" * 64)
    answer = client.post("/k8s/mutate", json=review).json()["response"]
    assert answer["allowed"] is True and "patch" not in answer
    assert "batchfit.io/profile" in answer["warnings"][0]
    assert metric(client, 'batchfit_k8s_profile_missing_total{verb="mutate"}') >= 1


def test_the_webhook_sets_a_profile_pods_batch(client, filter_profile) -> None:
    review = json.loads((BODIES / "admission_pinned.json").read_text())
    pod = review["request"]["object"]
    _by_profile({"Pod": pod}, filter_profile)
    answer = client.post("/k8s/mutate", json=review).json()["response"]
    assert answer["allowed"] is True and "patch" in answer, answer
    (a100,) = client.post("/estimate", json={"profile": filter_profile, "gpus": ["A100-80GB"]}).json()["results"]
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(answer["patch"])))
    env = {e["name"]: e["value"] for e in patched["spec"]["containers"][0]["env"]}
    assert env["BATCHFIT_MAX_BATCH_SIZE"] == str(a100["max_batch_size"])
    assert patched["metadata"]["annotations"]["batchfit.io/estimate"].startswith("NVIDIA-A100-SXM4-80GB: batch ")


def test_an_inline_profile_of_many_allocations_is_answered_as_by_id(client) -> None:
    """A body with an inline profile may hold more items than a request's 20,000 (resnet50's has 40,000): it is
    bounded by its size and the profile's schema instead."""
    from test_profile_schema import profile

    n = 4000  # activations of 1 KiB + 512 B per sample, each freed before the next: 4 KiB parameter first
    wide = {"schema": 3, "const": [4096] + [1024] * n, "per_sample": [0] + [512] * n,
            "categories": ["parameter"] + ["activation"] * n,
            "events": [[1, 0]] + [e for i in range(1, n + 1) for e in ([1, i], [0, i])],
            "phases": ["setup"] + ["forward"] * n, "modules": [""] + [str(i) for i in range(n)], "min_batch": 1}
    doc = profile()
    doc["steps"][""], doc["first_steps"][""] = wide, copy.deepcopy(wide)
    body = json.dumps({"profile": doc, "gpus": ["T4-16GB"]})
    assert body.count(",") + body.count(":") > 20_000
    inline = client.post("/estimate", content=body, headers={"content-type": "application/json"})
    assert inline.status_code == 200, inline.text
    key = client.post("/profiles", json=doc).json()["id"]
    by_id = client.post("/estimate", json={"profile": key, "gpus": ["T4-16GB"]})
    assert by_id.json()["results"] == inline.json()["results"]
    assert inline.json()["results"][0]["max_batch_size"] > 1000  # one activation live at a time: 512 B a sample


def test_estimate_by_profile_streams_its_answer(client, custom) -> None:
    key = client.post("/profiles", json=custom["doc"]).json()["id"]
    body = {"profile": key, "gpus": ["V100-16GB"]}  # a card no other test asks: not in the cache yet
    streamed = client.post("/estimate", json=body, headers={"Accept": "text/event-stream"})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n") for block in streamed.text.strip().split("\n\n")]
    assert events[-1][0] == "event: result"
    result = json.loads(events[-1][1].removeprefix("data: "))
    assert result["results"][0]["search"]["method"] == "profile"
    plain = client.post("/estimate", json=body)
    assert plain.headers["x-batchfit-cache"] == "hit" and plain.json() == result
