"""One request end to end: build, simulate, replay per card, search, answer.

>>> response = estimate(parse_request(request_json))                      # doctest: +SKIP
>>> response.results[0].max_batch_size

``progress(done, note)`` is called after each full simulation. A portable
profile (``make_profile``) answers the same request later, anywhere,
without the model's code (``estimate_from_profile``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from estimator import __version__
from estimator.errors import BatchTooSmallError, SpecError
from estimator.gpus import CATALOG, CATALOG_VERSION, GPU, MIB, custom_gpu, get_gpu
from estimator.models import BuiltModel, build
from estimator.planner import (
    MAX_BATCH, accumulation_plan, aligned_within, curve_batches, headroom_capacity, lr_advice, max_batch,
    max_batch_between, step_seconds,
)
from estimator.profile import AffineTrace, PortableProfile, concrete
from estimator.recipe import Recipe
from estimator.report import MemoryReport
from estimator.simulator import CHECK_OFFSET, ProfileReplayer, Progress, Simulator
from estimator.spec import (
    AccumulationOut, BreakdownOut, CurvePoint, CustomGPUSpec, EstimateRequest, EstimateResponse, GPUResult,
    LearningRateOut, MemoryAtBatch, Provenance, parse_request,
)

Source = Simulator | ProfileReplayer


def recipe_of(request: EstimateRequest) -> Recipe:
    t = request.training
    return Recipe(
        precision=t.precision, optimizer=t.optimizer.name, optimizer_kwargs=t.optimizer.kwargs(),
        gradient_checkpointing=t.gradient_checkpointing, grad_accumulation_steps=t.grad_accumulation_steps,
        zero_grad_set_to_none=t.zero_grad_set_to_none, zero_grad_at=t.zero_grad_at, cudnn_benchmark=t.cudnn_benchmark,
    )


def cards_of(request: EstimateRequest) -> list[GPU]:
    if request.gpus is None:
        return list(CATALOG.values())
    cards = []
    for i, g in enumerate(request.gpus):
        if isinstance(g, CustomGPUSpec):
            ctx = g.context_bytes if g.context_bytes is not None else 450 * MIB
            cards.append(custom_gpu(g.name, g.memory_bytes, g.compute_capability, ctx))
        else:
            cards.append(get_gpu(g, field=f"gpus[{i}]"))
    return cards


def _simulator(request: EstimateRequest, built: BuiltModel | None, progress: Progress | None):
    """(cards, built model, simulator, smallest batch, warnings): a bad card name fails before any build."""
    cards = cards_of(request)
    recipe = recipe_of(request)
    built = built or build(request)
    sim = Simulator(built, recipe, progress, request.planner.reserve_bytes)
    sim.prefetch(2, cards[0])  # every search needs batch 2 (a fit point, or the start); simulated beside batch 1
    warnings: list[str] = []
    return cards, built, sim, _smallest_batch(sim, cards[0], warnings), warnings


def _smallest_batch(sim: Simulator, card: GPU, warnings: list[str]) -> int:
    """1, or 2 when batch norm refuses a batch of one (the same on every card)."""
    try:
        sim.report(1, card)
        return 1
    except BatchTooSmallError as exc:
        warnings.append(f"batch 1 cannot train: {exc}")
        return 2


def _memory(r: MemoryReport) -> MemoryAtBatch:
    return MemoryAtBatch(
        batch_size=r.batch_size, allocated_peak_bytes=r.allocated_peak_bytes, reserved_peak_bytes=r.reserved_peak_bytes,
        device_peak_bytes=r.device_peak_bytes, fits=r.fits, peak_phase=r.peak_phase, peak_module=r.peak_module,
    )


def estimate(request: EstimateRequest, *, built: BuiltModel | None = None, progress: Progress | None = None,
             align: bool | None = None, confirm: bool | None = None,
             reserve_bytes: int | None = None) -> EstimateResponse:
    """Answer ``request`` (API.md): per card the max and recommended batch and the memory.

    The max comes from replays of the affine trace, confirmed (``confirm``)
    by full simulations at the max and max + 1; when the step is not affine
    in the batch, or a confirmation disagrees, from full simulations alone.
    ``reserve_bytes`` stays free on every card besides the CUDA context.
    The keyword arguments override the request's ``planner`` section.
    """
    t0 = time.perf_counter()
    request = _override(request, align, confirm, reserve_bytes)
    cards, built, sim, start, warnings = _simulator(request, built, progress)
    recipe = sim.recipe
    response = _answer(sim, request, cards, start, built.name, built.parameter_count, built.input,
                       list(built.assumptions), warnings, t0)
    if request.planner.max_seq_len:
        if "seq_len" not in built.input:
            raise SpecError("planner.max_seq_len", True, "a text model (one with input.seq_len)")
        longest = SeqLenSearch(request, recipe, request.batch_size or start)
        for card, result in zip(cards, response.results):
            result.max_seq_len = longest.max_seq_len(card)
        response.provenance.simulations += len(longest.traces)
        response.provenance.seconds = round(time.perf_counter() - t0, 3)
    return response


class SeqLenSearch:
    """The largest seq_len that fits at one batch, by bisection on full simulations (memory is not
    affine in the sequence length: attention scores grow with its square on the math backend)."""

    def __init__(self, request: EstimateRequest, recipe: Recipe, batch: int) -> None:
        self.request, self.recipe, self.batch = request, recipe, batch
        self.limit = _seq_limit(request)
        self.traces: dict[tuple, object] = {}

    def fits(self, seq: int, card: GPU) -> bool:
        from estimator.report import report_from_trace
        from estimator.trace import record_training

        key = (seq, card.capability, card.cublas_workspace_bytes)
        if key not in self.traces:
            req = self.request.model_copy(update={"input": self.request.input.model_copy(update={"seq_len": seq})})
            b = build(req)
            self.traces[key] = record_training(b.factory, b.batch_factory, b.loss_fn, self.batch, self.recipe, card,
                                               worst_case=b.worst_case)
        trace = self.traces[key]
        return report_from_trace(trace, self.batch, card, reserve_bytes=self.request.planner.reserve_bytes).fits

    def max_seq_len(self, card: GPU) -> int | None:
        if self.fits(self.limit, card):
            return self.limit
        lo, hi = 0, self.limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, card):
                lo = mid
            else:
                hi = mid
        return lo or None


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
        steps=steps, first_steps=first, assumptions=list(built.assumptions) + warnings,
        versions={"batchfit": __version__, "torch": torch.__version__.split("+")[0], "catalog": CATALOG_VERSION},
        capability_thresholds=list(sim.trace(start, card).capability_thresholds),
    )


def estimate_from_profile(profile: PortableProfile, gpus: list | None = None, batch_size: int | None = None,
                          planner: dict | None = None) -> EstimateResponse:
    """Answer from a profile alone: the same numbers as ``estimate(..., confirm=False)`` on the spec."""
    t0 = time.perf_counter()
    data = {**profile.request, "gpus": gpus, "batch_size": batch_size}
    data["planner"] = {**data.get("planner", {}), **(planner or {}), "confirm": False}
    request = parse_request(data)
    cards = cards_of(request)
    source = ProfileReplayer(profile, request.planner.reserve_bytes)
    return _answer(source, request, cards, profile.start, profile.model, profile.parameter_count,
                   profile.request.get("input", {}), list(profile.assumptions), [], t0)


def _override(request: EstimateRequest, align, confirm, reserve_bytes) -> EstimateRequest:
    changes = {k: v for k, v in (("align", align), ("confirm", confirm), ("reserve_bytes", reserve_bytes))
               if v is not None}
    if not changes:
        return request
    return request.model_copy(update={"planner": request.planner.model_copy(update=changes)})


def _answer(source: Source, request: EstimateRequest, cards: list[GPU], start: int, name: str,
            parameter_count: int, resolved_input: dict, assumptions: list[str], warnings: list[str],
            t0: float) -> EstimateResponse:
    plan = request.planner
    if request.batch_size is not None and request.batch_size < start:
        raise SpecError("batch_size", request.batch_size, f"at least {start}: {warnings[-1]}")
    results: list[GPUResult] = []
    shown: MemoryReport | None = None
    answers = _max_batches(source, cards, start, confirm_mode(plan.confirm), warnings)
    gap = 2  # the headroom searches', as in _replay_searches
    for card, (best, how) in zip(cards, answers):
        at = request.batch_size or best or start
        report = source.report_fast(at, card)
        if request.batch_size is not None and not report.fits:
            warnings.append(f"batch_size {request.batch_size} does not fit on {card.name}")
        if best is None:
            warnings.append(f"{name} does not fit on {card.name} even at batch {start}")
        for line in report.assumptions:
            if line not in assumptions:
                assumptions.append(line)
        rec, shrunk, gap = _recommend(source, card, start, best, plan, gap)
        if best is not None and rec is None:
            warnings.append(f"{card.name}: batch {start} fits but not within {1 - plan.headroom:.1%} of the "
                            "usable memory (planner.headroom); no batch is recommended")
        result = GPUResult(gpu=card.name, capacity_bytes=card.memory_bytes, min_batch_size=start,
                           max_batch_size=best, recommended_batch_size=rec, search=how, memory=_memory(report),
                           max_memory=None if best is None else _memory(source.report_fast(best, card)),
                           recommended_memory=None if rec is None else _memory(source.report_fast(rec, shrunk)))
        _advise(result, source, card, start, request, resolved_input)
        results.append(result)
        shown = shown or report
    assumptions.append(f"safety margin: {plan.reserve_bytes // 2**20} MiB kept free on every card besides the "
                       "CUDA context (context sizes vary by driver and CUDA version by about that much)")
    if request.training.zero_grad_at == "step-start":
        assumptions.append("zero_grad before the forward (HF Trainer, timm): the previous step's gradients are "
                           "freed first; a loop that zeroes them after the forward, as Lightning's does, "
                           "needs their bytes more at the forward's end (training.zero_grad_at: 'after-forward')")
    assumptions.append(f"headroom: recommended_batch_size fits with its device peak (reserved + CUDA context) "
                       f"within {1 - plan.headroom:.1%} of the usable memory (capacity - CUDA context - reserve), "
                       "since real peaks ran up to 11% above predictions in published runs; recommended_memory "
                       "is that step with the allocator held there (torch.cuda.set_per_process_memory_fraction "
                       "does so on a card; a free allocator caches more); max_batch_size has no headroom")
    if plan.align:
        assumptions.append("recommended_batch_size: rounded down to a multiple of 8 (tensor cores) "
                           "when that gives up less than 10%")
    if any(r.step_seconds is not None for r in results):
        assumptions.append(f"step time: the step's FLOPs at {plan.efficiency:.0%} of the card's peak "
                           "(bf16 tensor cores for amp/bf16, fp32 otherwise)")
    # The line through the allocated peaks at start + 1 and far from it (the
    # first card's max): peaks a few batches apart move in allocator blocks.
    lo = start + 1
    hi = max(results[0].max_batch_size or 0, lo + CHECK_OFFSET)
    a, b = source.report_fast(lo, cards[0]), source.report_fast(hi, cards[0])
    per_sample = (b.allocated_peak_bytes - a.allocated_peak_bytes) // (hi - lo)
    for item in shown.unsupported:
        warnings.append(f"not modelled: {item}")
    breakdown = BreakdownOut(**vars(shown.breakdown), batch_size=shown.batch_size)
    return EstimateResponse(
        results=results, breakdown=breakdown, per_sample_bytes=per_sample,
        fixed_bytes=a.allocated_peak_bytes - per_sample * lo, parameter_count=parameter_count,
        flops_per_sample=source.flops(start + 2, cards[0], start) - source.flops(start + 1, cards[0], start),
        assumptions=assumptions, warnings=warnings,
        provenance=Provenance(batchfit=__version__, torch=torch.__version__.split("+")[0], catalog=CATALOG_VERSION,
                              seconds=round(time.perf_counter() - t0, 3), simulations=source.simulations),
    )


def _headroom_card(card: GPU, plan) -> GPU:
    """``card`` as the recommendation sees it: an allocator held to ``headroom_capacity``."""
    capacity = headroom_capacity(card.usable_bytes(plan.reserve_bytes), card.context_bytes, plan.headroom)
    return dataclasses.replace(card, memory_bytes=capacity + card.context_bytes + plan.reserve_bytes)


def _recommend(source: Source, card: GPU, start: int, best: int | None, plan,
               gap: int = 2) -> tuple[int | None, GPU, int]:
    """(The largest batch, aligned, that fits with the allocator held to (1 - headroom) of the usable memory
    less the CUDA context; the card as that replay sees it; how far below its live-bytes bound the answer
    lay, where the next card's search starts). Monotone like the max: the same searches."""
    shrunk = _headroom_card(card, plan)
    if best is None:
        return None, shrunk, gap

    def fits(b: int) -> bool:
        return source.report_fast(b, shrunk).fits

    if not fits(start):
        return None, shrunk, gap
    profile = source.known_profile(card)
    if profile is not None and profile.min_batch <= start + 1:  # replays from the live-bytes bound, as the max
        room, gap = _replay_search(source, profile, shrunk, start, gap)
        room = min(room, best)
    else:
        guess = start + int((best - start) * (1 - plan.headroom))
        room = best if fits(best) else max_batch_between(fits, start, best, guess)
    return aligned_within(fits, room, plan.align), shrunk, gap


def confirm_mode(confirm: str | bool) -> str:
    """``planner.confirm`` as one of 'top', 'every-card', 'none' (true and false are the older spellings)."""
    if confirm is True:
        return "every-card"
    if confirm is False:
        return "none"
    return confirm


def _max_batches(sim: Source, cards: list[GPU], start: int, confirm: str,
                 warnings: list[str]) -> list[tuple[int | None, str]]:
    """(max batch, how it was found) per card; cards whose steps share a trace are searched together."""
    answers: list[tuple[int | None, str] | None] = [None] * len(cards)
    groups: dict[object, list[int]] = {}
    for i, card in enumerate(cards):
        if not sim.report(start, card).fits:
            answers[i] = (None, "full")
        else:
            groups.setdefault(sim.signature(card), []).append(i)
    for members in groups.values():
        found = _search_group(sim, [cards[i] for i in members], start, confirm, warnings)
        for i, answer in zip(members, found):
            answers[i] = answer
    return answers


def _search_group(sim: Source, cards: list[GPU], start: int, confirm: str,
                  warnings: list[str]) -> list[tuple[int | None, str]]:
    """Replays of one affine trace for every card of a group, confirmed as ``confirm`` says.

    'top': one full simulation just past the group's largest max must record
    exactly the step the affine trace synthesizes there; the trace is then
    exact at four batches spanning every answer of the group (the two it
    was fitted through, the top, and the smaller cards' answers lie between).
    """
    first = cards[0]
    if confirm != "top" or not sim.can_confirm:
        profile = sim.profile(start, first)
        if profile is None:
            return [_full_search(sim, card, start, warnings) for card in cards]
        found = [(best, "affine") for best in _replay_searches(sim, profile, cards, start)]
        if confirm == "every-card" and sim.can_confirm:
            found = [_confirm_card(sim, card, best, start, warnings) for card, (best, _) in zip(cards, found)]
        return found
    checked: list[int] = []
    for profile in sim.candidates(start, first):
        bests = _replay_searches(sim, profile, cards, start)
        top = min(max(bests) + 1, MAX_BATCH)
        if sim.check(profile, top, first):
            return [(best, f"affine, checked at batch {top}") for best in bests]
        checked.append(top)
    names = ", ".join(c.name for c in cards)
    if checked:
        warnings.append(f"{names}: a full simulation at batch {checked[-1]} differs from the affine trace "
                        "(the step's ops or sizes change with the batch); searched with full simulations")
    else:
        warnings.append(f"{names}: the step's ops or sizes change with the batch; searched with full simulations")
    return [_full_search(sim, card, start, warnings) for card in cards]


def _replay_searches(sim: Source, profile: AffineTrace, cards: list[GPU], start: int) -> list[int]:
    bests, gap = [], 2
    for card in cards:
        best, gap = _replay_search(sim, profile, card, start, gap)
        bests.append(best)
    return bests


def _replay_search(sim: Source, profile: AffineTrace, card: GPU, start: int, gap: int = 2) -> tuple[int, int]:
    """(max batch on ``card`` by replays of ``profile``, how far below the bound it lies); the step fits
    at ``start``.

    The requested bytes live at once bound the answer from above (the
    allocator's blocks are never smaller than requests), and closely: the
    allocator frees its cache and retries before it fails, so the answer is
    a few batches below the bound, about as far as on the group's previous
    card (``gap``). Probes gallop out from there.
    """
    capacity, workspace = card.usable_bytes(sim.reserve_bytes), card.cublas_workspace_bytes
    upper = max(profile.live_bound(capacity, workspace, MAX_BATCH), start)
    # upper + 1 cannot fit (or is past MAX_BATCH)
    best = max_batch_between(lambda b: sim.replay(profile, b, card).fits, start, upper + 1, upper - gap)
    return best, upper - best


def _full_search(sim: Source, card: GPU, start: int, warnings: list[str]) -> tuple[int | None, str]:
    def full(b: int) -> tuple[bool, int]:
        r = sim.report(b, card)
        return r.fits, r.allocated_peak_bytes

    return max_batch(full, card.usable_bytes(sim.reserve_bytes), start=start), "full"


def _confirm_card(sim: Source, card: GPU, best: int, start: int, warnings: list[str]) -> tuple[int | None, str]:
    """Full simulations at ``best`` and ``best + 1`` on the card; a full search when they disagree."""
    if sim.report(best, card).fits and (best == MAX_BATCH or not sim.report(best + 1, card).fits):
        return best, "affine, confirmed"
    warnings.append(f"{card.name}: full simulations disagree with the affine trace at batch {best}; searched again")
    return _full_search(sim, card, start, warnings)


def _advise(result: GPUResult, sim: Source, card: GPU, start: int, request: EstimateRequest,
            resolved_input: dict) -> None:
    """Curve, step and epoch time, accumulation and learning rate for one card's answer."""
    plan, best = request.planner, result.max_batch_size
    if best is None:
        return
    lowp = request.training.precision != "fp32"
    peak = card.peak_tflops_bf16 if lowp else card.peak_tflops_fp32
    ranks = plan.data_parallel_ranks

    def timing(b: int) -> tuple[float | None, float | None]:
        step = step_seconds(sim.flops(b, card, start), peak, plan.efficiency)
        if step is None or plan.dataset_size is None:
            return step, None
        return step, -(-plan.dataset_size // (b * ranks)) * step

    for b in curve_batches(start, best, plan.curve_points) if plan.curve_points else []:
        device = sim.report_fast(b, card).device_peak_bytes
        step, epoch = timing(b)
        meets = None if epoch is None or plan.max_epoch_seconds is None else epoch <= plan.max_epoch_seconds
        result.curve.append(CurvePoint(batch_size=b, device_peak_bytes=device, step_seconds=step, epoch_seconds=epoch,
                                       meets_epoch_limit=meets))
    if resolved_input.get("seq_len") is not None:  # a profile's input has every field, null ones too
        result.max_tokens_per_batch = best * resolved_input["seq_len"]
    rec = result.recommended_batch_size
    if rec is None:
        return  # step time, accumulation and learning rate are for the recommended batch
    result.step_seconds, result.epoch_seconds = timing(rec)
    if plan.max_epoch_seconds is not None and result.epoch_seconds is not None:
        result.meets_epoch_limit = result.epoch_seconds <= plan.max_epoch_seconds
    if plan.target_global_batch is not None:
        a = accumulation_plan(plan.target_global_batch, rec, ranks)
        result.accumulation = AccumulationOut(micro_batch=a.micro_batch, steps=a.steps, ranks=a.ranks,
                                              global_batch=a.global_batch)
    if plan.base_lr is not None and plan.base_batch is not None:
        global_batch = result.accumulation.global_batch if result.accumulation else rec * ranks
        lr = lr_advice(request.training.optimizer.name, plan.base_lr, plan.base_batch, global_batch)
        result.learning_rate = LearningRateOut(rule=lr.rule, lr=lr.lr, warmup=lr.warmup, why=lr.why)
