"""The ``AdmissionReview`` envelope (``admission.k8s.io/v1``): the request it carries and the responses the
webhook gives, for pods (app/k8s/webhook.py) and device claims (app/k8s/claims.py) alike.

>>> unchanged("the estimate is still running")
{'allowed': True, 'warnings': ['batchfit: the estimate is still running']}
"""

from __future__ import annotations

import base64
import json
from typing import Any

from app.k8s.pods import ESTIMATE, mapping
from estimator.errors import SpecError

REVIEW_VERSION = "admission.k8s.io/v1"
WARNING_CHARS = 240  # the API server may truncate warnings past 256 characters


def review_request(review: Any) -> dict[str, Any]:
    """``review.request``; ``SpecError`` when the body is not an AdmissionReview of admission.k8s.io/v1."""
    if not isinstance(review, dict):
        raise SpecError("(body)", type(review).__name__, "an AdmissionReview object")
    if review.get("apiVersion") != REVIEW_VERSION or review.get("kind") != "AdmissionReview":
        raise SpecError("apiVersion", review.get("apiVersion"), f"'{REVIEW_VERSION}' with kind 'AdmissionReview' "
                        "(set admissionReviewVersions: [v1] in the MutatingWebhookConfiguration)")
    request = review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise SpecError("request.uid", mapping(request).get("uid"), "the request's uid (a non-empty string)")
    return request


def answer_review(uid: str, response: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview that carries ``response`` for the request ``uid``."""
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": {"uid": uid, **response}}


def unchanged_review(uid: str, warning: str) -> dict[str, Any]:
    """An AdmissionReview that allows the object unchanged with ``warning`` (a defect's fallback)."""
    return answer_review(uid, unchanged(warning))


def unchanged(warning: str) -> dict[str, Any]:
    """Allowed as it is, with one warning (kubectl shows it to whoever created the object)."""
    return {"allowed": True, "warnings": [f"batchfit: {warning}"[:WARNING_CHARS]]}


def patched(ops: list[dict[str, Any]], warnings: list[str]) -> dict[str, Any]:
    """Allowed with the JSONPatch ``ops`` (RFC 6902, base64 in ``patch``) and any warnings."""
    response: dict[str, Any] = {"allowed": True, "patchType": "JSONPatch",
                                "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
    if warnings:
        response["warnings"] = [w[:WARNING_CHARS] for w in warnings]
    return response


def estimate_op(obj: dict[str, Any], summary: str) -> dict[str, Any]:
    """The operation that sets the ``batchfit.io/estimate`` annotation of ``obj`` to ``summary`` (added, or
    replaced when the object has one)."""
    notes = mapping(obj.get("metadata")).get("annotations")
    if not isinstance(notes, dict):
        return {"op": "add", "path": "/metadata/annotations", "value": {ESTIMATE: summary}}
    key = ESTIMATE.replace("~", "~0").replace("/", "~1")  # RFC 6901
    return {"op": "replace" if ESTIMATE in notes else "add", "path": f"/metadata/annotations/{key}", "value": summary}
