"""One request end to end, in one downward pass: the job, the model, its steps, the answer.

>>> response = estimate(parse_request(request_json))                      # doctest: +SKIP
>>> response.results[0].max_batch_size

    request/   the request -> a Job: the model section, the recipe, the cards, the planner's options
    models/    the model on the meta device, its batches and loss
    simulate/  full simulations of its training step (a StepSource)
    plan/      the answer: per card the max batch, the recommendation, advice

``progress(done, note)`` is called after each full simulation. A portable
profile (``make_profile``) answers the same request later, anywhere, without
the model's code (``estimate_from_profile``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from estimator import __version__, torch_version
from estimator.errors import SpecError
from estimator.gpus import CATALOG_VERSION, GPU, get_gpu
from estimator.models import BatchFactory, BuiltModel, LossFn, ModelFactory, build
from estimator.options import ConfirmMode
from estimator.plan.answer import SourceFor, answer, smallest_batch
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse
from estimator.plan.steps import Steps
from estimator.portable.profile import PortableProfile, profile_of
from estimator.portable.replayer import ProfileReplayer
from estimator.replay.allocator import AllocatorConfig
from estimator.replay.report import MemoryReport, report_from_trace
from estimator.request.adapt import job_of, with_changes, with_planner
from estimator.request.parse import parse_request
from estimator.request.spec import EstimateRequest
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built
from estimator.simulate.source import Progress, Simulator


def estimate(request: EstimateRequest, *, built: BuiltModel | None = None, progress: Progress | None = None,
             align: bool | None = None, confirm: ConfirmMode | str | None = None,
             reserve_bytes: int | None = None) -> EstimateResponse:
    """Answer ``request`` (docs/API.md): per card the max and recommended batch and the memory.

    The max comes from replays of the affine trace, confirmed (``confirm``:
    'top', 'every-card' or 'none') by full simulations; when the step is not
    affine in the batch, or a confirmation disagrees, from full simulations
    alone. ``reserve_bytes`` stays free on every card besides the CUDA
    context. The keyword arguments override the request's ``planner`` section.
    """
    t0 = time.perf_counter()
    request = with_planner(request, align=align, confirm=confirm, reserve_bytes=reserve_bytes)
    job = job_of(request)
    built = built or build(job.model, job.input)
    source = Simulator(built, job.recipe, progress)
    if job.plan.world_size is not None:
        source.prefetch(2, job.cards[0])  # every search needs batch 2 (a fit point, or the start), beside batch 1
    return answer(source, job.cards, job.plan, source_for=_sources(request, built, progress), started=t0)


def _sources(request: EstimateRequest, built: BuiltModel, progress: Progress | None) -> SourceFor:
    """The steps of ``request`` with a change applied (the model built again only when its input changes)."""
    def source_for(change: Mapping[str, Any]) -> Simulator:
        job = job_of(with_changes(request, change))
        model = build(job.model, job.input) if any(k.startswith(("model.", "input.")) for k in change) else built
        return Simulator(model, job.recipe, progress)
    return source_for


def estimate_memory(model_factory: ModelFactory, batch_factory: BatchFactory, loss_fn: LossFn, batch_size: int, *,
                    recipe: Recipe | None = None, gpu: str | GPU | None = "A100-80GB",
                    allocator: AllocatorConfig | None = None, worst_case: bool | None = None) -> MemoryReport:
    """Simulate training steps of the model on ``gpu`` and report peak memory.

    ``model_factory()`` is called under ``torch.device("meta")``;
    ``batch_factory(batch_size, device)`` returns ``(inputs, targets)`` where
    ``inputs`` is a tensor, a tuple (positional) or a dict (keyword arguments);
    ``loss_fn(outputs, targets)`` returns the scalar loss. ``gpu=None``
    targets the CPU. ``worst_case``: data-dependent sizes at their maximum
    (virtual_gpu/worst_case.py); None (default) applies the policy only when
    the step turns out to need it, False raises ``DataDependentError`` then.
    """
    card = get_gpu(gpu) if isinstance(gpu, str) else gpu
    built = BuiltModel("model", model_factory, batch_factory, loss_fn, {}, 0, worst_case=bool(worst_case))
    if worst_case is None:
        trace = record_built(built, batch_size, recipe or Recipe(), card)
    else:
        from estimator.simulate.record import record_training

        trace = record_training(model_factory, batch_factory, loss_fn, batch_size, recipe or Recipe(), card,
                                worst_case=worst_case)
    return report_from_trace(trace, batch_size, card, allocator)


def make_profile(request: EstimateRequest, *, built: BuiltModel | None = None,
                 progress: Progress | None = None) -> PortableProfile:
    """The portable profile of the request's model and recipe, for every attention backend the catalog uses."""
    if request.training.distributed.world_size == "auto":
        raise SpecError("training.distributed.world_size", "auto", "an integer: a profile holds one world size's "
                        "traces")
    job = job_of(request)
    built = built or build(job.model, job.input)
    source = Simulator(built, job.recipe, progress)
    source.prefetch(2, job.cards[0])
    steps, notes = Steps(source, job.plan.reserve_bytes), Notes()
    start = smallest_batch(steps, job.cards[0], notes)
    doc = request.model_dump(mode="json", exclude={"gpus", "batch_size"})
    doc["input"] = {**doc["input"], **built.input}
    versions = {"batchfit": __version__, "torch": torch_version(), "catalog": CATALOG_VERSION}
    return profile_of(steps, source.backend_key, job.cards, start,
                      request=doc, notes=[w.message for w in notes.warnings()], versions=versions)


def estimate_from_profile(profile: PortableProfile, gpus: list[Any] | None = None, batch_size: int | None = None,
                          planner: dict[str, Any] | None = None) -> EstimateResponse:
    """Answer from a profile alone: the same numbers as ``estimate(..., confirm='none')`` on the spec."""
    t0 = time.perf_counter()
    data = {**profile.request, "gpus": gpus, "batch_size": batch_size}
    data["planner"] = {**data.get("planner", {}), **(planner or {}), "confirm": ConfirmMode.NONE.value}
    job = job_of(parse_request(data))
    return answer(ProfileReplayer(profile), job.cards, job.plan, started=t0)
