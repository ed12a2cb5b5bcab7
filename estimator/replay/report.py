"""From an event trace to a memory report for one card.

>>> report = report_from_trace(trace, 32, get_gpu("A100-80GB"))            # doctest: +SKIP
>>> report.device_peak_bytes - report.reserved_peak_bytes == report.context_bytes
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated

from pydantic import Field

from estimator.gpus import GPU
from estimator.replay.allocator import AllocatorConfig, ReplayResult, replay_sized
from estimator.trace import Category, Step, Trace


@dataclass(frozen=True)
class Breakdown:
    """Bytes live at the allocated peak of the step at ``batch_size``, by category (allocator block
    sizes); ``workspace`` holds the cuBLAS handles' and any cuDNN convolution's."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporaries: int = 0
    inputs: int = 0
    buffers: int = 0
    workspace: int = 0
    communication: Annotated[int, Field(description="distributed training: DDP's gradient buckets, FSDP's "
                                        "all-gather and reduce-scatter buffers")] = 0
    paged_optimizer_state: Annotated[int, Field(description="bitsandbytes' paged optimizers: state in CUDA unified "
                                                "memory, outside the caching allocator (in device_peak_bytes, not "
                                                "in reserved_peak_bytes)")] = 0
    batch_size: Annotated[int, Field(description="the batch this breakdown is for")] = 0

    @classmethod
    def from_categories(cls, by_cat: dict[str, int], batch_size: int = 0) -> Breakdown:
        return cls(
            parameters=by_cat.get(Category.PARAMETER, 0),
            gradients=by_cat.get(Category.GRADIENT, 0),
            optimizer_state=by_cat.get(Category.OPTIMIZER_STATE, 0),
            activations=by_cat.get(Category.ACTIVATION, 0),
            temporaries=by_cat.get(Category.TEMPORARY, 0),
            inputs=by_cat.get(Category.INPUT, 0),
            buffers=by_cat.get(Category.BUFFER, 0),
            workspace=by_cat.get(Category.WORKSPACE, 0) + by_cat.get(Category.CONV_WORKSPACE, 0),
            communication=by_cat.get(Category.COMMUNICATION, 0),
            paged_optimizer_state=by_cat.get(Category.PAGED_OPTIMIZER_STATE, 0),
            batch_size=batch_size,
        )

    def total(self) -> int:
        """Every byte of the breakdown."""
        return (self.parameters + self.gradients + self.optimizer_state + self.activations + self.temporaries
                + self.inputs + self.buffers + self.workspace + self.communication + self.paged_optimizer_state)


@dataclass(frozen=True, kw_only=True)
class MemoryAtBatch:
    """The memory of one training step at one batch on one card."""

    batch_size: int
    allocated_peak_bytes: Annotated[int, Field(description="torch.cuda.max_memory_allocated()")]
    reserved_peak_bytes: Annotated[int, Field(description="torch.cuda.max_memory_reserved()")]
    device_peak_bytes: Annotated[int, Field(description="nvidia-smi: reserved + CUDA context (+ paged optimizer "
                                            "state, resident)")]
    fits: bool
    peak_phase: Annotated[str, Field(description="phase of the step where the allocated peak falls")] = ""
    peak_module: Annotated[str, Field(description="module running at the allocated peak")] = ""


@dataclass(frozen=True, kw_only=True)
class MemoryReport(MemoryAtBatch):
    """What one training step needs on one card: the memory at the batch, and what it is made of.

    ``allocated_peak_bytes``: ``torch.cuda.max_memory_allocated()``;
    ``reserved_peak_bytes``: ``torch.cuda.max_memory_reserved()``;
    ``device_peak_bytes``: what nvidia-smi shows, reserved + CUDA context.
    For the CPU target (``gpu=None``) all three are the peak of live bytes.
    """

    gpu: str
    context_bytes: int
    capacity_bytes: int | None
    breakdown: Breakdown
    peak_iteration: int
    unsupported: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    trace: Trace | None = field(default=None, repr=False, compare=False)


def report_from_trace(
    trace: Trace, batch_size: int, gpu: GPU | None, allocator: AllocatorConfig | None = None,
    reserve_bytes: int = 0,
) -> MemoryReport:
    """Replay ``trace`` for ``gpu``: peaks as on the card when the step fits, else what it would need (no cap).

    ``reserve_bytes`` is kept free on top of the CUDA context (the planner's
    safety margin). The trace may come from a card with another cuBLAS
    workspace size: ``gpu``'s own is used.
    """
    if gpu is None:
        peak, idx = trace.live_peak()
        by_cat: dict[str, int] = {}
        live: dict[int, int] = {}
        for is_alloc, k in trace.events[: idx + 1]:
            if is_alloc:
                live[k] = trace.allocations[k].nbytes
            else:
                live.pop(k, None)
        for k, n in live.items():
            cat = trace.allocations[k].category
            by_cat[cat] = by_cat.get(cat, 0) + n
        at = trace.allocations[trace.events[idx][1]] if trace.events else None
        return MemoryReport(
            gpu="cpu", batch_size=batch_size, allocated_peak_bytes=peak, reserved_peak_bytes=peak,
            device_peak_bytes=peak, context_bytes=0, capacity_bytes=None, fits=True,
            breakdown=Breakdown.from_categories(by_cat, batch_size), peak_phase=at.phase if at else "",
            peak_module=at.module if at else "", peak_iteration=at.iteration if at else 0,
            unsupported=list(trace.unsupported), assumptions=list(trace.assumptions), trace=trace,
        )

    return report_from_step(trace, batch_size, gpu, allocator, reserve_bytes)


def report_from_step(step: Step, batch_size: int, gpu: GPU, allocator: AllocatorConfig | None = None,
                     reserve_bytes: int = 0) -> MemoryReport:
    """``report_from_trace`` on a card, of any step: a trace, or an affine trace at ``batch_size`` (whose notes
    are its model's, so none here)."""
    allocator = allocator or AllocatorConfig()
    events, sizes, categories, streams = step.sized(batch_size, gpu.cublas_workspace_bytes)
    capped = replay_sized(events, sizes, categories, replace(allocator, capacity=gpu.usable_bytes(reserve_bytes)),
                          timelines=False, streams=streams)
    unlimited = capped if capped.fits else replay_sized(events, sizes, categories, replace(allocator, capacity=None),
                                                        timelines=False, streams=streams)
    trace = step if isinstance(step, Trace) else None
    return report_from_replays(capped, unlimited, batch_size, gpu, where=peak_of(step, capped, unlimited),
                               unsupported=trace.unsupported if trace else (),
                               assumptions=trace.assumptions if trace else (), reserve_bytes=reserve_bytes,
                               trace=trace)


def peak_of(step: Step, capped: ReplayResult, unlimited: ReplayResult) -> tuple[str, str, int]:
    """(phase, module, iteration) of the allocation at the peak a report shows: the card's replay when the step
    fits, else the one without a capacity (``step.where`` of ``peak_allocation``)."""
    k = peak_allocation(step.events, capped, unlimited)
    return ("", "", 0) if k is None else step.where(k)


def peak_allocation(events: Sequence[tuple[bool, int]], capped: ReplayResult, unlimited: ReplayResult) -> int | None:
    """The allocation at the peak a report shows; None for a step without events."""
    shown = capped if capped.fits else unlimited
    return events[shown.peak_event][1] if events else None


def report_from_replays(
    capped: ReplayResult, unlimited: ReplayResult, batch_size: int, gpu: GPU, *,
    where: tuple[str, str, int] = ("", "", 0), unsupported: Sequence[str] = (), assumptions: Sequence[str] = (),
    reserve_bytes: int = 0, trace: Trace | None = None,
) -> MemoryReport:
    """The report from a step's replay on the card (``capped``) and without a capacity (``unlimited``);
    ``where``: the peak's (phase, module, iteration), ``peak_of``.

    On the card, a step that fits runs under memory pressure: the allocator
    frees cached blocks and retries instead of growing, so the card's replay
    is what torch.cuda.max_memory_reserved() would report. A step that does
    not fit is reported with what it would need.
    """
    shown = capped if capped.fits else unlimited
    phase, module, iteration = where
    notes = list(assumptions) + [
        f"CUDA context on {gpu.name}: {gpu.context_bytes // 2**20} MiB (catalog default; driver dependent)",
        f"cuBLAS workspace {gpu.cublas_workspace_bytes} B per handle, allocated through the caching allocator",
    ]
    return MemoryReport(
        gpu=gpu.name, batch_size=batch_size, allocated_peak_bytes=shown.allocated_peak,
        reserved_peak_bytes=shown.reserved_peak, device_peak_bytes=max(shown.device_peak, shown.reserved_peak)
        + gpu.context_bytes,
        context_bytes=gpu.context_bytes, capacity_bytes=gpu.usable_bytes(reserve_bytes), fits=capped.fits,
        breakdown=Breakdown.from_categories(shown.breakdown_at_peak, batch_size), peak_phase=phase,
        peak_module=module, peak_iteration=iteration, unsupported=list(unsupported), assumptions=notes, trace=trace,
    )
