"""The answer to one job: per card the max and recommended batch, the memory, advice, and what was assumed.

>>> response = answer(Simulator(built, recipe), cards, PlanOptions())   # doctest: +SKIP
>>> response.results[0].max_batch_size

``answer`` finds the smallest batch that trains, then per card the max
(``strategy.max_batches``), the recommendation (``strategy.recommend``) and
the advice (``advice.advise``), and assembles the response. Three searches
need steps of other jobs, which the caller's ``source_for(change)`` makes
from the request with ``change`` applied (dotted request paths, as a
suggestion reports them): ``world_size`` None (``"auto"``, ``worlds.py``),
the fit suggestions for a card nothing fits (``worlds.py``) and
``max_seq_len`` (``seq_len.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from estimator import __version__, torch_version
from estimator.errors import BatchTooSmallError, SpecError
from estimator.gpus import CATALOG_VERSION, GPU, shortfall
from estimator.options import PlanOptions
from estimator.plan.advice import advise
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse, GPUResult, Provenance, WarningCode
from estimator.plan.schedule import batch_schedule
from estimator.plan.steps import CHECK_OFFSET, Steps, StepSource
from estimator.plan.strategy import Recommending, max_batches, recommend
from estimator.replay.report import MemoryReport

# request changes (dotted paths -> values) -> the steps of that job
SourceFor = Callable[[Mapping[str, Any]], StepSource]


def answer(source: StepSource, cards: list[GPU], options: PlanOptions, *, source_for: SourceFor | None = None,
           started: float | None = None) -> EstimateResponse:
    """The response to a job whose steps come from ``source``, on ``cards`` (docs/API.md). ``started``: when the
    request arrived (``time.perf_counter``), for the answer's seconds."""
    t0 = time.perf_counter() if started is None else started
    if options.world_size is None:
        from estimator.plan.worlds import answer_auto

        return answer_auto(_factory(source_for, "training.distributed.world_size 'auto'"), source, cards, options,
                           t0)
    steps = Steps(source, options.reserve_bytes)
    notes = Notes()
    start = smallest_batch(steps, cards[0], notes)
    response = answer_at(steps, cards, options, start, notes, t0)
    if options.strategy == "none" and options.suggestions and any(r.recommended_batch_size is None
                                                                  for r in response.results):
        from estimator.plan.suggest import Suggester, with_suggestions

        suggester = Suggester(_factory(source_for, "planner.suggestions"), options, start,
                              text_model="seq_len" in steps.model.input)
        response = with_suggestions(response, suggester, cards, notes, t0)
    if options.max_seq_len:
        from estimator.plan.seq_len import with_max_seq_len

        response = with_max_seq_len(response, _factory(source_for, "planner.max_seq_len"), steps, cards,
                                    options.batch_size or start, t0)
    return response


def _factory(source_for: SourceFor | None, field: str) -> SourceFor:
    if source_for is None:
        raise SpecError(field, True, "a job the planner can simulate (it searches other steps than the profile's)")
    return source_for


def smallest_batch(steps: Steps, card: GPU, notes: Notes) -> int:
    """1, or 2 when batch norm refuses a batch of one (the same on every card); a profile's own."""
    if steps.model.min_batch is not None:
        return steps.model.min_batch
    try:
        steps.report(1, card)
        return 1
    except BatchTooSmallError as exc:
        notes.add(WarningCode.BATCH_ONE_CANNOT_TRAIN, f"batch 1 cannot train: {exc}", batch=1)
        return 2


def answer_at(steps: Steps, cards: list[GPU], options: PlanOptions, start: int, notes: Notes,
              t0: float) -> EstimateResponse:
    """The response at one world size (``options.world_size``), the smallest batch being ``start``."""
    model, batch_size = steps.model, options.batch_size
    if batch_size is not None and batch_size < start:
        why = notes.find(WarningCode.BATCH_ONE_CANNOT_TRAIN)
        raise SpecError("batch_size", batch_size, f"at least {start}: {why.message if why else ''}")
    assumptions = list(model.assumptions)
    seq_len = model.input.get("seq_len")  # a profile's input has every field, null ones too
    world = options.world_size or 1
    ranks = world if options.strategy != "none" else options.advice.ranks  # the global batch's ranks
    wishes = dataclasses.replace(options.advice, ranks=ranks, seq_len=seq_len if isinstance(seq_len, int) else None)
    results: list[GPUResult] = []
    shown: MemoryReport | None = None
    gap = 2  # the headroom searches', as in the max's replay searches
    ahead = Recommending(options.headroom, options.align, options.advice.curve_points)
    found = max_batches(steps, cards, start, options.confirm, notes, ahead)
    for card, (best, how) in zip(cards, found, strict=True):
        report = steps.report(batch_size or best or start, card, exact=False)
        if batch_size is not None and not report.fits:
            notes.add(WarningCode.BATCH_SIZE_DOES_NOT_FIT, f"batch_size {batch_size} does not fit on {card.name}",
                      card=card.name, batch=batch_size)
        if best is None:
            need = steps.report(start, card, exact=False).reserved_peak_bytes
            notes.add(WarningCode.DOES_NOT_FIT, f"{model.name} does not fit on {card.name} even at batch {start}: "
                      f"{shortfall(need, card.usable_bytes(options.reserve_bytes), start, card.name)}",
                      card=card.name, batch=start)
        assumptions.extend(line for line in report.assumptions if line not in assumptions)
        rec, shrunk, gap = recommend(steps, card, start, best, options.headroom, align=options.align, gap=gap)
        if best is not None and rec is None:
            notes.add(WarningCode.NO_RECOMMENDATION, f"{card.name}: batch {start} fits but not within "
                      f"{1 - options.headroom:.1%} of the usable memory (planner.headroom); no batch is recommended",
                      card=card.name, batch=start)
        advice = advise(steps, card, start, best, rec, wishes)
        results.append(GPUResult(
            gpu=card.name, capacity_bytes=card.memory_bytes, min_batch_size=start, max_batch_size=best,
            recommended_batch_size=rec, search=how, memory=report,
            max_memory=None if best is None else steps.report(best, card, exact=False),
            recommended_memory=None if rec is None else steps.report(rec, shrunk, exact=False),
            batch_schedule=batch_schedule(steps, card, start, rec, wishes),
            world_size=world, global_batch_size=None if rec is None else rec * ranks * options.grad_accumulation_steps,
            **vars(advice)))
        shown = shown or report
    assert shown is not None  # a job names at least one card
    assumptions.extend(planner_assumptions(options, results))
    # The line through the allocated peaks at start + 1 and far from it (the
    # first card's max): peaks a few batches apart move in allocator blocks.
    lo = start + 1
    hi = max(results[0].max_batch_size or 0, lo + CHECK_OFFSET)
    a, b = steps.report(lo, cards[0], exact=False), steps.report(hi, cards[0], exact=False)
    per_sample = (b.allocated_peak_bytes - a.allocated_peak_bytes) // (hi - lo)
    for item in shown.unsupported:
        notes.add(WarningCode.NOT_MODELLED, f"not modelled: {item}")
    return EstimateResponse(
        results=results, breakdown=shown.breakdown, per_sample_bytes=per_sample,
        fixed_bytes=a.allocated_peak_bytes - per_sample * lo, parameter_count=model.parameter_count,
        flops_per_sample=steps.flops(start + 2, cards[0], start) - steps.flops(start + 1, cards[0], start),
        assumptions=assumptions, warnings=notes.warnings(), provenance=provenance(steps.simulations, t0),
    )


def provenance(simulations: int, t0: float) -> Provenance:
    return Provenance(batchfit=__version__, torch=torch_version(), catalog=CATALOG_VERSION,
                      seconds=round(time.perf_counter() - t0, 3), simulations=simulations)


def planner_assumptions(options: PlanOptions, results: list[GPUResult]) -> list[str]:
    lines = [f"safety margin: {options.reserve_bytes // 2**20} MiB kept free on every card besides the CUDA "
             "context (context sizes vary by driver and CUDA version by about that much)"]
    if options.zero_grad_at == "step-start":
        lines.append("zero_grad before the forward (HF Trainer, timm): the previous step's gradients are freed "
                     "first; a loop that zeroes them after the forward, as Lightning's does, needs their bytes "
                     "more at the forward's end (training.zero_grad_at: 'after-forward')")
    lines.append(f"headroom: recommended_batch_size fits with its device peak (reserved + CUDA context) within "
                 f"{1 - options.headroom:.1%} of the usable memory (capacity - CUDA context - reserve), since real "
                 "peaks ran up to 11% above predictions in published runs; recommended_memory is that step with "
                 "the allocator held there (torch.cuda.set_per_process_memory_fraction does so on a card; a free "
                 "allocator caches more); max_batch_size has no headroom")
    if options.align:
        lines.append("recommended_batch_size: rounded down to a multiple of 8 (tensor cores) when that gives up "
                     "less than 10%")
    if any(r.step_seconds is not None for r in results):
        advice = options.advice
        peak = f"{advice.compute} tensor-core peak" if advice.low_precision else "fp32 peak"
        lines.append(f"step time: the step's FLOPs at {advice.efficiency:.0%} of the card's {peak} "
                     f"({advice.compute_from})")
    return lines
