"""Kubernetes names and objects without a service: GFD labels -> cards, pod annotations and pins, the JSONPatch."""

from __future__ import annotations

import json

import jsonpatch
import pytest
from pydantic import ValidationError

from app.k8s.cards import node_card
from app.k8s.claims import (
    REFERENCE_CARD,
    claim_version,
    gpu_places,
    memory_selector,
    need_bytes,
    need_gi,
    selector_ops,
)
from app.k8s.cluster import ClusterCards
from app.k8s.holds import HOLD_TTL_S, Holds, pod_key
from app.k8s.pods import gpu_containers, pinned_products, training_pod
from app.k8s.webhook import patch_ops
from app.metrics import Metrics
from app.settings import Settings
from estimator.errors import SpecError, UnknownGPUError
from estimator.gpus import CATALOG, MIB, catalog, custom_name_problem, find_gpu, get_gpu

pytestmark = pytest.mark.unit
GI = 2**30


@pytest.mark.parametrize("label, card", [
    ("NVIDIA-A100-SXM4-80GB", "A100-80GB"), ("NVIDIA-H100-80GB-HBM3", "H100-80GB"), ("Tesla-T4", "T4-16GB"),
    ("NVIDIA-L4", "L4-24GB"), ("A100-SXM4-40GB", "A100-40GB"), ("nvidia-a100-sxm4-40gb", "A100-40GB"),
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB-MIG-1g.5gb"), ("A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB-MIG-1g.5gb"),
    ("NVIDIA-H100-80GB-HBM3-MIG-3g.40gb", "H100-80GB-MIG-3g.40gb"), ("nvidia.com/mig-1g.5gb", "A100-40GB-MIG-1g.5gb"),
    ("A100-80GB", "A100-80GB"),
])
def test_gfd_names_are_catalog_cards(label, card) -> None:
    assert find_gpu(label) is CATALOG[card] and get_gpu(label) is CATALOG[card]


def test_a_mig_resource_on_several_cards_names_them() -> None:
    assert find_gpu("nvidia.com/mig-1g.10gb") is None
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("nvidia.com/mig-1g.10gb", field="gpus[0]")
    assert info.value.suggestions == ["A100-80GB-MIG-1g.10gb", "H100-80GB-MIG-1g.10gb"]
    assert info.value.field == "gpus[0]"


def test_every_alias_is_listed_once_and_is_no_custom_name() -> None:
    listed = catalog()["gpus"]
    spellings = [s.lower() for g in listed for s in (g["name"], *g["aliases"])]
    assert len(spellings) == len(set(spellings))
    by_name = {g["name"]: g for g in listed}
    assert "NVIDIA-A100-SXM4-80GB" in by_name["A100-80GB"]["aliases"]
    assert by_name["A100-40GB-MIG-1g.5gb"]["mig_resource"] == "nvidia.com/mig-1g.5gb"
    assert by_name["A100-80GB"]["mig_resource"] is None
    assert custom_name_problem("Tesla-T4") is not None  # would read as the catalog's T4


def test_node_cards() -> None:
    a100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
            "nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.memory": "9728"}
    card = node_card(a100, "1g.10gb")  # mixed strategy: the slice the pod requests, on this node's card
    assert card is not None and card.gpu is CATALOG["A100-80GB-MIG-1g.10gb"]
    assert card.label == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb" and card.assumption is None
    unknown = node_card(a100, "4g.40gb")  # a profile the catalog lacks: no memory label for it either
    assert unknown is None
    custom = node_card({"nvidia.com/gpu.product": "NVIDIA-B200", "nvidia.com/gpu.memory": "183359",
                        "nvidia.com/gpu.compute.major": "10", "nvidia.com/gpu.compute.minor": "0"})
    assert custom is not None and custom.entry == {"name": "NVIDIA-B200", "memory_bytes": 183359 * MIB,
                                                   "compute_capability": "10.0", "context_bytes": 450 * MIB}
    assert custom.gpu.memory_bytes == 183359 * MIB and custom.gpu.capability == (10, 0)
    assert custom.assumption is not None and "183359 MiB (nvidia.com/gpu.memory)" in custom.assumption
    assert node_card({"nvidia.com/gpu.product": "NVIDIA-B200"}) is None  # no memory label: cannot size it
    bare = node_card({"nvidia.com/gpu.product": "NVIDIA-B200", "nvidia.com/gpu.memory": "183359"})
    assert bare is not None and bare.entry["compute_capability"] == "8.0" and "the default" in str(bare.assumption)
    for junk in ("", "-1", "12GiB", "0", "\u00b2", "20000000", "9" * 5000):  # out of a custom card's range too
        assert node_card({"nvidia.com/gpu.product": "X", "nvidia.com/gpu.memory": junk}) is None


def _pod(annotations=None, spec=None) -> dict:
    return {"metadata": {"name": "p", "namespace": "ml", "annotations": annotations}, "spec": spec or {
        "containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


SPEC = json.dumps({"model": {"source": "torchvision", "name": "resnet18"}})


def test_training_pod_reads_its_annotations() -> None:
    pod = training_pod(_pod({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": " 32 "}))
    assert pod.batch == 32 and pod.request.batch_size == 32 and pod.gpu_containers == (0,)
    assert pod.request.planner.suggestions is False  # the scheduler needs fit and headroom, not advice
    kept = training_pod(_pod({"batchfit.io/spec": json.dumps({**json.loads(SPEC), "planner": {"suggestions": True}})}))
    assert kept.request.planner.suggestions is True and kept.batch is None


@pytest.mark.parametrize("annotations, field", [
    ({"batchfit.io/spec": "{nope"}, "annotations[batchfit.io/spec]"),
    ({"batchfit.io/spec": "[1]"}, "annotations[batchfit.io/spec]"),
    ({"batchfit.io/spec": json.dumps({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4"]})},
     "annotations[batchfit.io/spec].gpus"),
    ({"batchfit.io/spec": json.dumps({"model": {"source": "torchvision", "name": 5}})},
     "annotations[batchfit.io/spec].model.name"),
    ({"batchfit.io/spec": json.dumps({"model": {"source": "custom", "factory": "os:system"}})},
     "annotations[batchfit.io/spec].model.source"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "0"}, "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "eight"}, "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "9" * 40}, "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "\u00b2"}, "annotations[batchfit.io/batch-size]"),  # digit
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "0" * 5000 + "1"}, "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "0000000000019999999999"},
     "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": str(2**20 + 1)}, "annotations[batchfit.io/batch-size]"),
    ({"batchfit.io/spec": "[" * 50000}, "annotations[batchfit.io/spec]"),  # no RecursionError: nesting refused
    ({"batchfit.io/spec": '{"model": ' + "1" * 5000 + "}"}, "annotations[batchfit.io/spec]"),  # nor int()'s limit
    ({"batchfit.io/spec": json.dumps({**json.loads(SPEC), "planner": "x"})}, "annotations[batchfit.io/spec].planner"),
])
def test_a_wrong_annotation_names_itself(annotations, field) -> None:
    with pytest.raises(SpecError) as info:
        training_pod(_pod(annotations))
    assert info.value.field == field


def test_gpu_containers_and_mig_profiles() -> None:
    spec = {"containers": [{"name": "a"}, {"name": "b", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}},
                           {"name": "c", "resources": {"limits": None}}, {"name": "d", "resources": {
                               "limits": {"nvidia.com/gpu": "2"}}}]}
    assert gpu_containers({"spec": spec}) == ((1, 3), {"1g.10gb"})
    spec["containers"][3]["resources"]["limits"] = {"nvidia.com/mig-3g.40gb": "1"}
    with pytest.raises(SpecError, match="one MIG profile"):
        training_pod(_pod({"batchfit.io/spec": SPEC}, spec))


def _affinity(*terms: list[dict]) -> dict:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}}


PRODUCT = "nvidia.com/gpu.product"


def test_pins() -> None:
    assert pinned_products(_pod({"batchfit.io/gpu": "H100-80GB"}, {"nodeSelector": {PRODUCT: "Tesla-T4"}})) == [
        "Tesla-T4"]  # what places the pod first
    assert pinned_products(_pod({"batchfit.io/gpu": "H100-80GB"}, {})) == ["H100-80GB"]
    assert pinned_products(_pod({}, {"nodeSelector": {PRODUCT: "Tesla-T4"}})) == ["Tesla-T4"]
    both = _affinity([{"key": PRODUCT, "operator": "In", "values": ["NVIDIA-L4", "Tesla-T4"]}],
                     [{"key": "zone", "operator": "In", "values": ["a"]},
                      {"key": PRODUCT, "operator": "In", "values": ["NVIDIA-L4", "NVIDIA-A10G"]}])
    assert pinned_products(_pod({}, both)) == ["NVIDIA-L4", "Tesla-T4", "NVIDIA-A10G"]
    open_term = _affinity([{"key": PRODUCT, "operator": "In", "values": ["NVIDIA-L4"]}],
                          [{"key": "zone", "operator": "In", "values": ["a"]}])
    assert pinned_products(_pod({}, open_term)) == []  # the second term lets the pod land on any card
    assert pinned_products(_pod({}, _affinity([{"key": PRODUCT, "operator": "NotIn", "values": ["Tesla-T4"]}]))) == []
    assert pinned_products({"metadata": None, "spec": None}) == []


def test_patch_ops_add_replace_and_escape() -> None:
    pod = {"metadata": {"annotations": {"batchfit.io/spec": "{}"}}, "spec": {"containers": [
        {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "BATCHFIT_BATCH_SIZE", "valueFrom": {}}]},
        {"name": "b"}]}}
    env = {"BATCHFIT_BATCH_SIZE": "8", "BATCHFIT_MAX_BATCH_SIZE": "9"}
    ops = patch_ops(pod, [(0, env), (1, env)], "summary")
    assert ops == [
        {"op": "replace", "path": "/spec/containers/0/env/1", "value": {"name": "BATCHFIT_BATCH_SIZE", "value": "8"}},
        {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "BATCHFIT_MAX_BATCH_SIZE", "value": "9"}},
        {"op": "add", "path": "/spec/containers/1/env", "value": [{"name": "BATCHFIT_BATCH_SIZE", "value": "8"},
                                                                   {"name": "BATCHFIT_MAX_BATCH_SIZE", "value": "9"}]},
        {"op": "add", "path": "/metadata/annotations/batchfit.io~1estimate", "value": "summary"}]
    patched = jsonpatch.apply_patch(pod, ops)
    assert patched["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"},
                                                       {"name": "BATCHFIT_BATCH_SIZE", "value": "8"},
                                                       {"name": "BATCHFIT_MAX_BATCH_SIZE", "value": "9"}]
    again = jsonpatch.apply_patch(patched, patch_ops(patched, [(0, env)], "newer"))  # reinvoked: replaced in place
    assert again["spec"]["containers"][0]["env"] == patched["spec"]["containers"][0]["env"]
    assert again["metadata"]["annotations"]["batchfit.io/estimate"] == "newer"


def test_an_accepted_batch_annotation() -> None:
    assert training_pod(_pod({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": "0032"})).batch == 32
    assert training_pod(_pod({"batchfit.io/spec": SPEC, "batchfit.io/batch-size": str(2**20)})).batch == 2**20


# --- held pods, the cluster's cards, DRA claims -----------------------------------------------------------------

def test_holds_count_pods_by_card_and_time_their_wait() -> None:
    metrics = Metrics()
    holds = Holds(metrics)

    def value(name: str, card: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"card": card})

    holds.hold("pod-a", ["Tesla-T4", "NVIDIA-L4"], now=100.0)
    holds.hold("pod-a", ["Tesla-T4"], now=110.0)  # retried, still pending: counted, not timed again
    holds.hold("pod-b", ["Tesla-T4"], now=120.0)
    assert value("batchfit_k8s_holds_total", "Tesla-T4") == 3 and value("batchfit_k8s_held_pods", "Tesla-T4") == 2
    assert holds.answered("pod-a", ["Tesla-T4", "NVIDIA-A100-SXM4-80GB"], now=130.0) == [30.0]  # from the first hold
    assert value("batchfit_k8s_held_pods", "Tesla-T4") == 1
    assert value("batchfit_k8s_hold_wait_seconds_count", "Tesla-T4") == 1
    assert value("batchfit_k8s_hold_wait_seconds_sum", "Tesla-T4") == 30.0
    assert holds.answered("pod-a", ["Tesla-T4"], now=140.0) == []  # released once
    holds.hold("pod-c", ["Tesla-T4"], now=100.0 + HOLD_TTL_S)  # pod-a's L4 hold has expired: forgotten, not timed
    assert value("batchfit_k8s_held_pods", "NVIDIA-L4") == 0
    assert value("batchfit_k8s_hold_wait_seconds_count", "NVIDIA-L4") is None  # never observed
    assert pod_key({"metadata": {"uid": "u-1", "name": "p"}}) == "u-1"
    assert pod_key({"metadata": {"name": "p", "namespace": "ml"}}) == "ml/p"


def test_cluster_cards() -> None:
    seen = ClusterCards()
    a100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
            "kubernetes.io/hostname": "gpu-a100-80-1"}
    seen.saw(a100)
    seen.saw({**a100, "kubernetes.io/hostname": "gpu-a100-80-2"})  # the same card: one entry
    seen.saw({"kubernetes.io/hostname": "cpu-1"})  # no GPU labels: no card
    seen.saw({"nvidia.com/gpu.product": "NVIDIA-Mystery"})  # nobody can size it: kept, but no card
    assert [c.label for c in seen.cards([], None)] == ["NVIDIA-A100-SXM4-80GB"]
    configured = seen.cards(["Tesla-T4", "A100-80GB"], None)  # a catalog name is the A100's card too
    assert [(c.label, c.gpu.name) for c in configured] == [("Tesla-T4", "T4-16GB"), ("A100-80GB", "A100-80GB")]
    sliced = seen.cards(["H100-80GB"], "1g.10gb")  # the slice a pod requests, on each card that has it
    assert [c.gpu.name for c in sliced] == ["H100-80GB-MIG-1g.10gb", "A100-80GB-MIG-1g.10gb"]
    assert [c.gpu.name for c in seen.cards(["Tesla-T4"], "1g.10gb")] == ["A100-80GB-MIG-1g.10gb"]  # a T4 has no MIG


def test_k8s_settings() -> None:
    assert Settings().k8s_when_late == "hold" and Settings().card_names() == []
    assert Settings(k8s_cards=" Tesla-T4 ,A100-80GB,").card_names() == ["Tesla-T4", "A100-80GB"]
    with pytest.raises(ValidationError, match="'NVIDIA-Z9000' is not a card batchfit knows"):
        Settings(k8s_cards="Tesla-T4,NVIDIA-Z9000")
    with pytest.raises(ValidationError, match="k8s_when_late"):
        Settings(k8s_when_late="wait")


@pytest.mark.parametrize("peak, context, reserve, headroom, need", [
    (9 * GI, GI // 2, GI // 4, 0.1, 10 * GI + GI // 2 + GI // 4),  # 9 GiB / 0.9 = 10 GiB, + context + reserve
    (9 * GI, GI // 2, GI // 4, 0.0, 9 * GI + GI // 2 + GI // 4),
    (3 * GI, 0, 0, 0.25, 4 * GI),  # 3 GiB / 0.75
])
def test_a_claims_need(peak, context, reserve, headroom, need) -> None:
    assert need_bytes(peak, context, reserve, headroom) == need


def test_the_need_in_whole_gi() -> None:
    assert [need_gi(n) for n in (1, GI - 1, GI, GI + 1, 43 * GI)] == [1, 1, 1, 2, 43]
    assert memory_selector(43) == "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('43Gi')) >= 0"
    assert find_gpu(REFERENCE_CARD) is CATALOG[REFERENCE_CARD]
    # the reference card over-estimates the others: the catalog's largest context and cuBLAS workspace
    assert CATALOG[REFERENCE_CARD].context_bytes == max(g.context_bytes for g in CATALOG.values())
    assert CATALOG[REFERENCE_CARD].cublas_workspace_bytes == max(g.cublas_workspace_bytes for g in CATALOG.values())
    assert CATALOG[REFERENCE_CARD].memory_bytes == max(g.memory_bytes for g in CATALOG.values())


GPU = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
MIG = {"deviceClassName": "mig.nvidia.com", "allocationMode": "ExactCount", "count": 1}
NIC = {"deviceClassName": "rdma.example.com", "allocationMode": "ExactCount", "count": 1}


def _claim(version: str, requests: list[dict]) -> dict:
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": "ResourceClaim", "spec": {"devices": {
        "requests": requests}}}


def test_gpu_places_by_version() -> None:
    v1 = _claim("v1", [{"name": "a", "exactly": GPU}, {"name": "b", "exactly": NIC},
                       {"name": "c", "firstAvailable": [{"name": "x", **MIG}, {"name": "y", **NIC}]}])
    assert [p.path for p in gpu_places(v1, "ResourceClaim", claim_version(v1))] == [
        "/spec/devices/requests/0/exactly", "/spec/devices/requests/2/firstAvailable/0"]
    beta1 = _claim("v1beta1", [{"name": "a", **GPU}, {"name": "b", "firstAvailable": [{"name": "x", **GPU}]}])
    assert [p.path for p in gpu_places(beta1, "ResourceClaim", claim_version(beta1))] == [
        "/spec/devices/requests/0", "/spec/devices/requests/1/firstAvailable/0"]
    # read as v1, a v1beta1 request has no ``exactly``: only its alternatives (flat in both) are found
    assert [p.path for p in gpu_places(beta1, "ResourceClaim", "v1")] == ["/spec/devices/requests/1/firstAvailable/0"]
    template = {"apiVersion": "resource.k8s.io/v1beta2", "spec": {"spec": {"devices": {"requests": [
        {"name": "a", "exactly": GPU}]}}}}
    assert [p.path for p in gpu_places(template, "ResourceClaimTemplate", claim_version(template))] == [
        "/spec/spec/devices/requests/0/exactly"]
    assert gpu_places({"spec": None}, "ResourceClaimTemplate", "v1") == []
    for bad in ("resource.k8s.io/v1alpha3", "v1", "apps/v1", None):
        with pytest.raises(SpecError) as info:
            claim_version({"apiVersion": bad})
        assert info.value.field == "apiVersion"


def test_selector_ops_add_once() -> None:
    expression = memory_selector(26)
    claim = _claim("v1beta1", [{"name": "a", **GPU}, {"name": "b", **MIG, "selectors": [
        {"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'"}}]}])
    places = gpu_places(claim, "ResourceClaim", "v1beta1")
    ops = selector_ops(places, expression)
    assert ops == [{"op": "add", "path": "/spec/devices/requests/0/selectors", "value": [{"cel": {
                        "expression": expression}}]},
                   {"op": "add", "path": "/spec/devices/requests/1/selectors/-", "value": {"cel": {
                        "expression": expression}}}]
    sized = jsonpatch.apply_patch(claim, ops)
    assert selector_ops(gpu_places(sized, "ResourceClaim", "v1beta1"), expression) == []  # already there
    assert len(selector_ops(gpu_places(sized, "ResourceClaim", "v1beta1"), memory_selector(27))) == 2
