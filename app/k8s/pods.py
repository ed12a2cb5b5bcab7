"""What a pod asks of batchfit: its annotations, its GPU containers and the card it is pinned to.

- ``batchfit.io/spec``: a docs/API.md request without ``gpus`` (JSON); or
- ``batchfit.io/profile``: a stored profile's id (``sha256:...``, POST /profiles answers it) standing for the
  spec: the job's own code, traced where it lives. A pod with neither is never filtered, ranked or mutated;
  one naming a profile the service does not have is treated as if it had neither (app/k8s/answers.py).
- ``batchfit.io/batch-size``: the per-GPU batch the job will run (optional).
- ``batchfit.io/gpu``: the card, when neither the node selector nor required node affinity pins one
  (optional; what places the pod comes first).

Pods arrive as Kubernetes serializes them (camelCase, ``null`` for an empty map); only the fields read here
are checked, so the rest of a pod is never a reason to refuse it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.k8s.cards import GPU_RESOURCE, PRODUCT, mig_profile_of
from app.shape import check_shape
from estimator import EstimateRequest, ProfileEstimateRequest, parse_profile_request, parse_request
from estimator.errors import SpecError
from estimator.options import MAX_BATCH  # docs/API.md, batch_size

SPEC = "batchfit.io/spec"
PROFILE = "batchfit.io/profile"
BATCH = "batchfit.io/batch-size"
PIN = "batchfit.io/gpu"
ESTIMATE = "batchfit.io/estimate"
MAX_SPEC_CHARS = 2**18  # Kubernetes holds all of a pod's annotations to 256 KiB


@dataclass(frozen=True)
class TrainingPod:
    """A pod that opted in: its request (``gpus`` left to the node), its batch (None: not given), its GPU
    containers' indexes and the MIG profile they request under the mixed strategy (None: whole GPUs)."""

    name: str
    request: EstimateRequest | ProfileEstimateRequest
    batch: int | None
    gpu_containers: tuple[int, ...]
    mig_profile: str | None


def mapping(value: Any) -> dict[str, Any]:
    """A JSON object, or {} for ``null`` or anything else (Go writes an empty map as ``null``)."""
    return value if isinstance(value, dict) else {}


def listing(value: Any) -> list[Any]:
    """A JSON array, or [] for ``null`` or anything else."""
    return value if isinstance(value, list) else []


def pod_name(pod: dict[str, Any]) -> str:
    meta = mapping(pod.get("metadata"))
    name = meta.get("name") or meta.get("generateName") or "(unnamed)"
    return f"{meta.get('namespace') or 'default'}/{name}"


def annotations_of(pod: dict[str, Any]) -> dict[str, Any]:
    return mapping(mapping(pod.get("metadata")).get("annotations"))


def opted_in(pod: dict[str, Any]) -> bool:
    notes = annotations_of(pod)
    return SPEC in notes or PROFILE in notes


def training_pod(pod: dict[str, Any]) -> TrainingPod:
    """The pod's request; ``SpecError`` naming the annotation (and the request's field) when it is wrong."""
    notes = annotations_of(pod)
    if PROFILE in notes:
        return _profile_pod(pod, notes)
    raw = notes.get(SPEC)
    if not isinstance(raw, str):
        raise SpecError(f"annotations[{SPEC}]", raw, "a JSON object (docs/API.md request without 'gpus')")
    if len(raw) > MAX_SPEC_CHARS:
        raise SpecError(f"annotations[{SPEC}]", f"({len(raw)} characters)", f"at most {MAX_SPEC_CHARS} characters")
    try:
        check_shape(raw.encode())  # the limits of a POST /estimate body: nesting, items, number lengths
    except SpecError as exc:
        raise SpecError(f"annotations[{SPEC}]", exc.value, exc.expected) from None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SpecError(f"annotations[{SPEC}]", raw[:80], f"JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise SpecError(f"annotations[{SPEC}]", raw[:80], "a JSON object (docs/API.md request without 'gpus')")
    for key, why in (("gpus", "the node's GPU is the card"), ("validate", "no GPU step runs for the scheduler")):
        if key in doc:
            raise SpecError(f"annotations[{SPEC}].{key}", doc[key], f"no '{key}' ({why})")
    batch = batch_of(notes)
    doc = {**doc, "gpus": ["A100-80GB"]}  # a stand-in: parsed here, replaced per node
    if batch is not None:
        doc["batch_size"] = batch
    planner = doc.get("planner", {})
    if isinstance(planner, dict) and "suggestions" not in planner:  # fit and headroom, not advice (docs/API.md)
        doc["planner"] = {**planner, "suggestions": False}
    try:
        request = parse_request(doc, allow_local_code=False)
    except SpecError as exc:
        raise SpecError(f"annotations[{SPEC}].{exc.field}", exc.value, exc.expected) from None
    return _training(pod, request, batch)


def _profile_pod(pod: dict[str, Any], notes: dict[str, Any]) -> TrainingPod:
    """A pod that names a stored profile: the request by profile, on a stand-in card (replaced per node)."""
    if SPEC in notes:
        raise SpecError(f"annotations[{PROFILE}]", notes[PROFILE], f"no {SPEC} beside it (the profile stands "
                        "for the spec: name one of them)")
    raw = notes[PROFILE]
    doc = {"profile": raw.strip() if isinstance(raw, str) else raw, "gpus": ["A100-80GB"]}
    batch = batch_of(notes)
    if batch is not None:
        doc["batch_size"] = batch
    try:
        request = parse_profile_request(doc)
    except SpecError as exc:
        raise SpecError(f"annotations[{PROFILE}]", exc.value, exc.expected) from None
    return _training(pod, request, batch)


def _training(pod: dict[str, Any], request: EstimateRequest | ProfileEstimateRequest, batch: int | None) -> TrainingPod:
    containers, profiles = gpu_containers(pod)
    if len(profiles) > 1:
        raise SpecError("spec.containers[].resources", sorted(profiles), "one MIG profile for the pod's GPU "
                        "containers (batchfit answers for one card per pod)")
    return TrainingPod(pod_name(pod), request, batch, containers, next(iter(profiles), None))


def batch_of(notes: dict[str, Any]) -> int | None:
    raw = notes.get(BATCH)
    if raw is None:
        return None
    text = raw.strip() if isinstance(raw, str) else ""
    if not re.fullmatch(r"[0-9]{1,10}", text) or not 1 <= int(text) <= MAX_BATCH:
        shown = raw if not isinstance(raw, str) or len(raw) <= 40 else raw[:40] + "..."
        raise SpecError(f"annotations[{BATCH}]", shown, f"a positive integer string up to {MAX_BATCH}, e.g. \"32\"")
    return int(text)


def gpu_containers(pod: dict[str, Any]) -> tuple[tuple[int, ...], set[str]]:
    """The indexes of the containers that request ``nvidia.com/gpu`` or a MIG resource (limits or requests),
    and the MIG profiles among them."""
    found, profiles = [], set()
    for i, container in enumerate(listing(mapping(pod.get("spec")).get("containers"))):
        resources = mapping(mapping(container).get("resources"))
        names = {*mapping(resources.get("limits")), *mapping(resources.get("requests"))}
        mig = {p for p in map(mig_profile_of, names) if p is not None}
        if GPU_RESOURCE in names or mig:
            found.append(i)
            profiles |= mig
    return tuple(found), profiles


def pinned_products(pod: dict[str, Any]) -> list[str]:
    """The card names the pod pins: the ``nvidia.com/gpu.product`` node selector, else the values of required
    node affinity on that label (``In``; any of the terms may match, so every value counts, and a term
    without such an expression pins nothing), else the ``batchfit.io/gpu`` annotation (what places the pod
    comes first); [] when nothing pins it."""
    spec = mapping(pod.get("spec"))
    selected = mapping(spec.get("nodeSelector")).get(PRODUCT)
    if isinstance(selected, str) and selected:
        return [selected]
    required = mapping(mapping(mapping(spec.get("affinity")).get("nodeAffinity")).get(
        "requiredDuringSchedulingIgnoredDuringExecution"))
    values: list[str] = []
    for term in listing(required.get("nodeSelectorTerms")):
        pinned = [v for expr in map(mapping, listing(mapping(term).get("matchExpressions")))
                  if expr.get("key") == PRODUCT and expr.get("operator") == "In"
                  for v in listing(expr.get("values")) if isinstance(v, str)]
        if not pinned:  # a term that leaves the product open: the pod may land on any card
            values = []
            break
        values += [v for v in pinned if v not in values]
    if values:
        return values
    pin = annotations_of(pod).get(PIN)
    return [pin.strip()] if isinstance(pin, str) and pin.strip() else []
