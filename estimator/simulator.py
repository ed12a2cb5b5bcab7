"""Where a card's answers come from: full simulations, or a portable profile.

Both answer the same questions (``report``, ``profile``, ``replay_fits``,
``flops``) so the planner and ``estimate`` do not care which they ask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from estimator.allocator import AllocatorConfig, replay
from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.models import BuiltModel
from estimator.profile import AffineTrace, PortableProfile, fit
from estimator.recipe import Recipe
from estimator.report import MemoryReport, report_from_events, report_from_trace
from estimator.trace import Trace, record_training
from estimator.virtual_gpu.attention import SdpaCall, backend_for

Progress = Callable[[int, str], None]
# The third trace that checks the affine fit: far enough from the first two
# that a size growing other than linearly shows.
CHECK_OFFSET = 7


def replay_fits(profile: AffineTrace, batch: int, gpu: GPU, reserve_bytes: int) -> tuple[bool, int]:
    """(fits, allocated peak) of the synthesized step at ``batch``: one allocator replay, no simulation."""
    r = replay(profile.events_at(batch, gpu.cublas_workspace_bytes), AllocatorConfig(gpu.usable_bytes(reserve_bytes)))
    return r.fits, r.allocated_peak


def backends_key(calls: list[SdpaCall], gpu: GPU) -> str:
    """The attention backends a step's SDPA calls get on ``gpu``, comma-joined ('' without SDPA)."""
    return ",".join(backend_for(c, gpu.capability).name for c in calls)


class Simulator:
    """Full simulations of one model and recipe, shared between cards that simulate alike.

    A trace depends on the card only through the attention backends its
    SDPA calls get and the cuBLAS workspace size, unless the step asked
    torch.cuda about the card (then it is the card's own).
    """

    can_confirm = True

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
        if probe is None or probe.card_queries:
            return ("card", gpu.name, gpu.capability, gpu.memory_bytes, gpu.cublas_workspace_bytes)
        return ("shared", backends_key(probe.sdpa_calls, gpu), gpu.cublas_workspace_bytes)

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
        return replay_fits(profile, batch, gpu, self.reserve_bytes)

    def report_fast(self, batch: int, gpu: GPU) -> MemoryReport:
        """``report``, from the affine trace when one is known for the card and covers ``batch``
        (the same events a fresh simulation records: ``fit`` checked it), else simulated."""
        if (batch, self.signature(gpu)) in self.traces:
            return self.report(batch, gpu)
        profile = self.profiles.get(self.signature(gpu))
        if profile is None or batch < profile.min_batch:
            return self.report(batch, gpu)
        return report_from_events(profile.events_at(batch, gpu.cublas_workspace_bytes), batch, gpu, profile.where,
                                  self._probe.unsupported, self._probe.assumptions, reserve_bytes=self.reserve_bytes)

    def flops(self, batch: int, gpu: GPU, start: int) -> int:
        """FLOPs of one step at ``batch``: affine in the batch, from the traces at ``start`` and ``start + 1``."""
        f1, f2 = self.trace(start, gpu).flops, self.trace(start + 1, gpu).flops
        return f1 + (f2 - f1) * (batch - start)

    @property
    def simulations(self) -> int:
        return len(self.traces)

    def backend_key(self, gpu: GPU) -> str:
        """The attention backends the step's SDPA calls get on ``gpu``, as a profile key."""
        return backends_key(self._probe.sdpa_calls if self._probe is not None else [], gpu)


class ProfileReplayer:
    """Answers from a portable profile: allocator replays of its affine traces, no model code."""

    can_confirm = False
    simulations = 0

    def __init__(self, profile: PortableProfile, reserve_bytes: int) -> None:
        self.doc = profile
        self.reserve_bytes = reserve_bytes
        self.calls = [SdpaCall(getattr(torch, c["dtype"].removeprefix("torch.")), c["dim"], tuple(c["head_dims"]),
                               c["has_mask"], c["requires_grad"]) for c in profile.sdpa_calls]
        self.profiles: dict[str, AffineTrace] = profile.steps

    def signature(self, gpu: GPU) -> str:
        key = backends_key(self.calls, gpu)
        if key not in self.doc.steps:
            raise SpecError("gpus", gpu.name, f"a card whose attention backends ({key or 'none'}) the profile "
                            f"was traced for ({', '.join(self.doc.steps) or 'none'}); re-run batchfit profile")
        return key

    def profile(self, start: int, gpu: GPU) -> AffineTrace:
        return self.doc.steps[self.signature(gpu)]

    def replay_fits(self, profile: AffineTrace, batch: int, gpu: GPU) -> tuple[bool, int]:
        return replay_fits(profile, batch, gpu, self.reserve_bytes)

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        key = self.signature(gpu)
        step = self.doc.first_steps[key] if batch == self.doc.start else self.doc.steps[key]
        return report_from_events(step.events_at(batch, gpu.cublas_workspace_bytes), batch, gpu, step.where, [],
                                  self.doc.assumptions, reserve_bytes=self.reserve_bytes)

    report_fast = report

    def flops(self, batch: int, gpu: GPU, start: int) -> int:
        f1, f2 = self.doc.flops[self.signature(gpu)]  # at start + 1 and start + 2
        return f1 + (f2 - f1) * (batch - start - 1)
