"""One request end to end: build, simulate, replay per card, search, answer.

>>> response = estimate(parse_request(request_json))                      # doctest: +SKIP
>>> response.results[0].max_batch_size

``progress(done, note)`` is called after each full simulation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from estimator import __version__
from estimator.errors import BatchTooSmallError, SpecError
from estimator.gpus import CATALOG, CATALOG_VERSION, GPU, MIB, custom_gpu, get_gpu
from estimator.models import BuiltModel, build
from estimator.planner import max_batch, recommended
from estimator.recipe import Recipe
from estimator.report import MemoryReport, report_from_trace
from estimator.spec import (
    BreakdownOut, CustomGPUSpec, EstimateRequest, EstimateResponse, GPUResult, MemoryAtBatch, Provenance,
)
from estimator.trace import Trace, record_training

Progress = Callable[[int, str], None]


def recipe_of(request: EstimateRequest) -> Recipe:
    t = request.training
    return Recipe(
        precision=t.precision, optimizer=t.optimizer.name, optimizer_kwargs=t.optimizer.kwargs(),
        gradient_checkpointing=t.gradient_checkpointing, grad_accumulation_steps=t.grad_accumulation_steps,
        zero_grad_set_to_none=t.zero_grad_set_to_none,
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


class Simulator:
    """Full simulations of one model and recipe, shared between cards that simulate alike.

    Two cards give the same trace when they share the compute capability
    (attention backend) and the cuBLAS workspace size.
    """

    def __init__(self, built: BuiltModel, recipe: Recipe, progress: Progress | None = None) -> None:
        self.built = built
        self.recipe = recipe
        self.progress = progress
        self.traces: dict[tuple, Trace] = {}

    def trace(self, batch: int, gpu: GPU) -> Trace:
        key = (batch, gpu.capability, gpu.cublas_workspace_bytes)
        if key not in self.traces:
            b = self.built
            self.traces[key] = record_training(b.factory, b.batch_factory, b.loss_fn, batch, self.recipe, gpu,
                                               worst_case=b.worst_case)
            if self.progress is not None:
                self.progress(len(self.traces), f"batch {batch} on sm{gpu.capability[0]}{gpu.capability[1]}")
        return self.traces[key]

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        return report_from_trace(self.trace(batch, gpu), batch, gpu)


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
             align: bool = True) -> EstimateResponse:
    """Answer ``request`` (API.md): per card the max and recommended batch and the memory."""
    t0 = time.perf_counter()
    cards = cards_of(request)  # cheap checks first: a bad card name fails before any build
    recipe = recipe_of(request)
    built = built or build(request)
    sim = Simulator(built, recipe, progress)
    assumptions = list(built.assumptions)
    warnings: list[str] = []
    results: list[GPUResult] = []
    shown: MemoryReport | None = None
    start = _smallest_batch(sim, cards[0], warnings)
    if request.batch_size is not None and request.batch_size < start:
        raise SpecError("batch_size", request.batch_size, f"at least {start}: {warnings[-1]}")
    for card in cards:
        one = sim.report(start, card)
        best = None
        if one.fits:
            def probe(b: int, card: GPU = card) -> tuple[bool, int]:
                r = sim.report(b, card)
                return r.fits, r.allocated_peak_bytes
            best = max_batch(probe, one.capacity_bytes or 0, start=start)
        at = request.batch_size or best or start
        report = sim.report(at, card)
        if request.batch_size is not None and not report.fits:
            warnings.append(f"batch_size {request.batch_size} does not fit on {card.name}")
        if best is None:
            warnings.append(f"{built.name} does not fit on {card.name} even at batch {start}")
        for line in report.assumptions:
            if line not in assumptions:
                assumptions.append(line)
        results.append(GPUResult(gpu=card.name, capacity_bytes=card.memory_bytes, min_batch_size=start, max_batch_size=best,
                                 recommended_batch_size=recommended(best, align), memory=_memory(report)))
        shown = shown or report
    if align:
        assumptions.append("recommended_batch_size: the max rounded down to a multiple of 8 (tensor cores) "
                           "when that gives up less than 10%")
    one, two = sim.report(start, cards[0]), sim.report(start + 1, cards[0])
    per_sample = two.allocated_peak_bytes - one.allocated_peak_bytes
    for item in shown.unsupported:
        warnings.append(f"not modelled: {item}")
    breakdown = BreakdownOut(**{k: getattr(shown.breakdown, k) for k in (
        "parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "buffers", "workspace")},
        batch_size=shown.batch_size)
    return EstimateResponse(
        results=results, breakdown=breakdown, per_sample_bytes=per_sample,
        fixed_bytes=one.allocated_peak_bytes - per_sample, parameter_count=built.parameter_count,
        assumptions=assumptions, warnings=warnings,
        provenance=Provenance(batchfit=__version__, torch=torch.__version__.split("+")[0], catalog=CATALOG_VERSION,
                              seconds=round(time.perf_counter() - t0, 3), simulations=len(sim.traces)),
    )
