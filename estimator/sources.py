"""Where a card's steps come from: full simulations, or a portable profile.

Both are ``estimator.plan.strategy.StepSource``s: they answer the same
questions (``report``, ``profile``, ``replay``, ``flops``), so the planner
does not care which it asks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from estimator import background
from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.models import BuiltModel
from estimator.plan.affine import AffineTrace, fit
from estimator.plan.replays import ReplayCache
from estimator.portable import PortableProfile
from estimator.replay.report import MemoryReport
from estimator.request.recipe import Recipe
from estimator.simulate.distributed import candidate_ranks_of
from estimator.simulate.record import record_built
from estimator.simulate.virtual_gpu.attention import SdpaCall, backend_for
from estimator.trace import Trace

Progress = Callable[[int, str], None]
# The third trace that checks the affine fit: far enough from the first two
# that a size growing other than linearly shows.
CHECK_OFFSET = 7


def backends_key(calls: list[SdpaCall], gpu: GPU, thresholds: Sequence[tuple[int, int]] = ()) -> str:
    """The attention backends a step's SDPA calls get on ``gpu``, comma-joined ('' without SDPA), then
    which side of each capability threshold of the step's kernels the card is on (';sm8.0+', ';sm8.0-')."""
    key = ",".join(backend_for(c, gpu.capability).name for c in calls)
    return key + "".join(f";sm{t[0]}.{t[1]}{'+' if gpu.capability >= tuple(t) else '-'}" for t in thresholds)


class Simulator(ReplayCache):
    """Full simulations of one model and recipe, shared between cards that simulate alike.

    A trace depends on the card only through the attention backends its
    SDPA calls get and the capability thresholds its kernels turned on
    (cuDNN convolutions in bf16 from sm80), unless the step asked torch.cuda about the card (then it
    is the card's own). The cuBLAS workspace (8 MiB + 128 KiB, 32 MiB on Hopper) is one
    allocation of category ``workspace`` whose size each report takes from
    its card.
    """

    can_confirm = True

    def __init__(self, built: BuiltModel, recipe: Recipe, progress: Progress | None = None,
                 reserve_bytes: int = 0) -> None:
        super().__init__(reserve_bytes)
        self.built = built
        self.recipe = recipe
        self.progress = progress
        self.traces: dict[tuple, Trace] = {}
        self.profiles: dict[tuple, AffineTrace | None] = {}  # checked against a third full simulation
        self._fits: dict[tuple, AffineTrace | None] = {}
        self._reports: dict[tuple, MemoryReport] = {}
        self._pending: dict[tuple, tuple[background.Background, float]] = {}  # prefetched traces being simulated
        self._probe: Trace | None = None  # any trace: what the step asks of a card
        self._ranks: list[int] | None = None  # distributed: the ranks that may need the most (one once known)
        self.rank_note: str | None = None  # which rank stands for the world, and why (every trace's assumption)
        self.extra_simulations = 0  # the other candidate ranks' simulations

    def signature(self, gpu: GPU) -> tuple:
        probe = self._probe
        if probe is None or probe.card_queries:
            return ("card", gpu.name, gpu.capability, gpu.memory_bytes, gpu.cublas_workspace_bytes)
        return ("shared", backends_key(probe.sdpa_calls, gpu, probe.capability_thresholds))

    def _record(self, batch: int, gpu: GPU) -> Trace:
        b = self.built
        if len(self._resolve_ranks()) > 1:
            return self._pick_rank(batch, gpu)
        trace = record_built(b, batch, self.recipe, gpu)
        if self.rank_note is not None:
            trace.assumptions.append(self.rank_note)
        return trace

    def _resolve_ranks(self) -> list[int]:
        """The ranks a distributed step may need the most on; with one, the recipe stands for it."""
        if self._ranks is None:
            d = self.recipe.distributed
            self._ranks = candidate_ranks_of(self.built.factory, d)
            if len(self._ranks) == 1 and d.strategy == "zero1" and d.world_size > 1:
                self.rank_note = (f"rank {self._ranks[0]} of {d.world_size} simulated: its ZeroRedundancyOptimizer "
                                  "partition holds the most parameters, so the most optimizer state")
            if len(self._ranks) == 1 and self._ranks[0] != d.rank:
                self.recipe = dataclasses.replace(self.recipe, distributed=d.at(d.world_size, self._ranks[0]))
        return self._ranks

    def _pick_rank(self, batch: int, gpu: GPU) -> Trace:
        """Simulate each candidate rank at ``batch`` once; the one whose step needs more stands for the
        world from then on (estimator/simulate/distributed: uneven shards)."""
        b, d = self.built, self.recipe.distributed
        traces = {r: record_built(b, batch, dataclasses.replace(self.recipe, distributed=d.at(d.world_size, r)), gpu)
                  for r in self._ranks or ()}
        peaks = {r: t.live_peak()[0] for r, t in traces.items()}
        rank = max(peaks, key=lambda r: (peaks[r], -r))
        self.recipe = dataclasses.replace(self.recipe, distributed=d.at(d.world_size, rank))
        self._ranks = [rank]
        self.extra_simulations += len(traces) - 1
        trace = traces[rank]
        others = ", ".join(f"{peaks[r] / 2**20:.1f} MiB on rank {r}" for r in sorted(peaks) if r != rank)
        self.rank_note = (f"rank {rank} of {d.world_size} simulated: its step's live peak at batch {batch} is "
                          f"{peaks[rank] / 2**20:.1f} MiB ({others}); FSDP's shards differ between ranks")
        trace.assumptions.append(self.rank_note)
        return trace

    def prefetch(self, batch: int, gpu: GPU) -> None:
        """Start the full simulation at ``batch`` in a forked child now (estimator/background.py);
        ``trace`` collects it, or runs it itself if the child fails. Not before the rank a distributed
        step stands for is known (with uneven shards, the first simulations pick it)."""
        if len(self._resolve_ranks()) > 1:
            return
        if background.enabled() and (batch, gpu) not in self._pending:
            self._pending[batch, gpu] = (background.Background(lambda: self._record(batch, gpu)), time.perf_counter())

    def _collect(self, batch: int, gpu: GPU) -> Trace | None:
        sig = self.signature(gpu)
        for (b, card), (job, started) in list(self._pending.items()):
            if b == batch and self.signature(card) == sig:
                del self._pending[b, card]
                # as long again as it has run, at least 5 s: the child does what the parent did meanwhile
                return job.result(timeout=max(5.0, 2 * (time.perf_counter() - started)))
        return None

    def trace(self, batch: int, gpu: GPU) -> Trace:
        key = (batch, self.signature(gpu))
        if key not in self.traces:
            trace = self._collect(batch, gpu) if self._pending else None
            if trace is None:
                trace = self._record(batch, gpu)
            if self._probe is None:
                self._probe = trace
                key = (batch, self.signature(gpu))
            self.traces[key] = trace
            if self.progress is not None:
                self.progress(len(self.traces), f"batch {batch} on {gpu.name}")
        return self.traces[key]

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        """The report of a full simulation at ``batch`` on ``gpu``."""
        key = (batch, gpu)
        if key not in self._reports:
            trace = self.trace(batch, gpu)
            self._reports[key] = self.step_report(trace, batch, gpu, trace.unsupported, trace.assumptions)
        return self._reports[key]

    def fit(self, start: int, gpu: GPU, skip_start: bool = False) -> AffineTrace | None:
        """The affine trace through batches ``start`` and ``start + 1`` (through ``start + 1`` and
        ``start + 2`` when the step takes other paths at ``start``, or with ``skip_start``), not yet
        checked: ``check`` or ``profile`` does that.

        At batch 1 some ops can take other paths (a (1, H, S, D) matmul
        folds into a view where a larger batch copies): then the traces at
        ``start`` and ``start + 1`` differ and the fit moves one batch up.
        """
        key = (self.signature(gpu), start, skip_start)
        if key not in self._fits:
            found = None
            if not skip_start:
                found = fit([(start, self.trace(start, gpu)), (start + 1, self.trace(start + 1, gpu))])
            if found is None:
                found = fit([(start + 1, self.trace(start + 1, gpu)), (start + 2, self.trace(start + 2, gpu))])
            self._fits[key] = found
        return self._fits[key]

    def candidates(self, start: int, gpu: GPU) -> Iterator[AffineTrace]:
        """The fits to try, in order: through ``start`` (``fit``), then one batch up if that differs.
        A fit through ``start`` can pass ``fit``'s own test yet be off at other batches when the step
        takes other paths at ``start``; only a check against a third simulation tells. Lazy: the
        second fit (and its simulation at ``start + 2``) only when the first is rejected."""
        first = self.fit(start, gpu)
        if first is not None:
            yield first
        second = self.fit(start, gpu, skip_start=True)
        if second is not None and second != first:
            yield second

    def check(self, profile: AffineTrace, batch: int, gpu: GPU) -> bool:
        """Whether a full simulation at ``batch`` records exactly the step ``profile`` synthesizes there;
        when it does, ``profile`` answers ``report_fast`` for the card's signature from then on."""
        if not profile.matches(self.trace(batch, gpu), batch):
            return False
        self.profiles.setdefault(self.signature(gpu), profile)
        return True

    def profile(self, start: int, gpu: GPU) -> AffineTrace | None:
        """``fit``, checked by a full simulation at ``start + 1 + CHECK_OFFSET``; None when the step is
        not affine in the batch."""
        sig = self.signature(gpu)
        if sig not in self.profiles:
            if not any(self.check(p, start + 1 + CHECK_OFFSET, gpu) for p in self.candidates(start, gpu)):
                self.profiles[sig] = None
        return self.profiles[sig]

    def known_profile(self, gpu: GPU) -> AffineTrace | None:
        """The checked affine trace for ``gpu``'s signature, if one is known already (no simulation)."""
        return self.profiles.get(self.signature(gpu))

    def report_fast(self, batch: int, gpu: GPU) -> MemoryReport:
        """``report``, from the checked affine trace when one is known for the card and covers ``batch``
        (the same events a fresh simulation records), else simulated."""
        if (batch, self.signature(gpu)) in self.traces:
            return self.report(batch, gpu)
        profile = self.profiles.get(self.signature(gpu))
        if profile is None or batch < profile.min_batch:
            return self.report(batch, gpu)
        key = (batch, gpu)
        if key not in self._reports:
            # the notes of a full simulation of this signature (the profile was fitted through two), not of
            # whichever card simulated first: a V100's bf16 step has no cuDNN convolutions, an A100's has
            sig = self.signature(gpu)
            like = next(t for (_, s), t in self.traces.items() if s == sig)
            self._reports[key] = self.step_report(profile, batch, gpu, like.unsupported, like.assumptions)
        return self._reports[key]

    def flops(self, batch: int, gpu: GPU, start: int) -> int:
        """FLOPs of one step at ``batch``: affine in the batch, from the traces at ``start`` and ``start + 1``."""
        f1, f2 = self.trace(start, gpu).flops, self.trace(start + 1, gpu).flops
        return f1 + (f2 - f1) * (batch - start)

    @property
    def simulations(self) -> int:
        return len(self.traces) + self.extra_simulations

    def backend_key(self, gpu: GPU) -> str:
        """The attention backends the step's SDPA calls get on ``gpu``, as a profile key."""
        probe = self._probe
        return backends_key(probe.sdpa_calls, gpu, probe.capability_thresholds) if probe is not None else ""


class ProfileReplayer(ReplayCache):
    """Answers from a portable profile: allocator replays of its affine traces, no model code."""

    can_confirm = False
    simulations = 0

    def __init__(self, profile: PortableProfile, reserve_bytes: int) -> None:
        super().__init__(reserve_bytes)
        self.doc = profile
        self.calls = [SdpaCall(getattr(torch, c["dtype"].removeprefix("torch.")), c["dim"], tuple(c["head_dims"]),
                               c["has_mask"], c["requires_grad"]) for c in profile.sdpa_calls]

    def signature(self, gpu: GPU) -> str:
        key = backends_key(self.calls, gpu, self.doc.capability_thresholds)
        if key not in self.doc.steps:
            raise SpecError("gpus", gpu.name, f"a card whose attention backends ({key or 'none'}) the profile "
                            f"was traced for ({', '.join(self.doc.steps) or 'none'}); re-run batchfit profile")
        return key

    def profile(self, start: int, gpu: GPU) -> AffineTrace:
        return self.doc.steps[self.signature(gpu)]

    def known_profile(self, gpu: GPU) -> AffineTrace:
        return self.profile(self.doc.start, gpu)

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        key = self.signature(gpu)
        step = self.doc.first_steps[key] if batch == self.doc.start else self.doc.steps[key]
        # the profile's assumptions are the model's (the response's top level, as from a spec), not the step's
        return self.step_report(step, batch, gpu, [], [])

    def report_fast(self, batch: int, gpu: GPU) -> MemoryReport:
        return self.report(batch, gpu)

    def candidates(self, start: int, gpu: GPU) -> Iterator[AffineTrace]:
        """The profile's own trace: it was checked when the profile was made."""
        yield self.profile(start, gpu)

    def check(self, profile: AffineTrace, batch: int, gpu: GPU) -> bool:
        """A profile has no model to simulate (``can_confirm`` is False): nothing can be checked."""
        return False

    def flops(self, batch: int, gpu: GPU, start: int) -> int:
        f1, f2 = self.doc.flops[self.signature(gpu)]  # at start + 1 and start + 2
        return f1 + (f2 - f1) * (batch - start - 1)
