"""The portable profile: a request's affine traces as JSON, answered later without the model's code.

>>> profile = make_profile(request)                          # doctest: +SKIP
>>> estimate_from_profile(PortableProfile.from_json(profile.to_json()), gpus=["A100-80GB"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from estimator.errors import SpecError
from estimator.plan.affine import SCHEMA_VERSION, AffineTrace, from_json


@dataclass
class PortableProfile:
    """Everything ``batchfit estimate --profile`` needs, without the model's code.

    ``steps`` maps an attention-backend signature (the backends the step's
    SDPA calls get on a card, comma-joined; empty without SDPA) to the
    affine trace for batches >= ``start + 1``; ``first_steps`` holds the
    step at ``start`` itself, which may take other paths.
    """

    request: dict[str, Any]
    model: str
    parameter_count: int
    start: int
    flops: dict[str, tuple[int, int]]  # per backend signature: FLOPs at start + 1 and start + 2
    sdpa_calls: list[dict[str, Any]]
    steps: dict[str, AffineTrace]
    first_steps: dict[str, AffineTrace]
    assumptions: list[str]
    versions: dict[str, str]
    capability_thresholds: list[tuple[int, int]] = field(default_factory=list)  # part of the steps' keys

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "batchfit.profile", "version": SCHEMA_VERSION, "versions": self.versions,
            "request": self.request, "model": self.model, "parameter_count": self.parameter_count,
            "start": self.start, "flops": {k: list(v) for k, v in self.flops.items()}, "sdpa_calls": self.sdpa_calls,
            "assumptions": self.assumptions,
            "capability_thresholds": [list(t) for t in self.capability_thresholds],
            "steps": {k: v.to_json() for k, v in self.steps.items()},
            "first_steps": {k: v.to_json() for k, v in self.first_steps.items()},
        }

    @classmethod
    def from_json(cls, doc: Any) -> PortableProfile:
        if not isinstance(doc, dict) or doc.get("schema") != "batchfit.profile":
            raise SpecError("--profile", type(doc).__name__, "a batchfit profile (schema 'batchfit.profile')")
        if doc.get("version") != SCHEMA_VERSION:
            raise SpecError("--profile.version", doc.get("version"), f"{SCHEMA_VERSION} (re-run batchfit profile)")
        try:
            return cls(doc["request"], doc["model"], int(doc["parameter_count"]), int(doc["start"]),
                       {k: (int(v[0]), int(v[1])) for k, v in doc["flops"].items()}, list(doc["sdpa_calls"]),
                       {k: from_json(v) for k, v in doc["steps"].items()},
                       {k: from_json(v) for k, v in doc["first_steps"].items()},
                       list(doc["assumptions"]), dict(doc["versions"]),
                       [(int(a), int(b)) for a, b in doc["capability_thresholds"]])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecError("--profile", f"{type(exc).__name__}: {exc}", "a complete batchfit profile") from exc
