"""DRA claims sized by memory: POST /k8s/mutate on recorded AdmissionReview bodies (tests/k8s/admission_claim_*)
of a ResourceClaimTemplate and a ResourceClaim in resource.k8s.io/v1 and v1beta1, answered by the real service
and checked against POST /estimate's numbers on the reference card."""

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
from kubernetes.client import ApiClient
from support import paused_workers, service

from app.k8s.claims import REFERENCE_CARD
from app.main import create_app
from app.settings import Settings

pytestmark = pytest.mark.service
BODIES = Path(__file__).parent / "k8s"
GI = 2**30
RESERVE, HEADROOM = 256 * 2**20, 0.1  # planner.reserve_bytes' and planner.headroom's defaults (docs/API.md)
CEL = re.compile(r"device\.capacity\['gpu\.nvidia\.com'\]\.memory\.compareTo\(quantity\('(\d+)Gi'\)\) >= 0")

# body -> the official client's model of its spec (the version's shape), and the JSON pointers of its GPU requests
CASES = {
    "admission_claim_template_v1": ("V1ResourceClaimTemplateSpec", ["/spec/spec/devices/requests/0/exactly"]),
    "admission_claim_v1": ("V1ResourceClaimSpec", ["/spec/devices/requests/0/firstAvailable/0",
                                                   "/spec/devices/requests/0/firstAvailable/1"]),
    "admission_claim_template_v1beta1": ("V1beta1ResourceClaimTemplateSpec", ["/spec/spec/devices/requests/0"]),
    "admission_claim_v1beta1": ("V1beta1ResourceClaimSpec", ["/spec/devices/requests/0"]),
}


def body(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((BODIES / f"{name}.json").read_text())
    return doc


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with service(tmp_path_factory.mktemp("claims") / "cache.sqlite", queue_size=8, request_timeout_s=300,
                 k8s_deadline_s=30) as c:
        yield c


def card(client: TestClient, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(g for g in client.get("/gpus").json()["gpus"] if g["name"] == name)
    return found


def expected_gi(client: TestClient, obj: dict[str, Any], gpu: str) -> tuple[int, dict[str, Any]]:
    """The need POST /estimate's numbers give on ``gpu`` at the claim's batch: the device peak within
    (1 - headroom) of capacity - context - reserve, in whole Gi rounded up; and that result."""
    notes = obj["metadata"]["annotations"]
    batch = int(notes["batchfit.io/batch-size"])
    request = json.loads(notes["batchfit.io/spec"]) | {"gpus": [gpu], "batch_size": batch}
    request["planner"] = {**request.get("planner", {}), "suggestions": False}
    r = client.post("/estimate", json=request)
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    peak = result["memory"]["device_peak_bytes"]
    need = math.ceil(peak / (1 - HEADROOM)) + card(client, gpu)["context_bytes"] + RESERVE
    return -(-need // GI), result


def ops_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def at(doc: Any, pointer: str) -> Any:
    for part in pointer.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def round_trip(spec: dict[str, Any], model: str) -> Any:
    """``spec`` through the official client's model and back (a key the model lacks is dropped)."""
    with ApiClient() as api:
        return api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(spec), model))


@pytest.mark.parametrize("name", list(CASES))
def test_a_claim_gets_a_memory_selector_on_each_gpu_request(client, name) -> None:
    model, places = CASES[name]
    review = body(name)
    obj = review["request"]["object"]
    r = client.post("/k8s/mutate", json=review)
    assert r.status_code == 200
    out = r.json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["response"]["uid"] == review["request"]["uid"]
    assert "warnings" not in out["response"]
    patched = jsonpatch.apply_patch(obj, ops_of(out["response"]))  # RFC 6902, as the API server applies it
    assert round_trip(patched["spec"], model) == patched["spec"]  # still this version's shape, every key known
    need, h200 = expected_gi(client, obj, REFERENCE_CARD)
    assert h200["memory"]["fits"]
    for place in places:
        selectors = at(patched, place)["selectors"]
        given = at(obj, place).get("selectors") or []
        assert selectors[:len(given)] == given  # the claim's own selectors first, unchanged
        (added,) = selectors[len(given):]
        match = CEL.fullmatch(added["cel"]["expression"])
        assert match and int(match.group(1)) == need
    summary = patched["metadata"]["annotations"]["batchfit.io/estimate"]
    assert summary == (f"{need}Gi per device at batch 64 (device peak {h200['memory']['device_peak_bytes'] / GI:.1f} "
                       f"GiB on H200-141GB, the reference card, headroom 0.1, reserve 256 MiB); batchfit 0.6.0")
    # everything else is as it was: the selectors and the annotation taken out, the object is the one sent
    for place in places:
        at(patched, place)["selectors"] = at(patched, place)["selectors"][:-1]
        if not at(obj, place).get("selectors"):
            del at(patched, place)["selectors"]
    del patched["metadata"]["annotations"]["batchfit.io/estimate"]
    assert patched == obj


def test_the_version_decides_the_shape() -> None:
    """The v1beta1 object's requests are not v1's (the client's v1 model drops their device class), so each
    version's patch must address its own shape."""
    spec = body("admission_claim_v1beta1")["request"]["object"]["spec"]
    assert round_trip(spec, "V1ResourceClaimSpec") != spec
    assert round_trip(spec, "V1beta1ResourceClaimSpec") == spec


def test_a_claim_from_a_sized_template_keeps_one_selector(client) -> None:
    """The resourceclaim controller copies a template's spec into each claim: sizing it again adds nothing."""
    review = body("admission_claim_v1")
    obj = review["request"]["object"]
    once = jsonpatch.apply_patch(obj, ops_of(client.post("/k8s/mutate", json=review).json()["response"]))
    review["request"]["object"] = once
    ops = ops_of(client.post("/k8s/mutate", json=review).json()["response"])
    assert ops == [{"op": "replace", "path": "/metadata/annotations/batchfit.io~1estimate",
                    "value": once["metadata"]["annotations"]["batchfit.io/estimate"]}]


def test_a_claim_names_its_card(client) -> None:
    """``batchfit.io/gpu`` on the claim: the need is computed on that card (its CUDA context and workspaces)."""
    review = body("admission_claim_v1beta1")
    obj = review["request"]["object"]
    obj["metadata"]["annotations"]["batchfit.io/gpu"] = "NVIDIA-A100-SXM4-80GB"
    patched = jsonpatch.apply_patch(obj, ops_of(client.post("/k8s/mutate", json=review).json()["response"]))
    need, a100 = expected_gi(client, obj, "A100-80GB")
    (selector,) = patched["spec"]["devices"]["requests"][0]["selectors"]
    assert CEL.fullmatch(selector["cel"]["expression"]).group(1) == str(need)
    assert patched["metadata"]["annotations"]["batchfit.io/estimate"].startswith(
        f"{need}Gi per device at batch 64 (device peak {a100['memory']['device_peak_bytes'] / GI:.1f} GiB on "
        "NVIDIA-A100-SXM4-80GB, headroom 0.1")


def test_a_device_of_the_need_recommends_the_batch(client) -> None:
    """What the selector promises: a device with the need's memory (and the reference card's context and
    compute capability) recommends at least the claim's batch."""
    review = body("admission_claim_template_v1")
    obj = review["request"]["object"]
    need, _ = expected_gi(client, obj, REFERENCE_CARD)
    h200 = card(client, REFERENCE_CARD)
    spec = json.loads(obj["metadata"]["annotations"]["batchfit.io/spec"])
    twin = {"name": "Device-Of-Need", "memory_bytes": need * GI, "compute_capability": h200["compute_capability"],
            "context_bytes": h200["context_bytes"]}
    r = client.post("/estimate", json=spec | {"gpus": [twin], "planner": {"curve_points": 0, "align": False,
                                                                           "suggestions": False}})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["recommended_batch_size"] >= 64


def test_a_claim_larger_than_the_reference_card_is_sized_with_a_warning(client) -> None:
    review = body("admission_claim_v1beta1")
    obj = review["request"]["object"]
    obj["metadata"]["annotations"]["batchfit.io/gpu"] = "T4-16GB"
    obj["metadata"]["annotations"]["batchfit.io/batch-size"] = "4096"
    response = client.post("/k8s/mutate", json=review).json()["response"]
    need, t4 = expected_gi(client, obj, "T4-16GB")
    assert not t4["memory"]["fits"] and need > 15
    assert response["warnings"] == [f"batchfit: the claim needs {need}Gi per device at batch 4096, more than T4-16GB "
                                    "has (15.0 GiB): only a larger device is allocated"]
    patched = jsonpatch.apply_patch(obj, ops_of(response))
    assert CEL.fullmatch(patched["spec"]["devices"]["requests"][0]["selectors"][0]["cel"]["expression"])


def _notes(obj: dict[str, Any]) -> dict[str, Any]:
    notes: dict[str, Any] = obj["metadata"]["annotations"]
    return notes


@pytest.mark.parametrize("change, warning", [
    (lambda o: _notes(o).pop("batchfit.io/batch-size"), "batchfit: not changed: annotations[batchfit.io/batch-size]"),
    (lambda o: o.update(apiVersion="resource.k8s.io/v1alpha3"), "batchfit: not changed: apiVersion"),
    (lambda o: _notes(o).update({"batchfit.io/spec": "{nope"}), "batchfit: not changed: annotations[batchfit.io/spec]"),
    (lambda o: _notes(o).update({"batchfit.io/gpu": "NVIDIA-Z9000"}),
     "batchfit: not changed: annotations[batchfit.io/gpu]"),
    (lambda o: o["spec"]["spec"]["devices"]["requests"][0]["exactly"].update(deviceClassName="rdma.example.com"),
     "batchfit: not changed: no device request of class gpu.nvidia.com or mig.nvidia.com"),
    (lambda o: o["spec"].update(spec=None), "batchfit: not changed: no device request of class"),
], ids=["no-batch", "v1alpha3", "bad-spec", "unknown-card", "no-gpu-request", "null-spec"])
def test_a_claim_batchfit_cannot_size_is_allowed_unchanged(client, change, warning) -> None:
    review = body("admission_claim_template_v1")
    change(review["request"]["object"])
    r = client.post("/k8s/mutate", json=review)
    assert r.status_code == 200
    response = r.json()["response"]
    assert response["allowed"] is True and "patch" not in response
    (said,) = response["warnings"]
    assert said.startswith(warning) and len(said) <= 256


def test_claims_not_sized(client) -> None:
    """No batchfit.io/spec, or not a CREATE: allowed as they are, without a warning."""
    review = body("admission_claim_v1")
    del review["request"]["object"]["metadata"]["annotations"]["batchfit.io/spec"]
    assert client.post("/k8s/mutate", json=review).json()["response"] == {"uid": review["request"]["uid"],
                                                                          "allowed": True}
    update = body("admission_claim_v1")
    update["request"]["operation"] = "UPDATE"
    assert client.post("/k8s/mutate", json=update).json()["response"] == {"uid": update["request"]["uid"],
                                                                          "allowed": True}


def test_a_late_estimate_leaves_the_claim_unchanged_and_goes_on(tmp_path) -> None:
    app = create_app(Settings(workers=1, queue_size=8, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=300,
                              k8s_deadline_s=0.05))
    review = body("admission_claim_template_v1beta1")
    with TestClient(app) as late:
        with paused_workers(app):  # the estimate waits until the call is answered, however fast it runs
            first = late.post("/k8s/mutate", json=review).json()["response"]
            running = set(app.state.k8s._pending.values())
            assert len(running) == 1 and not next(iter(running)).done()  # answered while the estimate still runs
        assert first["allowed"] is True and "patch" not in first
        assert first["warnings"] == ["batchfit: not changed: the estimate is still running; it is kept, create the "
                                     "ResourceClaimTemplate again to size it"]
        for _ in range(600):
            if not app.state.k8s._pending:
                break
            time.sleep(0.5)
        again = late.post("/k8s/mutate", json=review).json()["response"]
        patched = jsonpatch.apply_patch(review["request"]["object"], ops_of(again))
        (_, added) = patched["spec"]["spec"]["devices"]["requests"][0]["selectors"]
        assert CEL.fullmatch(added["cel"]["expression"])
