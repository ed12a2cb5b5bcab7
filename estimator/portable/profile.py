"""The portable profile: a request's affine traces as JSON, answered later without the model's code.

>>> profile = make_profile(request)                          # doctest: +SKIP
>>> estimate_from_profile(PortableProfile.from_json(profile.to_json()), gpus=["A100-80GB"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from estimator.errors import SpecError
from estimator.gpus import CATALOG, GPU
from estimator.plan.affine import SCHEMA_VERSION, AffineTrace, concrete, from_json
from estimator.portable.schema import PROFILE_SCHEMA, check_profile_doc
from estimator.trace import Trace

if TYPE_CHECKING:
    from estimator.plan.steps import Steps


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
            "schema": PROFILE_SCHEMA, "version": SCHEMA_VERSION, "versions": self.versions,
            "request": self.request, "model": self.model, "parameter_count": self.parameter_count,
            "start": self.start, "flops": {k: list(v) for k, v in self.flops.items()}, "sdpa_calls": self.sdpa_calls,
            "assumptions": self.assumptions,
            "capability_thresholds": [list(t) for t in self.capability_thresholds],
            "steps": {k: v.to_json() for k, v in self.steps.items()},
            "first_steps": {k: v.to_json() for k, v in self.first_steps.items()},
        }

    @classmethod
    def from_json(cls, doc: Any, field: str = "--profile") -> PortableProfile:
        """The profile ``doc`` holds, checked by its strict schema first (``SpecError`` naming ``field``'s
        first bad part: estimator/portable/schema.py)."""
        check_profile_doc(doc, field)
        try:
            return cls(doc["request"], doc["model"], int(doc["parameter_count"]), int(doc["start"]),
                       {k: (int(v[0]), int(v[1])) for k, v in doc["flops"].items()}, list(doc["sdpa_calls"]),
                       {k: from_json(v) for k, v in doc["steps"].items()},
                       {k: from_json(v) for k, v in doc["first_steps"].items()},
                       list(doc["assumptions"]), dict(doc["versions"]),
                       [(int(a), int(b)) for a, b in doc["capability_thresholds"]])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecError(field, f"{type(exc).__name__}: {exc}", "a complete batchfit profile") from exc


def profile_of(steps: Steps, backend_key: Callable[[GPU], str], cards: Sequence[GPU], start: int, *,
               request: dict[str, Any], notes: Sequence[str] = (), versions: dict[str, str]) -> PortableProfile:
    """The profile of a simulated job: per attention-backend key of the catalog's cards and the request's
    (``cards``), the checked affine trace from ``start`` on, the step at ``start`` and the FLOPs; ``request``:
    the request as JSON, its input resolved; ``notes``: what the planner said of the model besides its
    assumptions."""
    affine: dict[str, AffineTrace] = {}
    first: dict[str, AffineTrace] = {}
    flops: dict[str, tuple[int, int]] = {}
    model = steps.model
    for card in [*CATALOG.values(), *cards]:
        key = backend_key(card)
        if key in affine:
            continue
        trace = steps.trace(start, card)
        assert isinstance(trace, Trace)  # simulated
        if trace.card_queries:
            raise SpecError("model", model.name, "a model that does not ask torch.cuda about the card "
                            f"(it asked {', '.join(trace.card_queries)}): profile it per card")
        # no affine fit (its ops change with the batch): refused before the growing trace's simulations
        unfit = steps.fit(start, card) is None and steps.fit(start, card, skip_start=True) is None
        fitted = None if unfit else steps.affine(start, card)
        if not isinstance(fitted, AffineTrace):  # None, or a growing trace
            raise SpecError("model", model.name, "a step whose ops do not change with the batch size "
                            "(a portable profile synthesizes every batch from two)")
        affine[key], first[key] = fitted, concrete(trace)
        flops[key] = (steps.flops(start + 1, card, start), steps.flops(start + 2, card, start))
    probe = steps.trace(start, cards[0])
    assert isinstance(probe, Trace)
    return PortableProfile(
        request=request, model=model.name, parameter_count=model.parameter_count, start=start, flops=flops,
        sdpa_calls=[{**asdict(c), "head_dims": list(c.head_dims)} for c in probe.sdpa_calls], steps=affine,
        first_steps=first, assumptions=list(model.assumptions) + list(notes), versions=versions,
        capability_thresholds=list(probe.capability_thresholds),
    )
