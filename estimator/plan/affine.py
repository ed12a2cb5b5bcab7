"""The affine trace: a training step's events as a function of the batch size.

docs/DESIGN.md, "The planner": traced at two batch sizes, a model whose op sequence
does not change with the batch has each allocation's size ``a + k*batch``
(a tensor of shape (B, ...) has B times the bytes of one sample). The trace
for any batch then follows without re-tracing, and the max-batch search
runs on the allocator replay alone. A third trace checks the fit exactly;
any difference (ops that change with the batch, sizes not affine) and the
planner falls back to full simulations.

>>> profile = fit([(1, t1), (2, t2)], check=(5, t5))              # doctest: +SKIP
>>> profile.events_at(64, workspace=8 * 2**20)[:2]

The cuBLAS workspace is kept symbolic (category ``workspace``) so one
profile serves cards whose workspace differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from estimator.replay.allocator import Event
from estimator.replay.native import Encoded, available, encode
from estimator.trace import SOFT_CATEGORIES, Category, Sized, Trace

SCHEMA_VERSION = 3  # 2: cuDNN workspaces (soft allocations), empty_cache, capability thresholds; 3: streams


@dataclass(frozen=True)
class AffineTrace:
    """Allocation ``i`` has ``const[i] + per_sample[i] * batch`` bytes; ``events`` reference them."""

    const: list[int]
    per_sample: list[int]
    categories: list[str]
    events: list[tuple[bool, int]]
    phases: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    min_batch: int = 1
    streams: list[int] | None = None  # each allocation's CUDA stream; None: all on the default stream

    def nbytes(self, i: int, batch: int, workspace: int) -> int:
        if self.categories[i] == Category.WORKSPACE:
            return workspace
        return self.const[i] + self.per_sample[i] * batch

    def where(self, k: int) -> tuple[str, str, int]:
        """(phase, module, iteration) of allocation ``k``, as a report names the peak (steady state: 1)."""
        return self.phases[k], self.modules[k], 1

    def sized(self, batch: int, workspace: int) -> Sized:
        """``Step.sized``: the step at ``batch``."""
        return self.events, self.sizes_at(batch, workspace), self.categories, self.streams

    def sizes_at(self, batch: int, workspace: int) -> list[int]:
        """Each allocation's bytes at ``batch``, the cuBLAS workspace as ``workspace``."""
        sizes = [c + k * batch for c, k in zip(self.const, self.per_sample, strict=True)]
        for i in self._workspaces:
            sizes[i] = workspace
        return sizes

    @cached_property
    def encoded(self) -> Encoded | None:
        """The events, categories and streams in the C replay's form (``estimator.replay.native``), made once: the
        same at every batch. None without the C replay."""
        return encode(self.events, self.categories, self.streams) if available() else None

    @cached_property
    def _workspaces(self) -> list[int]:
        return [i for i, c in enumerate(self.categories) if c == Category.WORKSPACE]

    @cached_property
    def _fronts(self) -> dict[int, list[tuple[int, int]]]:
        return {}

    def _front(self, workspace: int) -> list[tuple[int, int]]:
        """(per-sample, constant) bytes live after each allocation, only the lines that can be the largest
        (allocations the replay may skip, cuDNN's workspaces, left out: the bound stays a bound)."""
        fronts = self._fronts
        if workspace not in fronts:
            points = set()
            c = k = 0
            is_ws = set(self._workspaces)
            soft = {i for i, c in enumerate(self.categories) if c in SOFT_CATEGORIES}
            for alloc, i in self.events:
                if i in soft:
                    continue  # may be skipped when it cannot be had: no part of the bound
                dc = workspace if i in is_ws else self.const[i]
                dk = 0 if i in is_ws else self.per_sample[i]
                if alloc:
                    c, k = c + dc, k + dk
                    points.add((k, c))
                else:
                    c, k = c - dc, k - dk
            front, best = [], None
            for k, c in sorted(points, reverse=True):  # a line with a larger slope and constant dominates
                if best is None or c > best:
                    front.append((k, c))
                    best = c
            fronts[workspace] = front
        return fronts[workspace]

    def live_at(self, batch: int, workspace: int) -> int:
        """The peak of requested bytes live at once at ``batch`` (what the allocator's blocks round up)."""
        return max((c + k * batch for k, c in self._front(workspace)), default=0)

    def live_bound(self, capacity: int, workspace: int, limit: int) -> int:
        """The largest batch <= ``limit`` whose requested bytes live at once stay within ``capacity``:
        no larger batch can fit, whatever the allocator does (its blocks are never smaller than requests)."""
        b = limit
        for k, c in self._front(workspace):
            if k > 0:
                b = min(b, (capacity - c) // k)
            elif c > capacity:
                return 0
        return b

    def events_at(self, batch: int, workspace: int) -> list[Event]:
        sizes, cats, streams = self.sizes_at(batch, workspace), self.categories, self.streams
        return [Event(alloc, k, sizes[k], cats[k], streams[k] if streams else 0) for alloc, k in self.events]

    def matches(self, trace: Trace, batch: int) -> bool:
        """Whether ``trace`` (a fresh simulation at ``batch``) is what this profile synthesizes."""
        if trace.events != self.events or len(trace.allocations) != len(self.const):
            return False
        if trace.streams() != self.streams:
            return False
        return all(
            a.category == self.categories[i]
            and (a.category == Category.WORKSPACE or a.nbytes == self.const[i] + self.per_sample[i] * batch)
            for i, a in enumerate(trace.allocations)
        )

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": SCHEMA_VERSION, "const": self.const, "per_sample": self.per_sample,
               "categories": self.categories, "events": [[int(a), k] for a, k in self.events],
               "phases": self.phases, "modules": self.modules, "min_batch": self.min_batch}
        if self.streams:
            doc["streams"] = self.streams
        return doc


def _same_program(a: Trace, b: Trace) -> bool:
    if a.events != b.events or len(a.allocations) != len(b.allocations):
        return False
    return all(x.op == y.op and x.category == y.category and x.phase == y.phase and x.stream == y.stream
               for x, y in zip(a.allocations, b.allocations, strict=True))


def fit(points: list[tuple[int, Trace]], check: tuple[int, Trace] | None = None) -> AffineTrace | None:
    """The affine trace through two (batch, trace) points, or None when the step is not affine in the batch."""
    (b1, t1), (b2, t2) = points
    if b1 == b2 or not _same_program(t1, t2):
        return None
    const, per_sample = [], []
    for x, y in zip(t1.allocations, t2.allocations, strict=True):
        if x.category == Category.WORKSPACE:
            const.append(0)
            per_sample.append(0)
            continue
        k, rem = divmod(y.nbytes - x.nbytes, b2 - b1)
        a = x.nbytes - k * b1
        if rem or k < 0:
            return None
        const.append(a)
        per_sample.append(k)
    profile = AffineTrace(const, per_sample, [a.category for a in t1.allocations], list(t1.events),
                          [a.phase for a in t1.allocations], [a.module for a in t1.allocations], min(b1, b2),
                          t1.streams())
    if check is not None and not profile.matches(check[1], check[0]):
        return None
    return profile


def concrete(trace: Trace) -> AffineTrace:
    """A trace as an affine trace with no per-sample part (the step at one batch size)."""
    allocs = trace.allocations
    return AffineTrace([0 if a.category == Category.WORKSPACE else a.nbytes for a in allocs], [0] * len(allocs),
                       [a.category for a in allocs], list(trace.events), [a.phase for a in allocs],
                       [a.module for a in allocs], 1, trace.streams())


def from_json(doc: dict[str, Any]) -> AffineTrace:
    return AffineTrace(list(doc["const"]), list(doc["per_sample"]), list(doc["categories"]),
                       [(bool(a), int(k)) for a, k in doc["events"]], list(doc.get("phases", [])),
                       list(doc.get("modules", [])), int(doc.get("min_batch", 1)),
                       [int(s) for s in doc["streams"]] if doc.get("streams") else None)
