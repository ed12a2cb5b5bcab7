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
from estimator.allocator import AllocatorConfig, replay
from estimator.planner import DEFAULT_RESERVE_BYTES, MAX_BATCH, max_batch, recommended
from estimator.profile import AffineTrace, fit
from estimator.virtual_gpu.attention import backend_for
from estimator.recipe import Recipe
from estimator.report import MemoryReport, report_from_trace
from estimator.spec import (
    BreakdownOut, CustomGPUSpec, EstimateRequest, EstimateResponse, GPUResult, MemoryAtBatch, Provenance,
)
from estimator.trace import Trace, record_training

Progress = Callable[[int, str], None]
# The third trace that checks the affine fit: far enough from the first two
# that a size growing other than linearly shows.
CHECK_OFFSET = 7


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

    A trace depends on the card only through the attention backends its
    SDPA calls get and the cuBLAS workspace size, unless the step asked
    torch.cuda about the card (then it is the card's own).
    """

    def __init__(self, built: BuiltModel, recipe: Recipe, progress: Progress | None = None,
                 reserve_bytes: int = 0) -> None:
        self.built = built
        self.recipe = recipe
        self.progress = progress
        self.reserve_bytes = reserve_bytes
        self.traces: dict[tuple, Trace] = {}
        self.profiles: dict[tuple, AffineTrace | None] = {}
        self._probe: Trace | None = None  # any trace: what the step asks of a card

    def signature(self, gpu: GPU) -> tuple:
        probe = self._probe
        if probe is None:
            return ("card", gpu.name, gpu.capability, gpu.memory_bytes, gpu.cublas_workspace_bytes)
        if probe.card_queries:
            return ("card", gpu.name, gpu.capability, gpu.memory_bytes, gpu.cublas_workspace_bytes)
        backends = tuple(backend_for(c, gpu.capability) for c in probe.sdpa_calls)
        return ("shared", backends, gpu.cublas_workspace_bytes)

    def trace(self, batch: int, gpu: GPU) -> Trace:
        key = (batch, self.signature(gpu))
        if key not in self.traces:
            b = self.built
            trace = record_training(b.factory, b.batch_factory, b.loss_fn, batch, self.recipe, gpu,
                                    worst_case=b.worst_case)
            if self._probe is None:
                self._probe = trace
                key = (batch, self.signature(gpu))
            self.traces[key] = trace
            if self.progress is not None:
                self.progress(len(self.traces), f"batch {batch} on {gpu.name}")
        return self.traces[key]

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        return report_from_trace(self.trace(batch, gpu), batch, gpu, reserve_bytes=self.reserve_bytes)

    def profile(self, start: int, gpu: GPU) -> AffineTrace | None:
        """The affine trace through batches ``start + 1`` and ``start + 2``, checked at ``start + 1 + CHECK_OFFSET``.

        Not through ``start``: at batch 1 some ops take other paths (a
        (1, H, S, D) matmul folds into a view where a larger batch copies).
        """
        sig = self.signature(gpu)
        if sig not in self.profiles:
            b1, b2, b3 = start + 1, start + 2, start + 1 + CHECK_OFFSET
            self.profiles[sig] = fit([(b1, self.trace(b1, gpu)), (b2, self.trace(b2, gpu))],
                                     check=(b3, self.trace(b3, gpu)))
        return self.profiles[sig]

    def replay_fits(self, profile: AffineTrace, batch: int, gpu: GPU) -> tuple[bool, int]:
        """(fits, allocated peak) of the synthesized step at ``batch``: one allocator replay, no simulation."""
        capacity = max(gpu.memory_bytes - gpu.context_bytes - self.reserve_bytes, 0)
        r = replay(profile.events_at(batch, gpu.cublas_workspace_bytes), AllocatorConfig(capacity))
        return r.fits, r.allocated_peak


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
             align: bool = True, confirm: bool = True, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> EstimateResponse:
    """Answer ``request`` (API.md): per card the max and recommended batch and the memory.

    The max comes from replays of the affine trace, confirmed (``confirm``)
    by full simulations at the max and max + 1; when the step is not affine
    in the batch, or a confirmation disagrees, from full simulations alone.
    ``reserve_bytes`` stays free on every card besides the CUDA context.
    """
    t0 = time.perf_counter()
    cards = cards_of(request)  # cheap checks first: a bad card name fails before any build
    recipe = recipe_of(request)
    built = built or build(request)
    sim = Simulator(built, recipe, progress, reserve_bytes)
    assumptions = list(built.assumptions)
    warnings: list[str] = []
    results: list[GPUResult] = []
    shown: MemoryReport | None = None
    start = _smallest_batch(sim, cards[0], warnings)
    if request.batch_size is not None and request.batch_size < start:
        raise SpecError("batch_size", request.batch_size, f"at least {start}: {warnings[-1]}")
    for card in cards:
        best, how = _max_batch(sim, card, start, confirm, warnings)
        at = request.batch_size or best or start
        report = sim.report(at, card)
        if request.batch_size is not None and not report.fits:
            warnings.append(f"batch_size {request.batch_size} does not fit on {card.name}")
        if best is None:
            warnings.append(f"{built.name} does not fit on {card.name} even at batch {start}")
        for line in report.assumptions:
            if line not in assumptions:
                assumptions.append(line)
        results.append(GPUResult(gpu=card.name, capacity_bytes=card.memory_bytes, min_batch_size=start,
                                 max_batch_size=best, recommended_batch_size=recommended(best, align),
                                 search=how, memory=_memory(report)))
        shown = shown or report
    assumptions.append(f"safety margin: {reserve_bytes // 2**20} MiB kept free on every card besides the CUDA "
                       "context (context sizes vary by driver and CUDA version by about that much)")
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


def _max_batch(sim: Simulator, card: GPU, start: int, confirm: bool, warnings: list[str]) -> tuple[int | None, str]:
    capacity = max(card.memory_bytes - card.context_bytes - sim.reserve_bytes, 0)

    def full(b: int) -> tuple[bool, int]:
        r = sim.report(b, card)
        return r.fits, r.allocated_peak_bytes

    if not sim.report(start, card).fits:
        return None, "full"
    profile = sim.profile(start, card)
    if profile is None:
        warnings.append(f"{card.name}: the step's ops or sizes change with the batch; searched with full simulations")
        return max_batch(full, capacity, start=start), "full"
    best = max_batch(lambda b: full(b) if b < profile.min_batch else sim.replay_fits(profile, b, card),
                     capacity, start=start)
    if not confirm or best is None:
        return best, "affine"
    if full(best)[0] and (best == MAX_BATCH or not full(best + 1)[0]):
        return best, "affine, confirmed"
    warnings.append(f"{card.name}: full simulations disagree with the affine trace at batch {best}; searched again")
    return max_batch(full, capacity, start=start), "full"
