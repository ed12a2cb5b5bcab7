"""The event trace: the contract between the simulator and everything after it.

An ordered list of allocations and frees of storages, each allocation with
its bytes, category, owning module, phase and iteration. The simulator
(``estimator.simulate``) writes traces; the allocator replay
(``estimator.replay``) and the planner (``estimator.plan``) read them. This
module imports nothing but the standard library, so a trace can be read,
replayed and planned on where torch is not installed.

>>> t = Trace([Allocation(512, Phase.FORWARD, "fc", "mm", 0, Category.ACTIVATION)], [(True, 0), (False, 0)])
>>> t.live_peak(), t.categories()
((512, 0), [<Category.ACTIVATION: 'activation'>])
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from operator import attrgetter
from typing import Any, Protocol


class Category(StrEnum):
    """What an allocation holds. ``""`` (``UNKNOWN``) only until the recorder finishes."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    INPUT = "input"
    WORKSPACE = "workspace"  # a cuBLAS handle's workspace: sized by each card, not by the trace
    CONV_WORKSPACE = "conv_workspace"  # cuDNN's per-call workspace: skipped when it cannot be had
    EMPTY_CACHE = "empty_cache"  # not memory: a torch.cuda.empty_cache() call (0 bytes)
    # distributed training's buffers: DDP's gradient buckets, FSDP's all-gather and reduce-scatter buffers
    COMMUNICATION = "communication"
    # bitsandbytes' paged optimizers' state: CUDA unified memory (cudaMallocManaged), outside the caching allocator
    PAGED_OPTIMIZER_STATE = "paged_optimizer_state"
    UNKNOWN = ""


# Allocations a replay may skip when they cannot be had (cuDNN falls back to
# a kernel without a workspace), so no part of a live-bytes bound.
SOFT_CATEGORIES = frozenset({Category.CONV_WORKSPACE})
# Allocations outside the caching allocator that still take the card's memory (the replay counts them apart).
MANAGED_CATEGORIES = frozenset({Category.PAGED_OPTIMIZER_STATE})


class Phase(StrEnum):
    """Where in the training step an allocation happened."""

    SETUP = "setup"
    ZERO_GRAD = "zero_grad"
    INPUT = "input"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    TEARDOWN = "teardown"


@dataclass
class Allocation:
    """One storage: ``nbytes`` as requested from the allocator."""

    nbytes: int
    phase: str
    module: str
    op: str
    iteration: int
    category: str = Category.UNKNOWN
    stream: int = 0  # the CUDA stream current when it was allocated: the caching allocator pools per stream


@dataclass
class Trace:
    """Allocations and the ordered alloc/free events that reference them."""

    allocations: list[Allocation] = field(default_factory=list)
    events: list[tuple[bool, int]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    flops: int = 0
    sdpa_calls: list[Any] = field(default_factory=list)  # SdpaCall: what the card-dependent attention choices read
    card_queries: list[str] = field(default_factory=list)  # torch.cuda queries the step made
    # compute capabilities at which the step's kernels change (cuDNN for bf16 convs from sm80, ...)
    capability_thresholds: list[tuple[int, int]] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, tuple[list[tuple[Any, ...]], dict[str, Any]]]:
        """Pickled with its allocations as rows of their fields, not one object each (a simulation forked to a
        child comes back pickled: a deep model's trace of ~18k allocations loads in ~10 ms instead of ~130)."""
        rows = [_ROW(a) for a in self.allocations]
        rest = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "allocations"}
        return _unpickled, (rows, rest)

    def sizes(self, workspace: int) -> list[int]:
        """Each allocation's bytes, the cuBLAS workspace as ``workspace`` (the card's own: a trace is shared)."""
        return [workspace if a.category == Category.WORKSPACE else a.nbytes for a in self.allocations]

    def categories(self) -> list[str]:
        return [a.category for a in self.allocations]

    def streams(self) -> list[int] | None:
        """Each allocation's stream, or None when all are on the default stream (most steps)."""
        streams = [a.stream for a in self.allocations]
        return streams if any(streams) else None

    def sized(self, batch: int, workspace: int) -> Sized:
        """``Step.sized``: a trace is the step at the one batch it was recorded at."""
        return self.events, self.sizes(workspace), self.categories(), self.streams()

    def where(self, k: int) -> tuple[str, str, int]:
        """(phase, module, iteration) of allocation ``k``, as a report names the peak."""
        a = self.allocations[k]
        return a.phase, a.module, a.iteration

    def live_peak(self, hard_only: bool = False, workspace: int | None = None) -> tuple[int, int]:
        """(peak of live requested bytes, event index): what a profiler of the raw allocator sees.
        ``hard_only``: without the allocations a replay may skip (cuDNN workspaces), as the affine
        trace's ``live_at`` bounds them; ``workspace``: the cuBLAS workspace as a card's (``sizes``)."""
        live = peak = idx = 0
        allocs = self.allocations
        sizes = [a.nbytes for a in allocs] if workspace is None else self.sizes(workspace)
        for i, (is_alloc, k) in enumerate(self.events):
            if hard_only and allocs[k].category in SOFT_CATEGORIES:
                continue
            live += sizes[k] if is_alloc else -sizes[k]
            if live > peak:
                peak, idx = live, i
        return peak, idx


_ROW = attrgetter(*(f.name for f in fields(Allocation)))  # an allocation's fields, in order: a pickled row


def _unpickled(rows: list[tuple[Any, ...]], rest: dict[str, Any]) -> Trace:
    """``Trace.__reduce__``'s trace again."""
    return Trace([Allocation(*row) for row in rows], **rest)


# (events, each allocation's bytes, categories, streams or None): what the allocator replays
Sized = tuple[list[tuple[bool, int]], list[int], list[str], list[int] | None]


class Step(Protocol):
    """A training step the allocator can replay: a ``Trace`` (the batch it was recorded at) or an affine trace
    (``estimator.plan.affine.AffineTrace``: any batch)."""

    @property
    def events(self) -> list[tuple[bool, int]]: ...

    def sized(self, batch: int, workspace: int) -> Sized:
        """The step at ``batch`` with the card's cuBLAS workspace of ``workspace`` bytes."""
        ...

    def where(self, k: int) -> tuple[str, str, int]:
        """(phase, module, iteration) of allocation ``k``."""
        ...
