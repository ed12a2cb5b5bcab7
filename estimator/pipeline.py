"""One request end to end, in one downward pass: adapt, build, simulate, plan, answer.

>>> response = estimate(parse_request(request_json))                      # doctest: +SKIP
>>> response.results[0].max_batch_size

    request/   the request -> a Recipe, the cards, the planner's options
    models/    the model on the meta device, its batches and loss
    sources    full simulations (simulate/ records, replay/ replays) or a portable profile
    plan/      per card: the max batch (strategy), the recommendation, advice
    here       the response

``progress(done, note)`` is called after each full simulation. A portable
profile (``make_profile``) answers the same request later, anywhere,
without the model's code (``estimate_from_profile``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from estimator import __version__, torch_version
from estimator.errors import BatchTooSmallError, SpecError
from estimator.gpus import CATALOG, CATALOG_VERSION, GPU, get_gpu
from estimator.models import BuiltModel, build
from estimator.plan.advice import advise
from estimator.plan.affine import concrete
from estimator.plan.results import EstimateResponse, GPUResult, Note, Provenance, WarningCode
from estimator.plan.search import max_fitting
from estimator.plan.strategy import ConfirmMode, StepSource, max_batches, recommend
from estimator.portable import PortableProfile
from estimator.replay.allocator import AllocatorConfig
from estimator.replay.report import MemoryReport, report_from_trace
from estimator.request.adapt import advice_options, cards_of, recipe_of, with_planner
from estimator.request.recipe import MAX_WORLD_SIZE, Recipe
from estimator.request.spec import EstimateRequest, parse_request
from estimator.simulate.record import record_built, record_training
from estimator.simulate.step import BatchFactory, LossFn, ModelFactory
from estimator.sources import CHECK_OFFSET, ProfileReplayer, Progress, Simulator
from estimator.worlds import Suggester, Worlds


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
    if request.training.distributed.world_size == "auto":
        if request.planner.max_seq_len:
            raise SpecError("planner.max_seq_len", True, "false with training.distributed.world_size 'auto' "
                            "(search the seq_len at an integer world size)")
        return _estimate_auto(request, built, progress, t0)
    cards, built, sim, start, warnings = _simulator(request, built, progress)
    response = _answer(sim, request, cards, start, built.name, built.parameter_count, built.input,
                       list(built.assumptions), warnings, t0, sim.recipe.distributed.world_size)
    if request.training.distributed.strategy == "none" and request.planner.suggestions:
        response = _with_suggestions(response, request, built, sim.recipe, cards, start, t0)
    if not request.planner.max_seq_len:
        return response
    if "seq_len" not in built.input:
        raise SpecError("planner.max_seq_len", True, "a text model (one with input.seq_len)")
    longest = SeqLenSearch(request, sim.recipe, request.batch_size or start)
    results = [dataclasses.replace(r, max_seq_len=longest.max_seq_len(card))
               for card, r in zip(cards, response.results, strict=True)]
    provenance = dataclasses.replace(response.provenance, simulations=response.provenance.simulations
                                     + len(longest.traces), seconds=round(time.perf_counter() - t0, 3))
    return dataclasses.replace(response, results=results, provenance=provenance)


def _estimate_auto(request: EstimateRequest, built: BuiltModel | None, progress: Progress | None,
                   t0: float) -> EstimateResponse:
    """``world_size: "auto"``: per card the fewest ranks at which the smallest batch fits
    (``estimator.worlds``), and the answer there."""
    cards = cards_of(request)
    built = built or build(request)
    worlds = Worlds(built, request, progress)
    warnings: list[Note] = []
    start = _smallest_batch(worlds.sim(1), cards[0], warnings)
    if request.batch_size is not None and request.batch_size < start:
        raise SpecError("batch_size", request.batch_size, f"at least {start}")
    at = request.batch_size or start  # the fewest ranks at which this batch fits
    strategy = request.training.distributed.strategy
    chosen = [worlds.min_world(card, at) for card in cards]
    # a card no world fits is answered at the largest world tried (one rank for DDP, which shards nothing)
    unfit = 1 if strategy == "ddp" else MAX_WORLD_SIZE
    groups: dict[int, list[int]] = {}
    for i, world in enumerate(chosen):
        groups.setdefault(world or unfit, []).append(i)
    parts = {w: _answer(worlds.sim(w), request, [cards[i] for i in members], start, built.name,
                        built.parameter_count, built.input, list(built.assumptions), list(warnings), t0, w)
             for w, members in groups.items()}
    results: list[GPUResult | None] = [None] * len(cards)
    for w, members in groups.items():
        for i, result in zip(members, parts[w].results, strict=True):
            results[i] = dataclasses.replace(result, min_world_size=chosen[i])
    first = parts[chosen[0] or unfit]
    assumptions: list[str] = []
    notes: list[Note] = []
    for part in parts.values():
        assumptions.extend(a for a in part.assumptions if a not in assumptions)
        notes.extend(n for n in part.warnings if n not in notes)
    assumptions.append(f"world_size 'auto': per card the fewest ranks (1 to {MAX_WORLD_SIZE}) at which batch "
                       f"{at} fits, found by doubling then bisection on full simulations of one rank"
                       + ("; DDP keeps the whole step on every rank, so only one rank is tried" if strategy == "ddp"
                          else ""))
    for card, world in zip(cards, chosen, strict=True):
        if world is None:
            notes = [n for n in notes if not (n.code == WarningCode.DOES_NOT_FIT and n.message.endswith(
                f" on {card.name} even at batch {start}"))]
            across = "on one rank: DDP keeps the whole step on every rank" if strategy == "ddp" else \
                f"over {MAX_WORLD_SIZE} ranks of {strategy}"
            notes.append(Note(WarningCode.DOES_NOT_FIT, f"{built.name} does not fit on {card.name} at batch {at} "
                              f"even {across}"))
    provenance = dataclasses.replace(first.provenance, simulations=worlds.simulations,
                                     seconds=round(time.perf_counter() - t0, 3))
    return dataclasses.replace(first, results=[r for r in results if r is not None], assumptions=assumptions,
                               warnings=notes, provenance=provenance)


def _with_suggestions(response: EstimateResponse, request: EstimateRequest, built: BuiltModel, recipe: Recipe,
                      cards: list[GPU], start: int, t0: float) -> EstimateResponse:
    """A single-GPU answer whose smallest batch does not fit some card, with what would make it fit
    (``estimator.worlds.Suggester``): each checked by a simulation."""
    if all(r.max_batch_size is not None for r in response.results):
        return response
    results, warnings = [], list(response.warnings)
    suggester = Suggester(built, request, recipe, start)  # its simulations shared by the cards
    for card, result in zip(cards, response.results, strict=True):
        if result.max_batch_size is not None:
            results.append(result)
            continue
        found = suggester.for_card(card)
        results.append(dataclasses.replace(result, suggestions=found))
        unfit = f"{built.name} does not fit on {card.name} even at batch {start}"
        if found:
            for i, w in enumerate(warnings):
                if w.code == WarningCode.DOES_NOT_FIT and w.message == unfit:
                    warnings[i] = Note(w.code, f"{w.message}; it fits with {found[0].description}"
                                       + (f" (or: {'; '.join(s.description for s in found[1:])})"
                                          if len(found) > 1 else ""))
    provenance = dataclasses.replace(response.provenance, seconds=round(time.perf_counter() - t0, 3),
                                     simulations=response.provenance.simulations + suggester.simulations)
    return dataclasses.replace(response, results=results, warnings=warnings, provenance=provenance)


def estimate_memory(
    model_factory: ModelFactory,
    batch_factory: BatchFactory,
    loss_fn: LossFn,
    batch_size: int,
    *,
    recipe: Recipe | None = None,
    gpu: str | GPU | None = "A100-80GB",
    allocator: AllocatorConfig | None = None,
    worst_case: bool | None = None,
) -> MemoryReport:
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
    recipe = recipe or Recipe()
    if worst_case is None:
        built = BuiltModel("model", model_factory, batch_factory, loss_fn, {}, 0)
        trace = record_built(built, batch_size, recipe, card)
    else:
        trace = record_training(model_factory, batch_factory, loss_fn, batch_size, recipe, card, worst_case=worst_case)
    return report_from_trace(trace, batch_size, card, allocator)


def _simulator(request: EstimateRequest, built: BuiltModel | None,
               progress: Progress | None) -> tuple[list[GPU], BuiltModel, Simulator, int, list[Note]]:
    """(cards, built model, simulator, smallest batch, warnings): a bad card name fails before any build."""
    cards = cards_of(request)
    recipe = recipe_of(request)
    built = built or build(request)
    sim = Simulator(built, recipe, progress, request.planner.reserve_bytes)
    sim.prefetch(2, cards[0])  # every search needs batch 2 (a fit point, or the start); simulated beside batch 1
    warnings: list[Note] = []
    return cards, built, sim, _smallest_batch(sim, cards[0], warnings), warnings


def _smallest_batch(sim: Simulator, card: GPU, warnings: list[Note]) -> int:
    """1, or 2 when batch norm refuses a batch of one (the same on every card)."""
    try:
        sim.report(1, card)
        return 1
    except BatchTooSmallError as exc:
        warnings.append(Note(WarningCode.BATCH_ONE_CANNOT_TRAIN, f"batch 1 cannot train: {exc}"))
        return 2


class SeqLenSearch:
    """The largest seq_len that fits at one batch, by bisection on full simulations (memory is not
    affine in the sequence length: attention scores grow with its square on the math backend)."""

    def __init__(self, request: EstimateRequest, recipe: Recipe, batch: int) -> None:
        self.request, self.recipe, self.batch = request, recipe, batch
        self.limit = _seq_limit(request)
        self.traces: dict[tuple[int, tuple[int, int], int], Any] = {}

    def fits(self, seq: int, card: GPU) -> bool:
        key = (seq, card.capability, card.cublas_workspace_bytes)
        if key not in self.traces:
            req = self.request.model_copy(update={"input": self.request.input.model_copy(update={"seq_len": seq})})
            b = build(req)
            self.traces[key] = record_built(b, self.batch, self.recipe, card)
        trace = self.traces[key]
        return report_from_trace(trace, self.batch, card, reserve_bytes=self.request.planner.reserve_bytes).fits

    def max_seq_len(self, card: GPU) -> int | None:
        return max_fitting(lambda seq: self.fits(seq, card), self.limit)


def _seq_limit(request: EstimateRequest) -> int:
    """The model's maximum positions, or 2**17 for models without a position table."""
    if request.model.source == "transformers":
        from estimator.models.transformers_models import max_positions

        limit = max_positions(request.model)
        if limit is not None:
            return limit
    return 2**17


def make_profile(request: EstimateRequest, *, built: BuiltModel | None = None,
                 progress: Progress | None = None) -> PortableProfile:
    """The portable profile of the request's model and recipe, for every attention backend the catalog uses."""
    if request.training.distributed.world_size == "auto":
        raise SpecError("training.distributed.world_size", "auto", "an integer: a profile holds one world size's "
                        "traces")
    cards, built, sim, start, warnings = _simulator(request, built, progress)
    steps, first, flops = {}, {}, {}
    for card in list(CATALOG.values()) + cards:
        key = sim.backend_key(card)
        if key in steps:
            continue
        if sim.trace(start, card).card_queries:
            raise SpecError("model", built.name, "a model that does not ask torch.cuda about the card "
                            f"(it asked {', '.join(sim.trace(start, card).card_queries)}): profile it per card")
        affine = sim.profile(start, card)
        if affine is None:
            raise SpecError("model", built.name, "a step whose ops do not change with the batch size "
                            "(a portable profile synthesizes every batch from two)")
        steps[key], first[key] = affine, concrete(sim.trace(start, card))
        flops[key] = (sim.flops(start + 1, card, start), sim.flops(start + 2, card, start))
    card = cards[0]
    calls = [{"dtype": str(c.dtype), "dim": c.dim, "head_dims": list(c.head_dims), "has_mask": c.has_mask,
              "requires_grad": c.requires_grad} for c in sim.trace(start, card).sdpa_calls]
    doc = request.model_dump(mode="json", exclude={"gpus", "batch_size"})
    doc["input"] = {**doc["input"], **built.input}
    return PortableProfile(
        request=doc, model=built.name, parameter_count=built.parameter_count, start=start,
        flops=flops, sdpa_calls=calls,
        steps=steps, first_steps=first, assumptions=list(built.assumptions) + [w.message for w in warnings],
        versions={"batchfit": __version__, "torch": torch_version(), "catalog": CATALOG_VERSION},
        capability_thresholds=list(sim.trace(start, card).capability_thresholds),
    )


def estimate_from_profile(profile: PortableProfile, gpus: list[Any] | None = None, batch_size: int | None = None,
                          planner: dict[str, Any] | None = None) -> EstimateResponse:
    """Answer from a profile alone: the same numbers as ``estimate(..., confirm='none')`` on the spec."""
    t0 = time.perf_counter()
    data = {**profile.request, "gpus": gpus, "batch_size": batch_size}
    data["planner"] = {**data.get("planner", {}), **(planner or {}), "confirm": ConfirmMode.NONE.value}
    request = parse_request(data)
    cards = cards_of(request)
    source = ProfileReplayer(profile, request.planner.reserve_bytes)
    return _answer(source, request, cards, profile.start, profile.model, profile.parameter_count,
                   profile.request.get("input", {}), list(profile.assumptions), [], t0,
                   recipe_of(request).distributed.world_size)


def _answer(source: StepSource, request: EstimateRequest, cards: list[GPU], start: int, name: str,
            parameter_count: int, resolved_input: dict[str, Any], assumptions: list[str], warnings: list[Note],
            t0: float, world_size: int = 1) -> EstimateResponse:
    plan = request.planner
    if request.batch_size is not None and request.batch_size < start:
        why = next((w.message for w in warnings if w.code == WarningCode.BATCH_ONE_CANNOT_TRAIN), "")
        raise SpecError("batch_size", request.batch_size, f"at least {start}: {why}")
    results: list[GPUResult] = []
    shown: MemoryReport | None = None
    answers = max_batches(source, cards, start, ConfirmMode(plan.confirm), warnings)
    distributed = request.training.distributed.strategy != "none"
    options = advice_options(request, resolved_input, world_size if distributed else None)
    steps = request.training.grad_accumulation_steps
    ranks = world_size if distributed else plan.data_parallel_ranks  # the global batch's ranks
    gap = 2  # the headroom searches', as in the max's replay searches
    for card, (best, how) in zip(cards, answers, strict=True):
        at = request.batch_size or best or start
        report = source.report_fast(at, card)
        if request.batch_size is not None and not report.fits:
            warnings.append(Note(WarningCode.BATCH_SIZE_DOES_NOT_FIT,
                                 f"batch_size {request.batch_size} does not fit on {card.name}"))
        if best is None:
            warnings.append(Note(WarningCode.DOES_NOT_FIT, f"{name} does not fit on {card.name} even at batch {start}"))
        for line in report.assumptions:
            if line not in assumptions:
                assumptions.append(line)
        rec, shrunk, gap = recommend(source, card, start, best, plan.headroom, plan.align, gap)
        if best is not None and rec is None:
            warnings.append(Note(WarningCode.NO_RECOMMENDATION, f"{card.name}: batch {start} fits but not within "
                                 f"{1 - plan.headroom:.1%} of the usable memory (planner.headroom); no batch is "
                                 "recommended"))
        advice = advise(source, card, start, best, rec, options)
        results.append(GPUResult(
            gpu=card.name, capacity_bytes=card.memory_bytes, min_batch_size=start, max_batch_size=best,
            recommended_batch_size=rec, search=how, memory=report,
            max_memory=None if best is None else source.report_fast(best, card),
            recommended_memory=None if rec is None else source.report_fast(rec, shrunk),
            world_size=world_size, global_batch_size=None if rec is None else rec * ranks * steps,
            **vars(advice)))
        shown = shown or report
    assert shown is not None  # a request names at least one card
    assumptions.extend(_planner_assumptions(request, results))
    # The line through the allocated peaks at start + 1 and far from it (the
    # first card's max): peaks a few batches apart move in allocator blocks.
    lo = start + 1
    hi = max(results[0].max_batch_size or 0, lo + CHECK_OFFSET)
    a, b = source.report_fast(lo, cards[0]), source.report_fast(hi, cards[0])
    per_sample = (b.allocated_peak_bytes - a.allocated_peak_bytes) // (hi - lo)
    warnings.extend(Note(WarningCode.NOT_MODELLED, f"not modelled: {item}") for item in shown.unsupported)
    return EstimateResponse(
        results=results, breakdown=shown.breakdown, per_sample_bytes=per_sample,
        fixed_bytes=a.allocated_peak_bytes - per_sample * lo, parameter_count=parameter_count,
        flops_per_sample=source.flops(start + 2, cards[0], start) - source.flops(start + 1, cards[0], start),
        assumptions=assumptions, warnings=warnings,
        provenance=Provenance(batchfit=__version__, torch=torch_version(), catalog=CATALOG_VERSION,
                              seconds=round(time.perf_counter() - t0, 3), simulations=source.simulations),
    )


def _planner_assumptions(request: EstimateRequest, results: list[GPUResult]) -> list[str]:
    plan = request.planner
    lines = [f"safety margin: {plan.reserve_bytes // 2**20} MiB kept free on every card besides the CUDA context "
             "(context sizes vary by driver and CUDA version by about that much)"]
    if request.training.zero_grad_at == "step-start":
        lines.append("zero_grad before the forward (HF Trainer, timm): the previous step's gradients are freed "
                     "first; a loop that zeroes them after the forward, as Lightning's does, needs their bytes "
                     "more at the forward's end (training.zero_grad_at: 'after-forward')")
    lines.append(f"headroom: recommended_batch_size fits with its device peak (reserved + CUDA context) within "
                 f"{1 - plan.headroom:.1%} of the usable memory (capacity - CUDA context - reserve), since real "
                 "peaks ran up to 11% above predictions in published runs; recommended_memory is that step with "
                 "the allocator held there (torch.cuda.set_per_process_memory_fraction does so on a card; a free "
                 "allocator caches more); max_batch_size has no headroom")
    if plan.align:
        lines.append("recommended_batch_size: rounded down to a multiple of 8 (tensor cores) when that gives up "
                     "less than 10%")
    if any(r.step_seconds is not None for r in results):
        lines.append(f"step time: the step's FLOPs at {plan.efficiency:.0%} of the card's peak (bf16 tensor cores "
                     "for amp/bf16, fp32 otherwise)")
    return lines
