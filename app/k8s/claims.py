"""GPU claims sized by memory (Dynamic Resource Allocation, ``resource.k8s.io``, NVIDIA's DRA driver).

A ``ResourceClaimTemplate`` or ``ResourceClaim`` created with the annotations ``batchfit.io/spec`` and
``batchfit.io/batch-size`` gets, on each request of device class ``gpu.nvidia.com`` or ``mig.nvidia.com``,
a CEL selector on the device's memory::

    device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('43Gi')) >= 0

NVIDIA's driver publishes ``memory`` (NVML's total, in bytes) as a capacity of every full GPU and every MIG
device under its own domain, so one expression serves both classes, and the scheduler picks any device that
is large enough, with no extender involved.

**The need** is the device memory on which the step at that batch meets the planner's headroom test (the test
of ``recommended_batch_size``: the device peak within ``1 - planner.headroom`` of capacity - CUDA context -
``planner.reserve_bytes``), rounded up to a whole Gi. A claim names no card, and the step's memory hardly
depends on one: the context and the cuBLAS/cuDNN workspaces do. So it is computed on a reference card,
``H200-141GB`` (the catalog's largest memory, and the largest context and workspaces: an over-estimate for
the others), or on the card the claim's ``batchfit.io/gpu`` annotation names; the ``batchfit.io/estimate``
annotation says which.

**Shapes.** The version is the object's ``apiVersion``: in ``v1`` and ``v1beta2`` a request's device class
and selectors are under ``exactly`` (``firstAvailable`` lists alternatives, each with its own); in
``v1beta1`` they are on the request itself. A claim whose estimate is late is allowed unchanged, with a
warning, and its estimate goes on for the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.k8s.answers import MISSING_PROFILE, Answer, Estimates
from app.k8s.cards import Card, named_card
from app.k8s.pods import PIN, annotations_of, listing, mapping, opted_in, training_pod
from app.k8s.review import estimate_op, patched, unchanged
from estimator import __version__
from estimator.errors import SpecError
from estimator.gpus import get_gpu

CLAIM_GROUP = "resource.k8s.io"
CLAIM_KINDS = {"ResourceClaim": "/spec", "ResourceClaimTemplate": "/spec/spec"}  # where the ResourceClaimSpec is
GPU_CLASSES = ("gpu.nvidia.com", "mig.nvidia.com")  # NVIDIA's DRA driver's DeviceClasses
DRIVER = "gpu.nvidia.com"  # the domain of its devices' capacities, full GPUs and MIG devices alike
EXACT_VERSIONS = ("v1", "v1beta2")  # a request's device class is under ``exactly``
FLAT_VERSIONS = ("v1beta1",)  # ... on the request itself
REFERENCE_CARD = "H200-141GB"
GI = 2**30


@dataclass(frozen=True)
class Place:
    """Where a GPU request keeps its device class and selectors: a JSON pointer (RFC 6901) and the object."""

    path: str
    request: dict[str, Any]


def memory_selector(need_gi: int) -> str:
    """The CEL expression that keeps the devices with at least ``need_gi`` Gi.

    >>> memory_selector(43)
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('43Gi')) >= 0"
    """
    return f"device.capacity['{DRIVER}'].memory.compareTo(quantity('{need_gi}Gi')) >= 0"


def need_bytes(device_peak: int, context: int, reserve: int, headroom: float) -> int:
    """The smallest device memory on which a step of ``device_peak`` (reserved + context) stays within
    ``1 - headroom`` of the usable memory (capacity - ``context`` - ``reserve``).

    >>> need_bytes(9 * GI, GI // 2, GI // 4, 0.1) / GI  # 9 GiB / 0.9 + 0.5 GiB + 0.25 GiB
    10.75
    """
    return math.ceil(device_peak / (1 - headroom)) + context + reserve


def need_gi(need: int) -> int:
    """``need`` bytes in whole Gi, rounded up: ``need_gi(GI + 1) == 2``."""
    return -(-need // GI)


def claim_version(obj: dict[str, Any]) -> str:
    """The object's ``resource.k8s.io`` version; ``SpecError`` at ``apiVersion`` for one whose shape batchfit
    does not know."""
    group, _, version = str(obj.get("apiVersion") or "").rpartition("/")
    if group != CLAIM_GROUP or version not in EXACT_VERSIONS + FLAT_VERSIONS:
        raise SpecError("apiVersion", obj.get("apiVersion"), "resource.k8s.io/v1, v1beta2 or v1beta1")
    return version


def gpu_places(obj: dict[str, Any], kind: str, version: str) -> list[Place]:
    """The GPU requests of a claim or template: each request (``exactly`` in v1 and v1beta2) and each
    ``firstAvailable`` alternative whose device class is NVIDIA's."""
    root = CLAIM_KINDS[kind]
    spec = mapping(obj.get("spec"))
    claim = mapping(spec.get("spec")) if kind == "ResourceClaimTemplate" else spec
    places = []
    for i, request in enumerate(map(mapping, listing(mapping(claim.get("devices")).get("requests")))):
        here = f"{root}/devices/requests/{i}"
        if version in EXACT_VERSIONS:
            places.append(Place(f"{here}/exactly", mapping(request.get("exactly"))))
        else:
            places.append(Place(here, request))
        places += [Place(f"{here}/firstAvailable/{j}", mapping(sub))
                   for j, sub in enumerate(listing(request.get("firstAvailable")))]
    return [p for p in places if p.request.get("deviceClassName") in GPU_CLASSES]


def selector_ops(places: list[Place], expression: str) -> list[dict[str, Any]]:
    """RFC 6902 operations adding ``expression`` to each place's selectors (kept once: a claim made from a
    sized template already has it)."""
    ops: list[dict[str, Any]] = []
    selector = {"cel": {"expression": expression}}
    for place in places:
        selectors = place.request.get("selectors")
        if not isinstance(selectors, list):
            ops.append({"op": "add", "path": f"{place.path}/selectors", "value": [selector]})
        elif selector not in selectors:
            ops.append({"op": "add", "path": f"{place.path}/selectors/-", "value": selector})
    return ops


async def size_claim(request: dict[str, Any], estimates: Estimates, deadline: float) -> dict[str, Any]:
    """The admission response for a claim or template CREATE: its GPU requests' memory selector, or allowed
    unchanged with a warning saying why not."""
    calls = estimates.app.state.metrics.k8s_calls
    obj = mapping(request.get("object"))
    kind = str(mapping(request.get("kind")).get("kind"))
    if not opted_in(obj):
        calls.labels("mutate", "not-opted-in").inc()
        return {"allowed": True}
    try:
        version = claim_version(obj)
        training = training_pod(obj)  # the annotations are read as a pod's
        if training.batch is None:
            raise SpecError("annotations[batchfit.io/batch-size]", None, "the per-device batch the job will run "
                            "(a claim is sized for one batch)")
        card, named = _reference(obj)
    except SpecError as exc:
        calls.labels("mutate", "error").inc()
        return unchanged(f"not changed: {exc}")
    if not await estimates.profile_known(training, "mutate"):
        return unchanged(MISSING_PROFILE)
    places = gpu_places(obj, kind, version)
    if not places:
        calls.labels("mutate", "error").inc()
        return unchanged(f"not changed: no device request of class {' or '.join(GPU_CLASSES)}")
    found, late = await estimates.answers(training.request, [card], deadline, "mutate")
    answer = found.get(card.key)
    if answer is None:
        calls.labels("mutate", "late").inc()
        return unchanged(f"not changed: the estimate is still running; it is kept, create the {kind} again "
                         "to size it")
    if not isinstance(answer, Answer):
        calls.labels("mutate", "error").inc()
        return unchanged(f"not changed: {answer.message}")
    calls.labels("mutate", "answered").inc()
    planner = training.request.planner
    peak = int(answer.memory["device_peak_bytes"])
    need = need_gi(need_bytes(peak, card.gpu.context_bytes, planner.reserve_bytes, planner.headroom))
    summary = (f"{need}Gi per device at batch {training.batch} (device peak {peak / GI:.1f} GiB on {card.label}"
               f"{'' if named else ', the reference card'}, headroom {planner.headroom:g}, "
               f"reserve {planner.reserve_bytes // 2**20} MiB); batchfit {__version__}")
    warnings = []
    if need * GI > card.gpu.memory_bytes:
        warnings.append(f"batchfit: the claim needs {need}Gi per device at batch {training.batch}, more than "
                        f"{card.label} has ({card.gpu.memory_bytes / GI:.1f} GiB): only a larger device is allocated")
    return patched([*selector_ops(places, memory_selector(need)), estimate_op(obj, summary)], warnings)


def _reference(obj: dict[str, Any]) -> tuple[Card, bool]:
    """The card the need is computed on, and whether the claim named it: its ``batchfit.io/gpu``, else
    ``REFERENCE_CARD``."""
    pin = annotations_of(obj).get(PIN)
    if pin is None:
        return Card(REFERENCE_CARD, get_gpu(REFERENCE_CARD), REFERENCE_CARD), False
    card = named_card(pin.strip()) if isinstance(pin, str) else None
    if card is None:
        raise SpecError(f"annotations[{PIN}]", pin, "a card batchfit knows (GET /gpus): the one to size the "
                        "claim on")
    return card, True
