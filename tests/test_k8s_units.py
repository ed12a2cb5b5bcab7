"""Kubernetes names and objects without a service: GFD labels -> cards, pod annotations and pins, the JSONPatch."""

from __future__ import annotations

import json

import jsonpatch
import pytest

from app.k8s.cards import node_card
from app.k8s.pods import gpu_containers, pinned_products, training_pod
from app.k8s.webhook import patch_ops
from estimator.errors import SpecError, UnknownGPUError
from estimator.gpus import CATALOG, MIB, catalog, custom_name_problem, find_gpu, get_gpu

pytestmark = pytest.mark.unit


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
