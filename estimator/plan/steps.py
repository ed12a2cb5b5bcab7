"""The planner's view of one model's training steps on many cards: full traces, their affine fits, reports.

>>> steps = Steps(simulator, reserve_bytes=256 * 2**20)                    # doctest: +SKIP
>>> steps.report(1, card).fits, steps.affine(1, card) is not None
(True, True)

Where a full step comes from is a ``StepSource``: simulations of the model
(``estimator.simulate.source.Simulator``), or a portable profile
(``estimator.portable.replayer.ProfileReplayer``), which seeds the steps it
was traced with and can simulate nothing. Cards with the same signature get
the same step, so they share its traces, fits and replays. A fit through two
traces becomes the card group's affine trace once a third full simulation
records exactly the step it synthesizes there (``check``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from estimator.gpus import GPU
from estimator.options import MAX_BATCH
from estimator.plan.affine import AffineTrace, fit
from estimator.plan.growing import MORE, Deeper, GrowingTrace, grow
from estimator.plan.periodic import NotPeriodic
from estimator.plan.replays import ReplayCache
from estimator.replay.allocator import ReplayResult
from estimator.replay.report import MemoryReport
from estimator.trace import Step, Trace

# The third trace that checks the affine fit: far enough from the first two
# that a size growing other than linearly shows.
CHECK_OFFSET = 7

# what the planner replays for any batch: an affine trace, or a growing one (a step with loops over its samples)
Fitted = AffineTrace | GrowingTrace


@dataclass(frozen=True)
class ModelFacts:
    """What the answer says of the model: its name, parameters, the input it was built for (every field the
    builder resolved), the builder's assumptions, the longest ``seq_len`` its positions allow (None: no
    position table, or not known) and the smallest batch that trains where it is known (a profile's; None:
    the planner tries batch 1)."""

    name: str
    parameter_count: int
    input: Mapping[str, object] = field(default_factory=dict)
    assumptions: Sequence[str] = ()
    max_seq_len: int | None = None
    min_batch: int | None = None


@dataclass(frozen=True)
class Seed:
    """The steps a portable profile was traced with, for one signature: the step at ``start`` itself, the
    checked affine trace from ``start + 1`` on, and the FLOPs at ``start + 1`` and ``start + 2``."""

    start: int
    first: AffineTrace
    affine: AffineTrace
    flops: tuple[int, int]


class StepSource(Protocol):
    """Where full steps come from. ``can_simulate``: full simulations can check an answer (a profile cannot);
    ``seeds``: the steps known without simulating, by signature."""

    model: ModelFacts
    can_simulate: bool

    @property
    def seeds(self) -> Mapping[Any, Seed]:
        """The steps known without simulating, by signature."""
        ...

    def signature(self, gpu: GPU) -> Hashable:
        """Cards with the same signature get the same step."""
        ...

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        """A full simulation at ``batch`` on ``gpu``, and how many it took (a distributed step's rank may be
        chosen by simulating each candidate)."""
        ...

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """Start the simulation at ``batch`` beside the caller's work, if the source can (else nothing): a guess
        at what ``simulate`` is asked next, replacing the guesses before it but the one at ``keep``."""
        ...


class Steps:
    """One model's steps on the cards of a request, as the planner asks for them (see the module docstring)."""

    def __init__(self, source: StepSource, reserve_bytes: int = 0) -> None:
        self.source = source
        self.model = source.model
        self.can_confirm = source.can_simulate  # whether full simulations can check an answer
        self.replays = ReplayCache(reserve_bytes)
        self.reserve_bytes = reserve_bytes
        self.simulations = 0  # full simulations run
        self.traces: dict[tuple[int, Hashable], Step] = {}
        self.affines: dict[Hashable, Fitted | None] = {}  # checked against a third full simulation
        self._growing: dict[tuple[Hashable, int], GrowingTrace | None] = {}
        self._fits: dict[tuple[Hashable, int, bool], AffineTrace | None] = {}
        self._reports: dict[tuple[int, GPU], MemoryReport] = {}

    def signature(self, gpu: GPU) -> Hashable:
        return self.source.signature(gpu)

    def trace(self, batch: int, gpu: GPU) -> Step:
        """The full step at ``batch`` on ``gpu``: simulated once per signature (or seeded by a profile)."""
        key = (batch, self.signature(gpu))
        if key not in self.traces:
            seed = self.source.seeds.get(key[1])
            if seed is not None:
                return seed.first if batch == seed.start else seed.affine
            trace, runs = self.source.simulate(batch, gpu)
            self.simulations += runs
            key = (batch, self.signature(gpu))  # the first simulation tells what cards share its step
            self.traces[key] = trace
        return self.traces[key]

    def report(self, batch: int, gpu: GPU, exact: bool = True) -> MemoryReport:
        """The report of the step at ``batch`` on ``gpu``: of a full simulation, or (``exact=False``) of the
        checked affine trace when one is known for the card and covers ``batch`` (the same events a full
        simulation records there)."""
        sig = self.signature(gpu)
        affine = None if exact or (batch, sig) in self.traces else self.affines.get(sig)
        if affine is not None and batch < affine.min_batch:
            affine = None
        key = (batch, gpu)
        if key not in self._reports:
            # the notes of a full simulation of this signature (the affine trace was fitted through two), not of
            # whichever card simulated first: a V100's bf16 step has no cuDNN convolutions, an A100's has
            step = self.trace(batch, gpu) if affine is None else affine
            like = step if affine is None else next((t for (_, s), t in self.traces.items() if s == sig), None)
            # a profile's steps carry no notes: its assumptions are the model's (the answer's top level)
            notes: tuple[Sequence[str], Sequence[str]] = (
                (like.unsupported, like.assumptions) if isinstance(like, Trace) else ((), ()))
            if isinstance(affine, GrowingTrace):  # the shortcut says so, as a deepened step does
                notes = (notes[0], [*notes[1], affine.note])
            try:
                self._reports[key] = self.replays.step_report(step, batch, gpu, *notes)
            except NotPeriodic:  # a growing trace that cannot be synthesized there: the full step
                self._reports[key] = self.report(batch, gpu)
        return self._reports[key]

    def fits(self, batch: int, gpu: GPU) -> bool:
        """``report(batch, gpu).fits``, from the replay with the card's capacity alone: a report of a step that
        does not fit also replays it without one (what it would need), which a search that asks only whether
        it fits does without."""
        known = self._reports.get((batch, gpu))
        return known.fits if known is not None else self.replay(self.trace(batch, gpu), batch, gpu).fits

    def simulated(self, gpu: GPU) -> list[int]:
        """The batches whose full step on ``gpu`` is known (simulated, or seeded), ascending."""
        sig = self.signature(gpu)
        return sorted(b for b, s in self.traces if s == sig)

    def prefetch(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """Start the full simulation at ``batch`` on ``gpu`` beside this process's work where the source can (a
        search's likely next probe; ``trace`` collects it): the answer is the same, only sooner. It replaces the
        guesses started before, but for the one at ``keep`` (the batch asked for now)."""
        if batch <= MAX_BATCH and (batch, self.signature(gpu)) not in self.traces:
            self.source.speculate(batch, gpu, keep)

    def replay(self, step: Step, batch: int, gpu: GPU, capped: bool = True) -> ReplayResult:
        try:
            return self.replays.replay(step, batch, gpu, capped)
        except NotPeriodic:  # a growing trace that cannot be synthesized there (too long): the full step
            return self.replays.replay(self.trace(batch, gpu), batch, gpu, capped)

    def fit(self, start: int, gpu: GPU, skip_start: bool = False) -> AffineTrace | None:
        """The affine trace through batches ``start`` and ``start + 1`` (through ``start + 1`` and ``start + 2``
        when the step takes other paths at ``start``, or with ``skip_start``), not yet checked.

        At batch 1 some ops can take other paths (a (1, H, S, D) matmul
        folds into a view where a larger batch copies): then the traces at
        ``start`` and ``start + 1`` differ and the fit moves one batch up.
        """
        key = (self.signature(gpu), start, skip_start)
        if key not in self._fits:
            found = None
            if not skip_start:
                found = self._fit_through(start, gpu)
            if found is None:
                found = self._fit_through(start + 1, gpu)
            self._fits[key] = found
        return self._fits[key]

    def _fit_through(self, batch: int, gpu: GPU) -> AffineTrace | None:
        first, second = self.trace(batch, gpu), self.trace(batch + 1, gpu)
        if not (isinstance(first, Trace) and isinstance(second, Trace)):
            return None
        return fit([(batch, first), (batch + 1, second)])

    def candidates(self, start: int, gpu: GPU) -> Iterator[Fitted]:
        """The fits to try, in order: through ``start`` (``fit``), then one batch up if that differs, then the
        growing trace (``growing``: ops that change with the batch by segments per sample). A fit through
        ``start`` can pass ``fit``'s own test yet be off at other batches when the step takes other paths at
        ``start``; only a check against a third simulation tells. Lazy: the second fit (and its simulation at
        ``start + 2``) only when the first is rejected, the growing trace (up to ``start + 4``) only when both
        are. A profile's candidate is its own affine trace."""
        seed = self.source.seeds.get(self.signature(gpu))
        if seed is not None:
            yield seed.affine
            return
        first = self.fit(start, gpu)
        if first is not None:
            yield first
        second = self.fit(start, gpu, skip_start=True)
        if second is not None and second != first:
            yield second
        growing = self.growing(start, gpu)
        if growing is not None:
            yield growing

    def growing(self, start: int, gpu: GPU) -> GrowingTrace | None:
        """The growing trace through the full steps from ``start`` on (estimator/plan/growing.py), not yet
        checked past them; None when the step's ops change with the batch otherwise, or when it cannot simulate.
        Each batch past ``start + 2`` it needs is simulated with the next one beside it."""
        key = (self.signature(gpu), start)
        if key not in self._growing:
            found: GrowingTrace | None = None
            traces: dict[int, Trace] = {}
            for b in range(start, start + MORE + 1):
                if len(traces) > 2 and b < start + MORE:
                    self.prefetch(b + 1, gpu, keep=b)
                trace = self.trace(b, gpu)
                if not isinstance(trace, Trace):
                    break  # a profile's: seeded, never grown
                traces[b] = trace
                if len(traces) < 3:
                    continue
                try:
                    found = grow(traces, start)
                    break
                except Deeper:
                    continue
                except NotPeriodic:
                    break
            self._growing[key] = found
        return self._growing[key]

    def check(self, affine: Fitted, batch: int, gpu: GPU) -> bool:
        """Whether a full simulation at ``batch`` records exactly the step ``affine`` synthesizes there; when it
        does, ``affine`` answers ``report(exact=False)`` for the card's signature from then on. A source that
        cannot simulate checks nothing."""
        if not self.can_confirm:
            return False
        trace = self.trace(batch, gpu)
        try:
            if not (isinstance(trace, Trace) and affine.matches(trace, batch)):
                return False
        except NotPeriodic:  # a growing trace that cannot be synthesized there: no check
            return False
        self.affines.setdefault(self.signature(gpu), affine)
        return True

    def affine(self, start: int, gpu: GPU) -> Fitted | None:
        """``fit`` (else the growing trace), checked by a full simulation at ``start + 1 + CHECK_OFFSET`` (a
        profile's own, checked when it was made); None when the step is neither affine nor growing in the
        batch."""
        sig = self.signature(gpu)
        seed = self.source.seeds.get(sig)
        if seed is not None:
            return self.affines.setdefault(sig, seed.affine)
        if sig not in self.affines:
            if not any(self.check(a, start + 1 + CHECK_OFFSET, gpu) for a in self.candidates(start, gpu)):
                self.affines[sig] = None
        return self.affines[sig]

    def known_affine(self, gpu: GPU) -> Fitted | None:
        """The checked affine (or growing) trace for ``gpu``'s signature, if one is known already (no
        simulation)."""
        sig = self.signature(gpu)
        seed = self.source.seeds.get(sig)
        return seed.affine if seed is not None else self.affines.get(sig)

    def flops(self, batch: int, gpu: GPU, start: int) -> int:
        """FLOPs of one step at ``batch``: affine in the batch, through the steps at ``start`` and ``start + 1``
        (a profile's, at ``start + 1`` and ``start + 2``)."""
        seed = self.source.seeds.get(self.signature(gpu))
        if seed is not None:
            f1, f2 = seed.flops
            return f1 + (f2 - f1) * (batch - seed.start - 1)
        first, second = self.trace(start, gpu), self.trace(start + 1, gpu)
        assert isinstance(first, Trace) and isinstance(second, Trace)  # simulated: full traces
        return first.flops + (second.flops - first.flops) * (batch - start)
