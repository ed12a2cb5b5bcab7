"""World sizes: the fewest ranks at which a step fits, and what to change when one GPU is not enough.

>>> worlds = Worlds(source_for, PlanOptions(strategy="fsdp", world_size=None))     # doctest: +SKIP
>>> worlds.min_world(card, 1)        # FSDP: the fewest ranks at which batch 1 fits the card
4

Each world size is its own job (sharded states shrink with the ranks, the
activations do not), whose steps the caller's ``source_for`` makes from the
request with the world size changed; a probe is one full simulation of one
rank at the smallest batch, shared by the cards that simulate alike. Memory
falls as ranks are added (FSDP shards parameters, gradients and optimizer
state, ZeRO-1 the optimizer state), so the search doubles the world until the
step fits, then bisects (``search.bisect``). DDP keeps everything on every
rank: more ranks never make it fit, so its only probe is one rank's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.options import MAX_WORLD_SIZE, PlanOptions
from estimator.plan.answer import answer_at, provenance, smallest_batch
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse, GPUResult, WarningCode
from estimator.plan.search import bisect
from estimator.plan.steps import Steps, StepSource
from estimator.plan.strategy import headroom_card
from estimator.replay.report import MemoryReport

if TYPE_CHECKING:
    from estimator.plan.answer import SourceFor

WORLD = "training.distributed.world_size"


class Worlds:
    """The steps of one job over world sizes: ``base`` changes (a strategy) and each world size's."""

    def __init__(self, source_for: SourceFor, reserve_bytes: int, strategy: str, *,
                 base: Mapping[str, Any] | None = None, first: StepSource | None = None) -> None:
        self.source_for = source_for
        self.reserve_bytes = reserve_bytes
        self.strategy = strategy
        self.base = dict(base or {})
        self._steps: dict[int, Steps] = {} if first is None else {1: Steps(first, reserve_bytes)}
        self.largest_tried: dict[str, int] = {}  # by card: the largest world a search that found none tried

    def steps(self, world_size: int) -> Steps:
        if world_size not in self._steps:
            source = self.source_for({**self.base, WORLD: world_size})
            self._steps[world_size] = Steps(source, self.reserve_bytes)
        return self._steps[world_size]

    def fits(self, world_size: int, card: GPU, batch: int, headroom: float | None = None) -> bool:
        """``batch`` fits ``card`` over ``world_size`` ranks; with ``headroom``, within it (a batch is
        recommended there)."""
        steps, card = self._at(world_size, card, headroom)
        return steps.fits(batch, card)

    def _report(self, world_size: int, card: GPU, batch: int, headroom: float | None) -> MemoryReport:
        steps, card = self._at(world_size, card, headroom)
        return steps.report(batch, card)

    def _at(self, world_size: int, card: GPU, headroom: float | None) -> tuple[Steps, GPU]:
        """The steps over ``world_size`` ranks, and ``card`` as they see it (held to ``headroom`` when given)."""
        steps = self.steps(world_size)
        return steps, card if headroom is None else headroom_card(card, steps.reserve_bytes, headroom)

    def beyond_any_world(self, world_size: int, card: GPU, batch: int, headroom: float | None = None) -> bool:
        """No world larger than ``world_size`` can fit: what the strategy does not shard, live at this world's
        allocated peak, already exceeds the card (more ranks shrink only the sharded bytes: FSDP's parameters,
        gradients and optimizer state, ZeRO-1's optimizer state; activations and buffers stay)."""
        report = self._report(world_size, card, batch, headroom)
        if report.capacity_bytes is None:
            return False
        b = report.breakdown
        sharded = b.optimizer_state + (b.parameters + b.gradients if self.strategy == "fsdp" else 0)
        return report.allocated_peak_bytes - sharded > report.capacity_bytes

    def min_world(self, card: GPU, batch: int, *, limit: int = MAX_WORLD_SIZE, least: int = 1,
                  headroom: float | None = None) -> int | None:
        """The fewest ranks (``least`` to ``limit``) at which ``batch`` fits ``card`` (within ``headroom`` when
        given); None when not even ``limit`` do."""
        def fits(w: int) -> bool:
            return self.fits(w, card, batch, headroom)

        if least == 1:
            if fits(1):
                return 1
            if self.strategy == "ddp":
                return None  # every rank holds the whole step
            lo, hi = 1, 2
        else:
            lo, hi = least - 1, least
        while not fits(hi):
            if hi >= limit or self.beyond_any_world(hi, card, batch, headroom):
                self.largest_tried[card.name] = max(hi, self.largest_tried.get(card.name, 1))
                return None
            lo, hi = hi, min(2 * hi, limit)
        # the largest world in [lo, hi) that does not fit, and one more
        return bisect(lambda w: not fits(w), lo, hi) + 1

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self._steps.values())


def answer_auto(source_for: SourceFor, source: StepSource, cards: list[GPU], options: PlanOptions,
                t0: float) -> EstimateResponse:
    """``world_size: "auto"``: per card the fewest ranks at which the smallest batch (or ``batch_size``) fits,
    the fewest at which a batch is recommended (the headroom met), and the answer there (at the first when no
    world recommends one); ``source`` is the step of one rank."""
    worlds = Worlds(source_for, options.reserve_bytes, options.strategy, first=source)
    notes = Notes()
    start = smallest_batch(worlds.steps(1), cards[0], notes)
    if options.batch_size is not None and options.batch_size < start:
        raise SpecError("batch_size", options.batch_size, f"at least {start}")
    at = options.batch_size or start  # the fewest ranks at which this batch fits
    fitting = [worlds.min_world(card, at) for card in cards]
    recommending = [None if w is None else worlds.min_world(card, at, least=w, headroom=options.headroom)
                    for card, w in zip(cards, fitting, strict=True)]
    # a card no world fits is answered at the largest world tried (one rank for DDP, which shards nothing)
    chosen = [rec or fit or (1 if options.strategy == "ddp" else worlds.largest_tried.get(card.name, 1))
              for card, fit, rec in zip(cards, fitting, recommending, strict=True)]
    groups: dict[int, list[int]] = {}
    for i, world in enumerate(chosen):
        groups.setdefault(world, []).append(i)
    parts: dict[int, EstimateResponse] = {}
    merged = Notes()
    for w, members in groups.items():
        part_notes = Notes()
        part_notes.merge(notes)
        parts[w] = answer_at(worlds.steps(w), [cards[i] for i in members], dataclasses.replace(options, world_size=w),
                             start, part_notes, t0)
        merged.merge(part_notes)
    results: list[GPUResult | None] = [None] * len(cards)
    for w, members in groups.items():
        for i, result in zip(members, parts[w].results, strict=True):
            results[i] = dataclasses.replace(result, min_world_size=fitting[i],
                                             recommended_world_size=recommending[i])
    first = parts[chosen[0]]
    assumptions: list[str] = []
    for part in parts.values():
        assumptions.extend(a for a in part.assumptions if a not in assumptions)
    assumptions.append(f"world_size 'auto': per card the fewest ranks (1 to {MAX_WORLD_SIZE}) at which batch "
                       f"{at} fits (min_world_size) and at which a batch is recommended with the headroom "
                       "(recommended_world_size, the world each result answers at), found by doubling then "
                       "bisection on full simulations of one rank"
                       + ("; DDP keeps the whole step on every rank, so only one rank is tried"
                          if options.strategy == "ddp" else ""))
    for card, least in zip(cards, fitting, strict=True):
        if least is None:
            merged.drop(WarningCode.DOES_NOT_FIT, card=card.name)
            tried = worlds.largest_tried.get(card.name, MAX_WORLD_SIZE)
            across = "on one rank: DDP keeps the whole step on every rank" if options.strategy == "ddp" else \
                f"over {tried} ranks of {options.strategy}" + ("" if tried >= MAX_WORLD_SIZE else
                                                                ", nor over more: what it does not shard "
                                                                "already exceeds the card")
            merged.add(WarningCode.DOES_NOT_FIT, f"{worlds.steps(1).model.name} does not fit "
                       f"on {card.name} at batch {at} even {across}", card=card.name, batch=at)
    return dataclasses.replace(first, results=[r for r in results if r is not None], assumptions=assumptions,
                               warnings=merged.warnings(), provenance=provenance(worlds.simulations, t0))
