"""From an event trace to a memory report for one card.

>>> report = estimate_memory(factory, batches, loss_fn, 32, gpu="A100-80GB")   # doctest: +SKIP
>>> report.device_peak_bytes - report.reserved_peak_bytes == report.context_bytes
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from estimator.allocator import CONV_WORKSPACE, AllocatorConfig, ReplayResult, replay_sized
from estimator.gpus import GPU, get_gpu
from estimator.recipe import Recipe
from estimator.trace import BatchFactory, LossFn, ModelFactory, Trace, record_training


@dataclass(frozen=True)
class Breakdown:
    """Bytes live at the allocated peak, by category (allocator block sizes); ``workspace`` holds the
    cuBLAS handles' and any cuDNN convolution's."""

    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporaries: int = 0
    inputs: int = 0
    workspace: int = 0

    @classmethod
    def from_categories(cls, by_cat: dict[str, int]) -> "Breakdown":
        return cls(
            parameters=by_cat.get("parameter", 0),
            buffers=by_cat.get("buffer", 0),
            gradients=by_cat.get("gradient", 0),
            optimizer_state=by_cat.get("optimizer_state", 0),
            activations=by_cat.get("activation", 0),
            temporaries=by_cat.get("temporary", 0),
            inputs=by_cat.get("input", 0),
            workspace=by_cat.get("workspace", 0) + by_cat.get(CONV_WORKSPACE, 0),
        )

    def total(self) -> int:
        return sum(vars(self).values())


@dataclass
class MemoryReport:
    """What one training step needs on one card.

    ``allocated_peak_bytes``: ``torch.cuda.max_memory_allocated()``;
    ``reserved_peak_bytes``: ``torch.cuda.max_memory_reserved()``;
    ``device_peak_bytes``: what nvidia-smi shows, reserved + CUDA context.
    For the CPU target (``gpu=None``) all three are the peak of live bytes.
    """

    gpu: str
    batch_size: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    device_peak_bytes: int
    context_bytes: int
    capacity_bytes: int | None
    fits: bool
    breakdown: Breakdown
    peak_phase: str
    peak_module: str
    peak_iteration: int
    unsupported: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    trace: Trace | None = field(default=None, repr=False)


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
        for i, (is_alloc, k) in enumerate(trace.events[: idx + 1]):
            if is_alloc:
                live[k] = trace.allocations[k].nbytes
            else:
                live.pop(k, None)
        for k, n in live.items():
            cat = trace.allocations[k].category
            by_cat[cat] = by_cat.get(cat, 0) + n
        at = trace.allocations[trace.events[idx][1]] if trace.events else None
        return MemoryReport(
            "cpu", batch_size, peak, peak, peak, 0, None, True, Breakdown.from_categories(by_cat),
            at.phase if at else "", at.module if at else "", at.iteration if at else 0,
            list(trace.unsupported), list(trace.assumptions), trace,
        )

    allocator = allocator or AllocatorConfig()
    sized = trace.events, trace.sizes(gpu.cublas_workspace_bytes), trace.categories()
    capped = replay_sized(*sized, replace(allocator, capacity=gpu.usable_bytes(reserve_bytes)), timelines=False)
    unlimited = capped if capped.fits else replay_sized(*sized, replace(allocator, capacity=None), timelines=False)
    return report_from_replays(capped, unlimited, trace.events, batch_size, gpu, trace.where, trace.unsupported,
                               trace.assumptions, reserve_bytes, trace)


def report_from_replays(
    capped: ReplayResult, unlimited: ReplayResult, events: list[tuple[bool, int]], batch_size: int, gpu: GPU,
    where: Callable[[int], tuple[str, str, int]], unsupported: list[str], assumptions: list[str],
    reserve_bytes: int = 0, trace: Trace | None = None,
) -> MemoryReport:
    """The report from a step's replay on the card (``capped``) and without a capacity (``unlimited``).

    On the card, a step that fits runs under memory pressure: the allocator
    frees cached blocks and retries instead of growing, so the card's replay
    is what torch.cuda.max_memory_reserved() would report. A step that does
    not fit is reported with what it would need.
    """
    shown = capped if capped.fits else unlimited
    phase, module, iteration = where(events[shown.peak_event][1]) if events else ("", "", 0)
    notes = list(assumptions) + [
        f"CUDA context on {gpu.name}: {gpu.context_bytes // 2**20} MiB (catalog default; driver dependent)",
        f"cuBLAS workspace {gpu.cublas_workspace_bytes} B per handle, allocated through the caching allocator",
    ]
    return MemoryReport(
        gpu.name, batch_size,
        shown.allocated_peak, shown.reserved_peak, shown.reserved_peak + gpu.context_bytes,
        gpu.context_bytes, gpu.usable_bytes(reserve_bytes), capped.fits,
        Breakdown.from_categories(shown.breakdown_at_peak), phase, module, iteration, list(unsupported), notes, trace,
    )


def estimate_memory(
    model_factory: ModelFactory,
    batch_factory: BatchFactory,
    loss_fn: LossFn,
    batch_size: int,
    *,
    recipe: Recipe | None = None,
    gpu: str | GPU | None = "A100-80GB",
    allocator: AllocatorConfig | None = None,
    worst_case: bool = False,
) -> MemoryReport:
    """Simulate training steps of the model on ``gpu`` and report peak memory.

    ``model_factory()`` is called under ``torch.device("meta")``;
    ``batch_factory(batch_size, device)`` returns ``(inputs, targets)`` where
    ``inputs`` is a tensor, a tuple (positional) or a dict (keyword arguments);
    ``loss_fn(outputs, targets)`` returns the scalar loss. ``gpu=None``
    targets the CPU.
    """
    card = get_gpu(gpu) if isinstance(gpu, str) else gpu
    trace = record_training(model_factory, batch_factory, loss_fn, batch_size, recipe or Recipe(), card,
                            worst_case=worst_case)
    return report_from_trace(trace, batch_size, card, allocator)
