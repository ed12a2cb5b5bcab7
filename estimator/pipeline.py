"""One request end to end, in one downward pass: the job, the model, its steps, the answer.

>>> response = estimate(parse_request(request_json))                      # doctest: +SKIP
>>> response.results[0].max_batch_size

    request/   the request -> a Job: the model section, the recipe, the cards, the planner's options
    models/    the model on the meta device, its batches and loss
    simulate/  full simulations of its training step (a StepSource)
    plan/      the answer: per card the max batch, the recommendation, advice

``progress(done, note)`` hears each full simulation. A portable profile (``make_profile``) answers the
request later without the model's code (``estimate_from_profile``); ``step_view`` is one step of the answer
for its views, ``timeline`` and ``snapshot`` (a CUDA memory snapshot).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from estimator import __version__, torch_version
from estimator.errors import SpecError
from estimator.gpus import CATALOG_VERSION
from estimator.models import BuiltModel, build
from estimator.options import ConfirmMode
from estimator.plan.answer import SourceFor, answer, smallest_batch
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse, GPUResult
from estimator.plan.steps import Steps
from estimator.portable.profile import PortableProfile, profile_of
from estimator.portable.replayer import ProfileReplayer
from estimator.replay.snapshot import snapshot_of
from estimator.replay.timeline import Timeline, timeline_of
from estimator.replay.view import StepView, view_of
from estimator.request.adapt import Job, job_of, with_changes, with_planner
from estimator.request.parse import parse_request
from estimator.request.profile import profile_job
from estimator.request.spec import EstimateRequest
from estimator.simulate.collector import rare_full_collections
from estimator.simulate.memory import estimate_memory  # noqa: F401  (estimator.pipeline.estimate_memory, as before)
from estimator.simulate.source import Progress, Simulator


def estimate(request: EstimateRequest, *, built: BuiltModel | None = None, progress: Progress | None = None,
             align: bool | None = None, confirm: ConfirmMode | str | None = None,
             reserve_bytes: int | None = None) -> EstimateResponse:
    """Answer ``request`` (docs/API.md): per card the max and recommended batch and the memory.

    The max comes from replays of the affine trace, confirmed (``confirm``: 'top', 'every-card' or 'none') by
    full simulations; when the step is not affine in the batch, or a confirmation disagrees, from full
    simulations alone. The keyword arguments override the request's ``planner`` section.
    """
    t0 = time.perf_counter()
    request = with_planner(request, align=align, confirm=confirm, reserve_bytes=reserve_bytes)
    job = job_of(request)
    return _answer(request, job, Simulator(built or build(job.model, job.input), job.recipe, progress), t0)


def _answer(request: EstimateRequest, job: Job, source: Simulator, t0: float | None = None) -> EstimateResponse:
    with rare_full_collections():  # what the estimate keeps, out of full collections' way until it answers
        if job.plan.world_size is not None:
            source.prefetch_second(2, job.cards[0])  # every search needs batch 2 (a fit point, or the start)
        return answer(source, job.cards, job.plan, source_for=_sources(request, source.built, source.progress),
                      started=t0)


def _sources(request: EstimateRequest, built: BuiltModel, progress: Progress | None) -> SourceFor:
    """The steps of ``request`` with a change applied (the model built again only when its input changes)."""
    def source_for(change: Mapping[str, Any]) -> Simulator:
        job = job_of(with_changes(request, change))
        model = build(job.model, job.input) if any(k.startswith(("model.", "input.")) for k in change) else built
        label = ", with " + ", ".join(f"{k}={json.dumps(v)}" for k, v in change.items())
        return Simulator(model, job.recipe, progress, label=label)
    return source_for


# what ``warm_up`` simulates, one step each on one card: a small CNN and a small transformer (the paths a process's
# first simulations take: cuDNN's backend queries, the fake mode's first dispatches, the engine, AdamW, autocast)
_WARM_UPS = (
    {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 32, 32]}},
    {"model": {"source": "transformers", "task": "causal-lm",
               "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                          "max_position_embeddings": 256, "num_hidden_layers": 2}},
     "input": {"seq_len": 32}, "training": {"precision": "amp-bf16"}},
)


def warm_up() -> list[str]:
    """What a service worker does before its first request (app/worker.py): import every installed model library
    (``estimator.models.registry.warm``; its names are returned) and simulate one step of a small CNN and of a small
    transformer, so that a cold estimate's first simulations find torch's lazy state set up (~15-20 ms off a cold
    resnet50 estimate of ~0.38 s: cuDNN's first backend choice alone is ~7 ms in each process); then collect what
    they left. Nothing of them is kept but torch's own lazily set-up state: a request's answer is the same either
    way. A step that fails is skipped (a library's absence refuses it): a warm-up never keeps a worker from
    serving."""
    import gc

    from estimator.models.registry import warm

    done = warm()
    for doc in _WARM_UPS:
        try:
            job = job_of(parse_request(doc))
            Simulator(build(job.model, job.input), job.recipe).simulate(2, job.cards[0])
        except Exception:  # noqa: BLE001 - only a head start: the first request then pays for what it skipped
            continue
    gc.collect()
    return done


def make_profile(request: EstimateRequest, *, built: BuiltModel | None = None,
                 progress: Progress | None = None) -> PortableProfile:
    """The portable profile of the request's model and recipe, for every attention backend the catalog uses."""
    if request.training.distributed.world_size == "auto":
        raise SpecError("training.distributed.world_size", "auto", "an integer: a profile holds one world size's "
                        "traces")
    job = job_of(request)
    built = built or build(job.model, job.input)
    source = Simulator(built, job.recipe, progress)
    with rare_full_collections():
        source.prefetch_second(2, job.cards[0])
        steps, notes = Steps(source, job.plan.reserve_bytes), Notes()
        start = smallest_batch(steps, job.cards[0], notes)
    doc = request.model_dump(mode="json", exclude={"gpus", "batch_size"})
    doc["input"] = {**doc["input"], **built.input}
    versions = {"batchfit": __version__, "torch": torch_version(), "catalog": CATALOG_VERSION}
    return profile_of(steps, source.backend_key, job.cards, start,
                      request=doc, notes=[w.message for w in notes.warnings()], versions=versions)


def estimate_from_profile(profile: PortableProfile, gpus: list[Any] | None = None, batch_size: int | None = None,
                          planner: dict[str, Any] | None = None) -> EstimateResponse:
    """Answer from a profile alone: the same numbers as ``estimate(..., confirm='none')`` on the spec, each
    card's ``search.method`` 'profile'; ``planner``: fields over the profile's own planner section."""
    t0 = time.perf_counter()
    job = profile_job(profile, gpus, batch_size, planner)  # never built: a profile's model is only a label
    return answer(ProfileReplayer(profile), job.cards, job.plan, started=t0)


def step_view(request: EstimateRequest, batch_size: int | None = None, *,
              response: EstimateResponse | None = None) -> StepView:
    """The first card's step, ``step_view(request).report``: at ``batch_size`` (else the request's), else at
    ``view_batch`` of ``response`` (else of ``estimate`` without suggestions), simulated again unless that search
    did; with ``world_size: "auto"``, over the ranks the card needs."""
    if batch_size is not None and batch_size < 1:
        raise SpecError("batch_size", batch_size, "an integer >= 1")
    job, batch = job_of(request), batch_size or request.batch_size
    source = Simulator(build(job.model, job.input), job.recipe, keep=True)
    if response is None and (batch is None or job.plan.world_size is None):
        quick = with_planner(request.model_copy(update={"batch_size": batch}), suggestions=False, max_seq_len=False)
        response = _answer(quick, job_of(quick), source)
    if response is not None:
        first = response.results[0]
        batch = batch or view_batch(first)
        if job.plan.world_size is None:
            job = job_of(with_changes(request, {"training.distributed.world_size": first.world_size}))
            source = Simulator(source.built, job.recipe)
    assert batch is not None  # given, or the answer's
    return view_of(source.step(batch, job.cards[0]), batch, job.cards[0], job.plan.reserve_bytes)


def profile_view(profile: PortableProfile, gpus: list[Any] | None = None, batch_size: int | None = None, *,
                 response: EstimateResponse | None = None) -> StepView:
    """``step_view`` of a profile's step on the first of ``gpus`` (the catalog's first without), synthesized."""
    first = (response or estimate_from_profile(profile, gpus, batch_size)).results[0]
    job = profile_job(profile, gpus)
    batch, card = batch_size or view_batch(first), job.cards[0]
    return view_of(ProfileReplayer(profile).step(batch, card), batch, card, job.plan.reserve_bytes)


def view_batch(result: GPUResult) -> int:
    """The batch a card's step is shown at when the request names none: recommended, else max, else smallest."""
    return result.recommended_batch_size or result.max_batch_size or result.min_batch_size


def timeline(request: EstimateRequest, batch_size: int | None = None) -> Timeline:
    """The memory timeline of ``step_view``'s step (``POST /timeline``; ``dataclasses.asdict`` is its JSON)."""
    return timeline_of(step_view(request, batch_size))


def snapshot(request: EstimateRequest, batch_size: int | None = None) -> dict[str, Any]:
    """``step_view``'s step as ``torch.cuda.memory._snapshot()`` has it: pickled, it opens at
    https://pytorch.org/memory_viz (``POST /snapshot``)."""
    return snapshot_of(step_view(request, batch_size))
