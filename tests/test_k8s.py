"""Kubernetes: the scheduler extender and the admission webhook on recorded wire-format bodies (tests/k8s/),
answered by the real service (worker pool, cache) and checked against POST /estimate's own numbers."""

from __future__ import annotations

import base64
import copy
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from fastapi.testclient import TestClient
from support import metric, paused_workers, service

from app.k8s.answers import card_key
from app.k8s.cards import node_card
from app.k8s.pods import training_pod
from app.main import create_app
from app.settings import Settings

pytestmark = pytest.mark.service
BODIES = Path(__file__).parent / "k8s"
RESERVE = 256 * 2**20  # planner.reserve_bytes' default (docs/API.md)


def body(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((BODIES / f"{name}.json").read_text())
    return doc


def spec_of(pod: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(pod["metadata"]["annotations"]["batchfit.io/spec"])
    return spec


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with service(tmp_path_factory.mktemp("k8s") / "cache.sqlite", queue_size=8, request_timeout_s=300,
                 k8s_deadline_s=30) as c:
        yield c


def direct(client: TestClient, pod: dict[str, Any], gpus: list[str], batch: int | None) -> list[dict[str, Any]]:
    """What POST /estimate answers for the pod's spec on ``gpus`` (as the k8s routes ask it: no suggestions)."""
    request = spec_of(pod) | {"gpus": gpus, "batch_size": batch}
    request["planner"] = {**request.get("planner", {}), "suggestions": False}
    r = client.post("/estimate", json=request)
    assert r.status_code == 200, r.text
    results: list[dict[str, Any]] = r.json()["results"]
    return results


def usable(client: TestClient, name: str) -> int:
    card = next(g for g in client.get("/gpus").json()["gpus"] if g["name"] == name)
    return int(card["memory_bytes"] - card["context_bytes"] - RESERVE)


def test_filter_three_nodes(client) -> None:
    args = body("filter")
    r = client.post("/k8s/filter", json=args)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    out = r.json()
    assert set(out) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    t4, a100, l4 = args["Nodes"]["items"]
    assert out["Nodes"] == {"metadata": {}, "items": [a100, l4]}  # the passing nodes' objects, unchanged
    assert out["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1"]
    assert out["FailedNodes"] == {} and out["Error"] == ""
    # batch 64 (batchfit.io/batch-size): the same numbers POST /estimate gives for the T4
    (t4_result,) = direct(client, args["Pod"], ["T4-16GB"], 64)
    need = t4_result["memory"]["reserved_peak_bytes"]
    assert not t4_result["memory"]["fits"]
    assert out["FailedAndUnresolvableNodes"] == {
        "gpu-t4-1": f"needs {need / 2**30:.1f} GiB at batch 64; Tesla-T4 has {usable(client, 'T4-16GB') / 2**30:.1f} "
                    "GiB usable"}
    assert re.fullmatch(r"needs \d+\.\d GiB at batch 64; Tesla-T4 has \d+\.\d GiB usable",
                        out["FailedAndUnresolvableNodes"]["gpu-t4-1"])


def test_filter_without_a_batch_fails_where_batch_1_does_not_fit(client) -> None:
    args = body("filter")
    del args["Pod"]["metadata"]["annotations"]["batchfit.io/batch-size"]
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1"]  # L4 holds batch 1 (not 64's headroom: it passes)
    (t4_result,) = direct(client, args["Pod"], ["T4-16GB"], None)
    assert t4_result["max_batch_size"] is None
    assert out["FailedAndUnresolvableNodes"]["gpu-t4-1"].startswith(
        f"needs {t4_result['memory']['reserved_peak_bytes'] / 2**30:.1f} GiB at batch 1; Tesla-T4 has ")


def test_prioritize_scores_headroom(client) -> None:
    args = body("prioritize")
    r = client.post("/k8s/prioritize", json=args)
    assert r.status_code == 200
    out = r.json()
    a100, l4 = direct(client, args["Pod"], ["A100-80GB", "L4-24GB"], 64)
    room = {"gpu-a100-80-1": usable(client, "A100-80GB") - a100["memory"]["reserved_peak_bytes"],
            "gpu-l4-1": usable(client, "L4-24GB") - l4["memory"]["reserved_peak_bytes"]}
    assert room["gpu-a100-80-1"] > room["gpu-l4-1"] > 0
    best = max(room.values())
    assert out == [{"Host": host, "Score": max(1, math.floor(10 * v / best + 0.5))} for host, v in room.items()]
    assert out[0]["Score"] == 10 and 1 <= out[1]["Score"] < 10  # the L4 fits: never the 0 of a node that does not


def test_prioritize_without_a_batch_scores_the_max_batch(client) -> None:
    args = body("prioritize")
    del args["Pod"]["metadata"]["annotations"]["batchfit.io/batch-size"]
    out = client.post("/k8s/prioritize", json=args).json()
    a100, l4 = direct(client, args["Pod"], ["A100-80GB", "L4-24GB"], None)
    assert out == [{"Host": "gpu-a100-80-1", "Score": 10},
                   {"Host": "gpu-l4-1",
                    "Score": max(1, math.floor(10 * l4["max_batch_size"] / a100["max_batch_size"] + 0.5))}]


def test_a_pod_without_the_spec_and_a_node_without_gpu_labels_pass_untouched(client) -> None:
    started = metric(client, "batchfit_k8s_estimates_total")
    args = body("filter")
    del args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"]
    out = client.post("/k8s/filter", json=args).json()
    assert out["Nodes"]["items"] == args["Nodes"]["items"] and out["FailedAndUnresolvableNodes"] == {}
    scores = client.post("/k8s/prioritize", json=args).json()
    assert scores == [{"Host": n["metadata"]["name"], "Score": 0} for n in args["Nodes"]["items"]]
    assert metric(client, "batchfit_k8s_estimates_total") == started  # nothing was estimated
    assert metric(client, 'batchfit_k8s_calls_total{outcome="not-opted-in",verb="filter"}') >= 1
    cpu = copy.deepcopy(body("filter"))
    node = cpu["Nodes"]["items"][0]
    node["metadata"]["name"] = "cpu-1"
    node["metadata"]["labels"] = {k: v for k, v in node["metadata"]["labels"].items() if "nvidia.com" not in k}
    out = client.post("/k8s/filter", json=cpu).json()
    assert "cpu-1" in out["NodeNames"] and "cpu-1" not in out["FailedAndUnresolvableNodes"]


def test_an_unknown_card_with_a_memory_label_is_a_custom_card(client) -> None:
    args = body("filter")
    big, small, unnamed = copy.deepcopy(args["Nodes"]["items"][:3])
    for node, product, memory in ((big, "NVIDIA-B200", "183359"), (small, "NVIDIA-RTX-A2000", "6138"),
                                  (unnamed, "NVIDIA-Mystery", None)):
        node["metadata"]["name"] = product.lower()
        node["metadata"]["labels"]["nvidia.com/gpu.product"] = product
        node["metadata"]["labels"].pop("nvidia.com/gpu.memory")
        if memory:
            node["metadata"]["labels"]["nvidia.com/gpu.memory"] = memory
    args["Nodes"]["items"] = [big, small, unnamed]
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["nvidia-b200", "nvidia-mystery"]  # no memory label: nobody can size it, it passes
    reason = out["FailedAndUnresolvableNodes"]["nvidia-rtx-a2000"]  # 6138 MiB less the default 450 MiB context
    assert reason.endswith(f"; NVIDIA-RTX-A2000 has {((6138 - 450) * 2**20 - RESERVE) / 2**30:.1f} GiB usable "
                           "(not in batchfit's catalog: 6138 MiB from nvidia.com/gpu.memory, a 450 MiB CUDA context "
                           "assumed)")


def test_a_bad_spec_annotation_passes_every_node(client) -> None:
    args = body("filter")
    unknown = {"model": {"source": "torchvision", "name": "resnet5"}}
    args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"] = json.dumps(unknown)
    errors = metric(client, 'batchfit_k8s_calls_total{outcome="error",verb="filter"}')
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"] and out["FailedAndUnresolvableNodes"] == {}
    assert out["Error"] == ""  # an Error would fail the scheduling attempt: a pod's own mistake never does
    assert metric(client, 'batchfit_k8s_calls_total{outcome="error",verb="filter"}') == errors + 1
    args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"] = "{not json"
    assert client.post("/k8s/filter", json=args).json()["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"]


def test_not_extender_args_is_a_problem(client) -> None:
    r = client.post("/k8s/filter", json={"pod": {}})
    assert r.status_code == 422 and r.json()["field"] == "Pod"
    r = client.post("/k8s/filter", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and r.json()["field"] == "(body)"
    r = client.post("/k8s/mutate", json={"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                                         "request": {"uid": "x"}})
    assert r.status_code == 422 and r.json()["field"] == "apiVersion"


def decoded(response: dict[str, Any]) -> list[dict[str, Any]]:
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env") or []}


def test_mutate_a_pinned_pod(client) -> None:
    review = body("admission_pinned")
    r = client.post("/k8s/mutate", json=review)
    assert r.status_code == 200
    out = r.json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    response = out["response"]
    assert response["uid"] == review["request"]["uid"] and response["allowed"] is True
    assert "warnings" not in response
    pod = review["request"]["object"]
    patched = jsonpatch.apply_patch(pod, decoded(response))
    (a100,) = direct(client, pod, ["A100-80GB"], None)
    plan = a100["accumulation"]  # planner.target_global_batch 4096
    assert plan["micro_batch"] * plan["steps"] >= 4096
    trainer, shipper = patched["spec"]["containers"]
    assert env_of(trainer) == {"NCCL_DEBUG": "WARN", "BATCHFIT_BATCH_SIZE": str(plan["micro_batch"]),
                               "BATCHFIT_GRAD_ACCUM": str(plan["steps"]),
                               "BATCHFIT_MAX_BATCH_SIZE": str(a100["max_batch_size"])}
    assert "env" not in shipper  # it requests no GPU
    summary = patched["metadata"]["annotations"]["batchfit.io/estimate"]
    assert summary == (f"NVIDIA-A100-SXM4-80GB: batch {plan['micro_batch']} x {plan['steps']} accumulation steps "
                       f"(recommended {a100['recommended_batch_size']}, max {a100['max_batch_size']}); batchfit 0.6.0")
    # everything else is as it was
    patched["spec"]["containers"][0]["env"] = pod["spec"]["containers"][0]["env"]
    del patched["metadata"]["annotations"]["batchfit.io/estimate"]
    assert patched == pod


def test_mutate_with_a_batch_replaces_existing_variables(client) -> None:
    review = body("admission_pinned")
    pod = review["request"]["object"]
    pod["metadata"]["annotations"]["batchfit.io/batch-size"] = "100"
    pod["spec"]["containers"][0]["env"].append({"name": "BATCHFIT_BATCH_SIZE", "value": "7"})
    del pod["spec"]["containers"][1]["resources"]
    pod["spec"]["containers"][1]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}  # a second GPU container
    response = client.post("/k8s/mutate", json=review).json()["response"]
    patched = jsonpatch.apply_patch(pod, decoded(response))
    (a100,) = direct(client, pod, ["A100-80GB"], 100)
    steps = math.ceil(4096 / 100)
    for container in patched["spec"]["containers"]:
        env = env_of(container)
        assert env["BATCHFIT_BATCH_SIZE"] == "100" and env["BATCHFIT_GRAD_ACCUM"] == str(steps)
        assert env["BATCHFIT_MAX_BATCH_SIZE"] == str(a100["max_batch_size"])
    assert [e["name"] for e in patched["spec"]["containers"][0]["env"]].count("BATCHFIT_BATCH_SIZE") == 1
    need, room = a100["memory"]["reserved_peak_bytes"] / 2**30, usable(client, "A100-80GB") / 2**30
    assert patched["metadata"]["annotations"]["batchfit.io/estimate"] == (
        f"NVIDIA-A100-SXM4-80GB: batch 100 x {steps} accumulation steps ({need:.1f} GiB of {room:.1f} GiB usable; "
        f"max {a100['max_batch_size']}); batchfit 0.6.0")


def test_mutate_an_unpinned_pod_leaves_it_unchanged(client) -> None:
    review = body("admission_unpinned")
    response = client.post("/k8s/mutate", json=review).json()["response"]
    assert response["uid"] == review["request"]["uid"] and response["allowed"] is True
    assert "patch" not in response and "patchType" not in response
    (warning,) = response["warnings"]
    assert warning.startswith("batchfit: not changed: the pod is not pinned to a GPU type") and len(warning) <= 256
    review["request"]["object"]["metadata"]["annotations"]["batchfit.io/gpu"] = "NVIDIA-Z9000"
    (warning,) = client.post("/k8s/mutate", json=review).json()["response"]["warnings"]
    assert warning == "batchfit: not changed: NVIDIA-Z9000 is not a card batchfit knows"


def mutate_denying_unfit(client: TestClient, review: dict[str, Any]) -> dict[str, Any]:
    """POST /k8s/mutate with BATCHFIT_WEBHOOK_DENY_UNFIT=1 (the route reads the setting per call)."""
    app: Any = client.app
    settings = app.state.settings
    app.state.settings = settings.model_copy(update={"webhook_deny_unfit": True})
    try:
        response: dict[str, Any] = client.post("/k8s/mutate", json=review).json()["response"]
    finally:
        app.state.settings = settings
    return response


def test_mutate_an_unfit_pod(client) -> None:
    review = body("admission_unfit")  # required node affinity: Tesla-T4
    pod = review["request"]["object"]
    response = client.post("/k8s/mutate", json=review).json()["response"]
    (t4,) = direct(client, pod, ["T4-16GB"], None)
    assert t4["max_batch_size"] is None
    need, room = t4["memory"]["reserved_peak_bytes"] / 2**30, usable(client, "T4-16GB") / 2**30
    message = (f"batchfit: the job does not fit Tesla-T4 even at batch 1: it needs {need:.1f} GiB at batch 1; "
               f"Tesla-T4 has {room:.1f} GiB usable")
    assert response["allowed"] is True and response["warnings"] == [message]
    patched = jsonpatch.apply_patch(pod, decoded(response))
    assert all(env_of(c).keys() <= {"NCCL_DEBUG"} for c in patched["spec"]["containers"])  # no batch to give
    assert patched["metadata"]["annotations"]["batchfit.io/estimate"].startswith("Tesla-T4: does not fit (needs ")
    denied = mutate_denying_unfit(client, review)
    assert denied == {"uid": review["request"]["uid"], "allowed": False,
                      "status": {"code": 403, "reason": "Forbidden", "message": message}}


def wait_for_estimates(app: Any) -> None:
    """Until no Kubernetes estimate is running (a job outlives the call that started it)."""
    for _ in range(1200):
        if not app.state.k8s._pending:
            return
        time.sleep(0.5)
    raise AssertionError("the estimates did not finish in 10 minutes")


def test_a_late_estimate_passes_every_node_and_the_retry_hits(tmp_path) -> None:
    """BATCHFIT_K8S_WHEN_LATE=pass, the miss path: the call answers at its deadline, while the estimate is still
    running, and passes every node; the estimate goes on in the background, and the scheduler's next attempt
    gets the real answer from it."""
    app = create_app(Settings(workers=1, queue_size=8, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=300,
                              k8s_deadline_s=0.2, k8s_when_late="pass"))
    args = body("filter")
    with TestClient(app) as late:
        with paused_workers(app):  # the estimate waits until the calls below are answered, however fast it runs
            first = late.post("/k8s/filter", json=args).json()
            running = set(app.state.k8s._pending.values())  # one job for the three cards, outliving the call
            assert len(running) == 1 and not next(iter(running)).done()
            assert first["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"]
            assert first["FailedAndUnresolvableNodes"] == {} and first["FailedNodes"] == {}
            assert metric(late, 'batchfit_k8s_late_total{verb="filter"}') == 1
            assert metric(late, 'batchfit_k8s_holds_total{card="Tesla-T4"}') == 0  # passed, not held
            scores = late.post("/k8s/prioritize", json=body("prioritize")).json()  # a subset of the same cards
            assert all(s["Score"] == 0 for s in scores)
        wait_for_estimates(app)
        retry = late.post("/k8s/filter", json=args).json()
        assert retry["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1"] and list(retry["FailedAndUnresolvableNodes"]) == [
            "gpu-t4-1"]
        assert metric(late, "batchfit_k8s_estimates_total") == 1  # one job served every call
        assert metric(late, 'batchfit_k8s_calls_total{outcome="answered",verb="filter"}') == 1


def test_a_late_estimate_holds_the_gpu_nodes_and_the_retry_hits(tmp_path) -> None:
    """BATCHFIT_K8S_WHEN_LATE=hold (the default): the GPU nodes without an answer at the deadline fail as
    resolvable (FailedNodes), so kube-scheduler keeps the pod and retries it; a node without GPU labels still
    passes; nothing is ranked as if it fit; the retry is judged, and the held pod's wait is measured."""
    app = create_app(Settings(workers=1, queue_size=8, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=300,
                              k8s_deadline_s=0.2))
    args = body("filter")
    cpu = copy.deepcopy(args["Nodes"]["items"][0])
    cpu["metadata"]["name"] = "cpu-1"
    cpu["metadata"]["labels"] = {k: v for k, v in cpu["metadata"]["labels"].items() if "nvidia.com" not in k}
    args["Nodes"]["items"].append(cpu)
    with TestClient(app) as late:
        with paused_workers(app):  # the estimate waits until the calls below are answered, however fast it runs
            first = late.post("/k8s/filter", json=args).json()
            running = set(app.state.k8s._pending.values())
            assert len(running) == 1 and not next(iter(running)).done()  # answered while the estimate runs
            assert first["NodeNames"] == ["cpu-1"] and first["Nodes"]["items"] == [cpu]
            assert first["FailedNodes"] == {
                "gpu-t4-1": "batchfit: estimate pending for Tesla-T4; retry",
                "gpu-a100-80-1": "batchfit: estimate pending for NVIDIA-A100-SXM4-80GB; retry",
                "gpu-l4-1": "batchfit: estimate pending for NVIDIA-L4; retry"}
            assert first["FailedAndUnresolvableNodes"] == {} and first["Error"] == ""
            scores = late.post("/k8s/prioritize", json=body("prioritize")).json()
            assert scores == [{"Host": "gpu-a100-80-1", "Score": 0}, {"Host": "gpu-l4-1", "Score": 0}]
            again = late.post("/k8s/filter", json=args).json()  # a retry before the answer: held again
            assert again["FailedNodes"] == first["FailedNodes"]
            assert metric(late, 'batchfit_k8s_holds_total{card="Tesla-T4"}') == 2
            assert metric(late, 'batchfit_k8s_held_pods{card="Tesla-T4"}') == 1  # one pod, held twice
            assert metric(late, 'batchfit_k8s_held_pods{card="NVIDIA-L4"}') == 1
        wait_for_estimates(app)
        retry = late.post("/k8s/filter", json=args).json()
        assert retry["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1", "cpu-1"] and retry["FailedNodes"] == {}
        assert list(retry["FailedAndUnresolvableNodes"]) == ["gpu-t4-1"]
        for card in ("Tesla-T4", "NVIDIA-A100-SXM4-80GB", "NVIDIA-L4"):
            assert metric(late, f'batchfit_k8s_held_pods{{card="{card}"}}') == 0
            assert metric(late, f'batchfit_k8s_hold_wait_seconds_count{{card="{card}"}}') == 1
            assert metric(late, f'batchfit_k8s_hold_wait_seconds_sum{{card="{card}"}}') > 0
        assert metric(late, "batchfit_k8s_estimates_total") == 1


def test_a_defect_passes_every_node_even_when_holding(client, monkeypatch) -> None:
    """A fault inside batchfit (here: looking answers up raises) is no reason to hold a pod: every node passes,
    prioritize scores 0, the call is counted as an error."""
    app: Any = client.app
    assert app.state.settings.k8s_when_late == "hold"

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app.state.k8s, "answers", broken)
    errors = metric(client, 'batchfit_k8s_calls_total{outcome="error",verb="filter"}')
    args = body("filter")
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"] and out["Nodes"] == args["Nodes"]
    assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {} and out["Error"] == ""
    assert metric(client, 'batchfit_k8s_calls_total{outcome="error",verb="filter"}') == errors + 1
    scores = client.post("/k8s/prioritize", json=body("prioritize")).json()
    assert scores == [{"Host": "gpu-a100-80-1", "Score": 0}, {"Host": "gpu-l4-1", "Score": 0}]


LLAMA_POD = {"model": {"source": "transformers", "preset": "llama-3-8b"}, "input": {"seq_len": 1024},
             "training": {"precision": "bf16", "optimizer": {"name": "adafactor"}}, "planner": {"curve_points": 0}}


def test_a_fresh_service_never_passes_a_t4_blind(tmp_path) -> None:
    """An uncached llama-3-8b pod over a T4 node and an A100 node, on a service with an empty cache: the first
    filter call answers at its deadline, while the estimate still runs, and does not pass the T4; once the
    estimate is done, the T4 fails as unresolvable and the A100 is judged by its answer."""
    app = create_app(Settings(workers=1, queue_size=8, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=600,
                              k8s_deadline_s=0.5))
    args = body("filter")
    args["Nodes"]["items"] = args["Nodes"]["items"][:2]  # gpu-t4-1, gpu-a100-80-1
    args["Pod"]["metadata"]["annotations"] = {"batchfit.io/spec": json.dumps(LLAMA_POD), "batchfit.io/batch-size": "1"}
    with TestClient(app) as fresh:
        first = fresh.post("/k8s/filter", json=args).json()
        running = set(app.state.k8s._pending.values())
        assert len(running) == 1 and not next(iter(running)).done()  # within the deadline: the job still runs
        assert "gpu-t4-1" not in first["NodeNames"] and first["Nodes"]["items"] == []
        assert first["FailedNodes"]["gpu-t4-1"] == "batchfit: estimate pending for Tesla-T4; retry"
        wait_for_estimates(app)
        retry = fresh.post("/k8s/filter", json=args).json()
        assert re.fullmatch(r"needs \d+\.\d GiB at batch 1; Tesla-T4 has \d+\.\d GiB usable",
                            retry["FailedAndUnresolvableNodes"]["gpu-t4-1"])
        assert retry["FailedNodes"] == {}
        pod = training_pod(args["Pod"])
        a100 = node_card(args["Nodes"]["items"][1]["metadata"]["labels"])
        _, stored = app.state.k8s._memory[card_key(pod.request, a100)]  # the A100's answer, as the job stored it
        fits = stored["result"]["memory"]["fits"]
        assert ("gpu-a100-80-1" in retry["NodeNames"]) is fits
        assert ("gpu-a100-80-1" in retry["FailedAndUnresolvableNodes"]) is not fits
        assert fits  # pure bf16 with Adafactor: an 8B model trains on 80 GB at batch 1, not on 16 GB


def test_the_webhook_starts_a_pods_estimates_on_the_clusters_cards(tmp_path) -> None:
    """At a pod's CREATE the webhook starts its estimate on BATCHFIT_K8S_CARDS and on the cards the extender has
    seen, without waiting (the pod below is pinned to nothing); the filter then finds the answers ready."""
    app = create_app(Settings(workers=1, queue_size=8, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=300,
                              k8s_deadline_s=0.05, k8s_cards="Tesla-T4"))
    review = body("admission_unpinned")
    pod = review["request"]["object"]
    args = body("filter")
    args["Pod"]["metadata"]["annotations"] = dict(pod["metadata"]["annotations"])
    with TestClient(app) as c:
        with paused_workers(app):  # the estimates wait while the started jobs are counted, however fast they run
            (warning,) = c.post("/k8s/mutate", json=review).json()["response"]["warnings"]
            assert warning.startswith("batchfit: not changed: the pod is not pinned to a GPU type")
            assert len(app.state.k8s._pending) == 1 and metric(c, "batchfit_k8s_estimates_total") == 1  # the T4
        wait_for_estimates(app)
        out = c.post("/k8s/filter", json=args).json()  # the T4 ready; the A100 and L4 nodes seen for the first time
        assert set(out["FailedNodes"]) == {"gpu-a100-80-1", "gpu-l4-1"}
        assert "gpu-t4-1" not in out["FailedNodes"] and "gpu-t4-1" not in out["NodeNames"]  # judged at once
        wait_for_estimates(app)
        pod["metadata"]["annotations"]["batchfit.io/batch-size"] = "32"  # another request: nothing known for it
        args["Pod"]["metadata"]["annotations"]["batchfit.io/batch-size"] = "32"
        with paused_workers(app):
            c.post("/k8s/mutate", json=review)
            assert len(app.state.k8s._pending) == 3  # the configured T4 and the two cards seen, in one job
            assert metric(c, "batchfit_k8s_estimates_total") == 3
        wait_for_estimates(app)
        ready = c.post("/k8s/filter", json=args).json()
        assert ready["FailedNodes"] == {} and metric(c, "batchfit_k8s_estimates_total") == 3  # all found ready
        assert metric(c, 'batchfit_k8s_calls_total{outcome="answered",verb="filter"}') == 1


def test_keys_and_body_limits_of_the_k8s_routes(tmp_path) -> None:
    """With API keys set, the /k8s/ routes need one like the others unless BATCHFIT_K8S_WITHOUT_KEY; their bodies
    (every candidate node's object) may be larger than /estimate's, up to BATCHFIT_K8S_MAX_BODY_BYTES."""
    args = body("filter")
    del args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"]  # nothing to estimate: no worker needed
    for without_key, status in ((False, 401), (True, 200)):
        settings = Settings(workers=1, cache_path="", api_keys="k1", k8s_without_key=without_key)
        with TestClient(create_app(settings, start_workers=False)) as c:
            assert c.post("/k8s/filter", json=args).status_code == status
            assert c.post("/k8s/filter", json=args, headers={"Authorization": "Bearer k1"}).status_code == 200
            assert c.post("/estimate", json={}).status_code == 401  # the other routes still need the key
    big = {**args, "Nodes": {"metadata": {}, "items": args["Nodes"]["items"] * 200}}  # 600 nodes, ~2.4 MB
    settings = Settings(workers=1, cache_path="", max_body_bytes=2**20, k8s_max_body_bytes=2**23)
    with TestClient(create_app(settings, start_workers=False)) as c:
        r = c.post("/k8s/filter", json=big)
        assert r.status_code == 200 and len(r.json()["Nodes"]["items"]) == 600
        assert c.post("/estimate", content=json.dumps(big), headers={"content-type": "application/json"}
                      ).status_code == 413
    settings = Settings(workers=1, cache_path="", k8s_max_body_bytes=2**20)
    with TestClient(create_app(settings, start_workers=False)) as c:
        r = c.post("/k8s/filter", json=big)
        assert r.status_code == 413 and "BATCHFIT_K8S_MAX_BODY_BYTES" in r.json()["detail"]


def test_a_card_out_of_range_fails_alone(client) -> None:
    """A node whose memory label no custom card can have is not judged; the other nodes still are."""
    args = body("filter")
    odd = copy.deepcopy(args["Nodes"]["items"][0])
    odd["metadata"]["name"] = "odd"
    odd["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-Odd", "nvidia.com/gpu.memory": "20000000"})
    args["Nodes"]["items"].append(odd)
    out = client.post("/k8s/filter", json=args).json()
    assert out["NodeNames"] == ["gpu-a100-80-1", "gpu-l4-1", "odd"] and list(out["FailedAndUnresolvableNodes"]) == [
        "gpu-t4-1"]


def test_a_refused_estimate_is_remembered(client) -> None:
    """An estimate the estimator refuses is not started again by the next call (FAILURE_TTL_S)."""
    args = body("filter")
    spec = spec_of(args["Pod"]) | {"input": {"image_size": [1, 64, 64]}}  # 1 channel into a 3-channel stem
    args["Pod"]["metadata"]["annotations"]["batchfit.io/spec"] = json.dumps(spec)
    first = client.post("/k8s/filter", json=args).json()
    started = metric(client, "batchfit_k8s_estimates_total")
    second = client.post("/k8s/filter", json=args).json()
    assert first["NodeNames"] == second["NodeNames"] == ["gpu-t4-1", "gpu-a100-80-1", "gpu-l4-1"]
    assert metric(client, "batchfit_k8s_estimates_total") == started


def test_mutate_with_several_candidate_cards(client) -> None:
    """Required node affinity on the T4 or the A100: the job does not fit the T4 even at batch 1, so the batch is
    the A100's, with a warning naming the T4; even with BATCHFIT_WEBHOOK_DENY_UNFIT the pod is allowed."""
    review = body("admission_unfit")
    pod = review["request"]["object"]
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]
    term["values"] = ["Tesla-T4", "NVIDIA-A100-SXM4-80GB"]
    response = mutate_denying_unfit(client, review)
    assert response["allowed"] is True
    (warning,) = response["warnings"]
    assert warning.startswith("batchfit: the job does not fit Tesla-T4 even at batch 1: it needs ")
    (a100,) = direct(client, pod, ["A100-80GB"], None)
    env = env_of(jsonpatch.apply_patch(pod, decoded(response))["spec"]["containers"][0])
    assert env["BATCHFIT_BATCH_SIZE"] == str(a100["accumulation"]["micro_batch"])
    assert env["BATCHFIT_MAX_BATCH_SIZE"] == str(a100["max_batch_size"])


def test_mutate_an_unfit_pod_with_a_batch(client) -> None:
    review = body("admission_unfit")
    pod = review["request"]["object"]
    pod["metadata"]["annotations"]["batchfit.io/batch-size"] = "64"
    (warning,) = client.post("/k8s/mutate", json=review).json()["response"]["warnings"]
    (t4,) = direct(client, pod, ["T4-16GB"], 64)
    need = t4["memory"]["reserved_peak_bytes"] / 2**30
    assert warning.startswith(f"batchfit: the job does not fit Tesla-T4 even at batch 1 (at the pod's batch it "
                              f"needs {need:.1f} GiB at batch 64; Tesla-T4 has ")


@pytest.mark.parametrize("key, value", [
    ("batchfit.io/batch-size", "\u00b2"), ("batchfit.io/batch-size", "0" * 5000 + "1"),
    ("batchfit.io/spec", "[" * 50000), ("batchfit.io/spec", '{"model": ' + "1" * 5000 + "}"),
    ("batchfit.io/gpu", "nvidia.com/mig-1g.10gb"),
])
def test_hostile_annotations_pass_without_a_500(client, key, value) -> None:
    args = body("filter")
    args["Pod"]["metadata"]["annotations"][key] = value
    r = client.post("/k8s/filter", json=args)
    assert r.status_code == 200 and r.json()["Error"] == ""
    review = body("admission_unpinned")
    review["request"]["object"]["metadata"]["annotations"][key] = value
    r = client.post("/k8s/mutate", json=review)
    assert r.status_code == 200 and r.json()["response"]["allowed"] is True
    (warning,) = r.json()["response"]["warnings"]
    if key == "batchfit.io/gpu":  # a MIG resource on two cards names them
        assert warning == ("batchfit: not changed: nvidia.com/mig-1g.10gb is on several cards (A100-80GB-MIG-1g.10gb, "
                           "H100-80GB-MIG-1g.10gb): pin the product")
    else:
        assert warning.startswith(f"batchfit: not changed: annotations[{key}]")
