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
from estimator.plan.results import EstimateResponse, GPUResult, Suggestion, WarningCode
from estimator.plan.search import bisect
from estimator.plan.steps import Steps, StepSource

if TYPE_CHECKING:
    from estimator.plan.answer import SourceFor

_WORLD = "training.distributed.world_size"


class Worlds:
    """The steps of one job over world sizes: ``base`` changes (a strategy) and each world size's."""

    def __init__(self, source_for: SourceFor, reserve_bytes: int, strategy: str, *,
                 base: Mapping[str, Any] | None = None, first: StepSource | None = None) -> None:
        self.source_for = source_for
        self.reserve_bytes = reserve_bytes
        self.strategy = strategy
        self.base = dict(base or {})
        self._steps: dict[int, Steps] = {} if first is None else {1: Steps(first, reserve_bytes)}

    def steps(self, world_size: int) -> Steps:
        if world_size not in self._steps:
            source = self.source_for({**self.base, _WORLD: world_size})
            self._steps[world_size] = Steps(source, self.reserve_bytes)
        return self._steps[world_size]

    def fits(self, world_size: int, card: GPU, batch: int) -> bool:
        return self.steps(world_size).report(batch, card).fits

    def min_world(self, card: GPU, batch: int, limit: int = MAX_WORLD_SIZE, least: int = 1) -> int | None:
        """The fewest ranks (``least`` to ``limit``) at which ``batch`` fits ``card``; None when not even
        ``limit`` do."""
        if least == 1:
            if self.fits(1, card, batch):
                return 1
            if self.strategy == "ddp":
                return None  # every rank holds the whole step
            lo, hi = 1, 2
        else:
            lo, hi = least - 1, least
        while not self.fits(hi, card, batch):
            if hi >= limit:
                return None
            lo, hi = hi, min(2 * hi, limit)
        # the largest world in [lo, hi) that does not fit, and one more
        return bisect(lambda w: not self.fits(w, card, batch), lo, hi) + 1

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self._steps.values())


def answer_auto(source_for: SourceFor, source: StepSource, cards: list[GPU], options: PlanOptions,
                t0: float) -> EstimateResponse:
    """``world_size: "auto"``: per card the fewest ranks at which the smallest batch (or ``batch_size``) fits,
    and the answer there; ``source`` is the step of one rank."""
    worlds = Worlds(source_for, options.reserve_bytes, options.strategy, first=source)
    notes = Notes()
    start = smallest_batch(worlds.steps(1), cards[0], notes)
    if options.batch_size is not None and options.batch_size < start:
        raise SpecError("batch_size", options.batch_size, f"at least {start}")
    at = options.batch_size or start  # the fewest ranks at which this batch fits
    chosen = [worlds.min_world(card, at) for card in cards]
    # a card no world fits is answered at the largest world tried (one rank for DDP, which shards nothing)
    unfit = 1 if options.strategy == "ddp" else MAX_WORLD_SIZE
    groups: dict[int, list[int]] = {}
    for i, world in enumerate(chosen):
        groups.setdefault(world or unfit, []).append(i)
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
            results[i] = dataclasses.replace(result, min_world_size=chosen[i])
    first = parts[chosen[0] or unfit]
    assumptions: list[str] = []
    for part in parts.values():
        assumptions.extend(a for a in part.assumptions if a not in assumptions)
    assumptions.append(f"world_size 'auto': per card the fewest ranks (1 to {MAX_WORLD_SIZE}) at which batch "
                       f"{at} fits, found by doubling then bisection on full simulations of one rank"
                       + ("; DDP keeps the whole step on every rank, so only one rank is tried"
                          if options.strategy == "ddp" else ""))
    for card, world in zip(cards, chosen, strict=True):
        if world is None:
            merged.drop(WarningCode.DOES_NOT_FIT, card=card.name)
            across = "on one rank: DDP keeps the whole step on every rank" if options.strategy == "ddp" else \
                f"over {MAX_WORLD_SIZE} ranks of {options.strategy}"
            merged.add(WarningCode.DOES_NOT_FIT, f"{worlds.steps(1).model.name} does not fit "
                       f"on {card.name} at batch {at} even {across}", card=card.name, batch=at)
    return dataclasses.replace(first, results=[r for r in results if r is not None], assumptions=assumptions,
                               warnings=merged.warnings(), provenance=provenance(worlds.simulations, t0))


class Suggester:
    """Changes with which the smallest batch fits a card that a single-GPU step does not fit, cheapest first,
    each checked by a full simulation. The order: gradient checkpointing (recomputes the forward, about a third
    more compute), pure bf16 (half the bytes of every state), an optimizer without state (SGD without
    momentum), then FSDP over the fewest ranks that fit. The steps of each change are shared by the cards
    (cards that simulate alike share traces)."""

    def __init__(self, source_for: SourceFor, options: PlanOptions, batch: int) -> None:
        self.source_for = source_for
        self.batch = batch
        self.reserve_bytes = options.reserve_bytes
        levers = options.levers
        self.tries: list[tuple[dict[str, Any], str]] = []
        if not levers.checkpointing:
            self.tries.append(({"training.gradient_checkpointing": True}, "gradient checkpointing"))
        if levers.precision != "bf16":
            self.tries.append(({"training.precision": "bf16"}, "pure bf16 (weights, gradients and optimizer state)"))
        if not (levers.optimizer == "sgd" and not levers.momentum):
            self.tries.append(({"training.optimizer": {"name": "sgd"}}, "SGD without momentum (no optimizer state)"))
        self._steps: dict[int, Steps] = {}
        self.worlds = Worlds(source_for, options.reserve_bytes, "fsdp",
                             base={"training.distributed.strategy": "fsdp"})

    def _fits(self, i: int, card: GPU) -> bool:
        try:
            if i not in self._steps:
                self._steps[i] = Steps(self.source_for(self.tries[i][0]), self.reserve_bytes)
            return self._steps[i].report(self.batch, card).fits
        except SpecError:
            return False  # not applicable to this model (no blocks to checkpoint)

    def for_card(self, card: GPU) -> list[Suggestion]:
        out = [Suggestion(change, text) for i, (change, text) in enumerate(self.tries) if self._fits(i, card)]
        world = self.worlds.min_world(card, self.batch, least=2)  # one rank is the step that did not fit
        if world is not None:
            out.append(Suggestion({"training.distributed.strategy": "fsdp", _WORLD: world},
                                  f"FSDP (fully_shard per block) over {world} ranks"))
        return out

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self._steps.values()) + self.worlds.simulations


def with_suggestions(response: EstimateResponse, suggester: Suggester, cards: list[GPU], notes: Notes,
                     t0: float) -> EstimateResponse:
    """A single-GPU answer whose smallest batch does not fit some card, with what would make it fit, each change
    checked by a simulation; each such card's does-not-fit warning names the first (and the others)."""
    results = []
    for card, result in zip(cards, response.results, strict=True):
        if result.max_batch_size is not None:
            results.append(result)
            continue
        found = suggester.for_card(card)
        results.append(dataclasses.replace(result, suggestions=found))
        unfit = notes.find(WarningCode.DOES_NOT_FIT, card=card.name)
        if found and unfit is not None:
            notes.reword(unfit, f"{unfit.message}; it fits with {found[0].description}"
                         + (f" (or: {'; '.join(s.description for s in found[1:])})" if len(found) > 1 else ""))
    simulations = response.provenance.simulations + suggester.simulations
    return dataclasses.replace(response, results=results, warnings=notes.warnings(),
                               provenance=provenance(simulations, t0))

