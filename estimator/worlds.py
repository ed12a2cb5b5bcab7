"""World sizes: the fewest ranks at which a step fits, and what to change when one GPU is not enough.

>>> worlds = Worlds(built, request)                                        # doctest: +SKIP
>>> worlds.min_world(card, 1)        # FSDP: the fewest ranks at which batch 1 fits the card
4

Each world size is its own ``Simulator`` (sharded states shrink with the
ranks, the activations do not), built from the same model; a probe is one
full simulation of one rank at the smallest batch, shared by the cards that
simulate alike. Memory falls as ranks are added (FSDP shards parameters,
gradients and optimizer state, ZeRO-1 the optimizer state), so the search
doubles the world until the step fits, then bisects. DDP keeps everything on
every rank: more ranks never make it fit, so its only probe is one rank's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.models import BuiltModel
from estimator.plan.results import Suggestion
from estimator.request.adapt import recipe_of
from estimator.request.recipe import MAX_WORLD_SIZE, Distributed, Recipe
from estimator.request.spec import EstimateRequest
from estimator.sources import Progress, Simulator


class Worlds:
    """Simulators of one request's model over world sizes (``recipe``'s strategy, any number of ranks)."""

    def __init__(self, built: BuiltModel, request: EstimateRequest, progress: Progress | None = None,
                 recipe: Recipe | None = None) -> None:
        self.built = built
        self.request = request
        self.progress = progress
        self.recipe = recipe or recipe_of(request)
        self.sims: dict[int, Simulator] = {}

    def sim(self, world_size: int) -> Simulator:
        if world_size not in self.sims:
            d = self.recipe.distributed.at(world_size)
            recipe = dataclasses.replace(self.recipe, distributed=d)
            self.sims[world_size] = Simulator(self.built, recipe, self.progress, self.request.planner.reserve_bytes)
        return self.sims[world_size]

    def fits(self, world_size: int, card: GPU, batch: int) -> bool:
        return self.sim(world_size).report(batch, card).fits

    def min_world(self, card: GPU, batch: int, limit: int = MAX_WORLD_SIZE, least: int = 1) -> int | None:
        """The fewest ranks (``least`` to ``limit``) at which ``batch`` fits ``card``; None when not even
        ``limit`` do."""
        if least == 1:
            if self.fits(1, card, batch):
                return 1
            if self.recipe.distributed.strategy == "ddp":
                return None  # every rank holds the whole step
            lo, hi = 1, 2
        else:
            lo, hi = least - 1, least
        while not self.fits(hi, card, batch):
            if hi >= limit:
                return None
            lo, hi = hi, min(2 * hi, limit)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, card, batch):
                hi = mid
            else:
                lo = mid
        return hi

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self.sims.values())


class Suggester:
    """Changes with which the smallest batch fits a card that a single-GPU request's step does not fit,
    cheapest first, each checked by a full simulation. The order: gradient checkpointing (recomputes the
    forward, about a third more compute), pure bf16 (half the bytes of every state), an optimizer without
    state (SGD without momentum), then FSDP over the fewest ranks that fit. The simulators are shared by
    the cards (cards that simulate alike share traces)."""

    def __init__(self, built: BuiltModel, request: EstimateRequest, recipe: Recipe, batch: int,
                 progress: Progress | None = None) -> None:
        self.batch = batch
        reserve = request.planner.reserve_bytes
        tries: list[tuple[dict[str, Any], str, Recipe]] = []
        if not recipe.gradient_checkpointing:
            tries.append(({"training.gradient_checkpointing": True}, "gradient checkpointing",
                          dataclasses.replace(recipe, gradient_checkpointing=True)))
        if recipe.precision != "bf16":
            tries.append(({"training.precision": "bf16"}, "pure bf16 (weights, gradients and optimizer state)",
                          dataclasses.replace(recipe, precision="bf16")))
        if not (recipe.optimizer == "sgd" and not recipe.optimizer_kwargs.get("momentum")):
            tries.append(({"training.optimizer": {"name": "sgd"}}, "SGD without momentum (no optimizer state)",
                          dataclasses.replace(recipe, optimizer="sgd", optimizer_kwargs={})))
        self.tries = [(change, text, Simulator(built, changed, progress, reserve)) for change, text, changed in tries]
        fsdp = dataclasses.replace(recipe, distributed=Distributed("fsdp", 1))
        self.worlds = Worlds(built, request, progress, fsdp)

    def for_card(self, card: GPU) -> list[Suggestion]:
        out: list[Suggestion] = []
        for change, text, sim in self.tries:
            try:
                fits = sim.report(self.batch, card).fits
            except SpecError:
                fits = False  # not applicable to this model (no blocks to checkpoint)
            if fits:
                out.append(Suggestion(change, text))
        world = self.worlds.min_world(card, self.batch, least=2)  # one rank is the step that did not fit
        if world is not None:
            out.append(Suggestion({"training.distributed.strategy": "fsdp", "training.distributed.world_size": world},
                                  f"FSDP (fully_shard per block) over {world} ranks"))
        return out

    @property
    def simulations(self) -> int:
        return sum(sim.simulations for _, _, sim in self.tries) + self.worlds.simulations
