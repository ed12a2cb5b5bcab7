"""The memory timeline of one simulated step: what ``POST /timeline`` answers and ``batchfit estimate --plot``
draws.

>>> t = timeline_of(view)                                          # doctest: +SKIP
>>> t.allocated[t.points.index(t.peak_event)] == t.allocated_peak_bytes
True

At each sampled event, the live requested bytes per category (what the step asked for: cuDNN's workspaces
with cuBLAS's, as the breakdown counts them) and the replay's allocated and reserved bytes (what
``torch.cuda.memory_allocated()`` and ``memory_reserved()`` would read there). The events sampled are every
event up to ``MAX_POINTS``, else ``MAX_POINTS`` evenly spaced from the first to the last, with the events of
the allocated and the reserved peak always among them, so both peaks show exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from estimator.replay.view import StepView
from estimator.trace import Category, Step

# the categories, in stacking order bottom up; cuDNN's workspaces count with cuBLAS's, anything else (DDP's
# and FSDP's communication buffers, empty_cache calls, which hold nothing) with the temporaries
ORDER = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.ACTIVATION,
         Category.TEMPORARY, Category.INPUT, Category.WORKSPACE)
MAX_POINTS = 2000  # enough for a plot or a page as wide as a screen


@dataclass(frozen=True)
class PhaseSpan:
    """A phase of the step (``forward`` of iteration 0, ...) from event ``start`` to the next span's start."""

    phase: str
    iteration: int
    start: int


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The step at ``batch_size`` on ``gpu``: its peaks (as the report has them), the peak's event and phase, and
    per sampled event (``points``, indices into the step's ``events``) the bytes by category, allocated and
    reserved. ``usable_bytes``: what the allocator can have on the card (capacity - CUDA context - the
    planner's reserve)."""

    gpu: str
    batch_size: int
    capacity_bytes: int
    usable_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    device_peak_bytes: int
    peak_event: int
    peak_phase: str
    events: int
    points: list[int]
    categories: dict[str, list[int]]
    allocated: list[int]
    reserved: list[int]
    phases: list[PhaseSpan]


def timeline_of(view: StepView) -> Timeline:
    """The timeline of ``view``'s step, from the replay its report shows."""
    r = view.replay()
    events, sizes, categories, _ = view.sized()
    reserved_peak_event = r.reserved.index(r.reserved_peak) if events else 0
    points = sample(len(events), (r.peak_event, reserved_peak_event))
    report = view.report
    return Timeline(
        gpu=view.card.name, batch_size=view.batch_size, capacity_bytes=view.card.memory_bytes,
        usable_bytes=view.card.usable_bytes(view.reserve_bytes), allocated_peak_bytes=report.allocated_peak_bytes,
        reserved_peak_bytes=report.reserved_peak_bytes, device_peak_bytes=report.device_peak_bytes,
        peak_event=r.peak_event, peak_phase=str(report.peak_phase), events=len(events), points=points,
        categories=category_timeline(events, sizes, categories, points),
        allocated=[r.allocated[p] for p in points], reserved=[r.reserved[p] for p in points],
        phases=phase_spans(view.step),
    )


def sample(n: int, keep: Iterable[int] = (), limit: int = MAX_POINTS) -> list[int]:
    """Of ``n`` events: every index when ``n <= limit``, else ``limit`` evenly spaced from 0 to ``n - 1``;
    the indices in ``keep`` always among them."""
    if n <= limit:
        return list(range(n))
    even = {i * (n - 1) // (limit - 1) for i in range(limit)}
    return sorted(even | {k for k in keep if 0 <= k < n})


def category_timeline(events: Sequence[tuple[bool, int]], sizes: Sequence[int], categories: Sequence[str],
                      points: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Live requested bytes per category (``ORDER``) after each event, or after each of ``points`` (ascending)."""
    slot: dict[str, int] = {c: i for i, c in enumerate(ORDER)}
    slot[Category.CONV_WORKSPACE] = slot[Category.WORKSPACE]
    slot[Category.PAGED_OPTIMIZER_STATE] = slot[Category.OPTIMIZER_STATE]  # managed memory, as optimizer state
    other = slot[Category.TEMPORARY]
    live = [0] * len(ORDER)
    out: list[list[int]] = [[] for _ in ORDER]
    wanted = iter(range(len(events)) if points is None else points)
    at = next(wanted, -1)
    for i, (is_alloc, k) in enumerate(events):
        live[slot.get(categories[k], other)] += sizes[k] if is_alloc else -sizes[k]
        if i == at:
            for lane, v in zip(out, live, strict=True):
                lane.append(v)
            at = next(wanted, -1)
    return {str(c): lane for c, lane in zip(ORDER, out, strict=True)}


def phase_spans(step: Step) -> list[PhaseSpan]:
    """Where each phase of the step begins: at the first allocation of another (phase, iteration)."""
    spans: list[PhaseSpan] = []
    for i, (is_alloc, k) in enumerate(step.events):
        if is_alloc:
            phase, _module, iteration = step.where(k)
            if not spans or (spans[-1].phase, spans[-1].iteration) != (phase, iteration):
                spans.append(PhaseSpan(str(phase), iteration, i))
    return spans
