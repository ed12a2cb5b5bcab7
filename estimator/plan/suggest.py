"""What to change when one GPU recommends no batch: the levers a practitioner pulls, each checked by simulation.

>>> suggester = Suggester(source_for, options, start=1, text_model=True)   # doctest: +SKIP
>>> [s.description for s in suggester.for_card(get_gpu("A100-80GB"))]
['gradient checkpointing (...)', 'optimizer.foreach false (...)', 'FSDP (fully_shard per block) over 2 ranks']

A lever lands on a card when the smallest batch fits there with the
planner's headroom (the recommendation's test, a replay of the same
simulation), so applying it gives a ``recommended_batch_size``; each
suggestion then reports the max and recommended batch it reaches. The levers,
cheapest first: gradient checkpointing (recomputes the forward), the
optimizer one parameter at a time (``foreach: false``: no parameter-sized
temporaries at the step), pure bf16 (half the bytes of every state), an
optimizer with less state (Adafactor for a text model, SGD without momentum
for others), and for a transformers model the changes of method (``changes_method``: each trains another way,
which the user must judge): 8-bit AdamW, LoRA, QLoRA; then FSDP over the fewest ranks at which a batch is
recommended. When no single lever lands, their cumulative stack is tried
(checkpointing + foreach off + bf16 + ...), and FSDP with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from estimator.errors import SimulationError, SpecError
from estimator.gpus import GPU
from estimator.options import PlanOptions
from estimator.plan.answer import provenance
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse, Suggestion, WarningCode
from estimator.plan.steps import Steps
from estimator.plan.strategy import headroom_card, max_batches, recommend
from estimator.plan.worlds import WORLD, Worlds

if TYPE_CHECKING:
    from estimator.plan.answer import SourceFor

# the adapters and the 4-bit base the method levers suggest (peft's LoraConfig, transformers' BitsAndBytesConfig)
LORA = {"method": "lora", "r": 16, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"}
QLORA = {"method": "bnb-4bit", "quant_type": "nf4", "double_quant": True, "compute_dtype": "bf16"}
FOREACH_OPTIMIZERS = frozenset({"sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor"})


@dataclass(frozen=True)
class Lever:
    """One change to the request; ``method``: it trains another way, not only with another recipe."""

    change: Mapping[str, Any]
    text: str
    method: bool = False


def levers(options: PlanOptions, text_model: bool) -> list[Lever]:
    """The recipe's levers that the request has not pulled yet, cheapest first."""
    pulled = options.levers
    out = []
    if not pulled.checkpointing:
        out.append(Lever({"training.gradient_checkpointing": True},
                         "gradient checkpointing (recomputes the forward in backward: about a third more compute)"))
    if pulled.optimizer in FOREACH_OPTIMIZERS and pulled.foreach is not False:
        out.append(Lever({"training.optimizer.foreach": False}, "optimizer.foreach false (the step updates one "
                         "parameter at a time: no parameter-sized temporaries, a slower step)"))
    if pulled.precision != "bf16":
        out.append(Lever({"training.precision": "bf16"}, "pure bf16 (weights, gradients and optimizer state in "
                         "bf16: half the bytes, no fp32 master weights)"))
    if text_model and pulled.optimizer != "adafactor":
        out.append(Lever({"training.optimizer.name": "adafactor"}, "Adafactor (factored second moments: a "
                         "fraction of Adam's state)"))
    if not text_model and not (pulled.optimizer == "sgd" and not pulled.momentum):
        out.append(Lever({"training.optimizer": {"name": "sgd"}}, "SGD without momentum (no optimizer state)"))
    if pulled.adaptable and pulled.optimizer in ("adam", "adamw"):
        out.append(Lever({"training.optimizer": {"name": "adamw8bit"}}, "8-bit AdamW (bitsandbytes' block-wise "
                         "8-bit state: about 2 B a parameter instead of 8; another optimizer, to be validated on the "
                         "task)", method=True))
    if pulled.adaptable and not pulled.peft:
        out.append(Lever({"model.peft": LORA}, "LoRA r=16 on every linear layer (adapters train, the base is "
                         "frozen: fine-tuning by another method, not the same training)", method=True))
    if pulled.adaptable and not pulled.quantized:
        adapters = {} if pulled.peft else {"model.peft": LORA}  # the request's own adapters, else LoRA's
        out.append(Lever({**adapters, "model.quantization": QLORA}, "QLoRA: LoRA r=16 on an NF4 base (bitsandbytes "
                         "4-bit, double quant; another method, with the quantization's error)", method=True))
    return out


def stacked(chosen: list[Lever]) -> Lever:
    """The levers pulled together: their changes in one, their words joined."""
    change: dict[str, Any] = {}
    for lever in chosen:
        for path, value in lever.change.items():
            if path == "training.optimizer":  # a whole optimizer section keeps the options set before it
                within = {k: v for k, v in change.items() if k.startswith("training.optimizer.")}
                value = {**{k.rsplit(".", 1)[1]: v for k, v in within.items()}, **value}
                change = {k: v for k, v in change.items() if k not in within}
            change[path] = value
    return Lever(change, " + ".join(lever.text.split(" (")[0] for lever in chosen), any(x.method for x in chosen))


class Suggester:
    """Checked changes for the cards of one answer that recommend no batch; the steps of each change are shared
    by the cards (cards that simulate alike share traces)."""

    def __init__(self, source_for: SourceFor, options: PlanOptions, start: int, text_model: bool) -> None:
        self.source_for, self.options, self.start = source_for, options, start
        self.levers = levers(options, text_model)
        self._steps: dict[str, Steps] = {}
        self._worlds: dict[str, Worlds] = {}
        self._refused: set[str] = set()  # the levers this job cannot take (no blocks to checkpoint)

    def _of(self, lever: Lever) -> Steps | None:
        key = _key(lever)
        if key in self._refused:
            return None
        if key not in self._steps:
            try:
                self._steps[key] = Steps(self.source_for(lever.change), self.options.reserve_bytes)
            except SpecError:
                self._refused.add(key)
                return None  # a change this job cannot take
        return self._steps[key]

    def _taken(self) -> list[Lever]:
        """The levers not refused by this job so far."""
        return [lever for lever in self.levers if _key(lever) not in self._refused]

    def _lands(self, lever: Lever, card: GPU) -> bool:
        """A batch is recommended with ``lever``: the smallest fits within the headroom."""
        steps = self._of(lever)
        if steps is None:
            return False
        try:
            return steps.fits(self.start, headroom_card(card, steps.reserve_bytes, self.options.headroom))
        except SpecError:
            self._refused.add(_key(lever))
            return False  # not applicable to this model (no blocks to checkpoint)

    def _suggestion(self, lever: Lever, card: GPU) -> Suggestion:
        steps = self._of(lever)
        assert steps is not None  # it landed
        best, rec = self._batches(steps, card)
        return Suggestion(dict(lever.change), lever.text, best, rec, changes_method=lever.method)

    def _batches(self, steps: Steps, card: GPU) -> tuple[int | None, int | None]:
        """The max and recommended batch of a change on ``card``. When the full step one past the smallest
        batch does not fit, the max is the smallest without a search: the search's affine fit would simulate one
        batch further only to find the same (a fit through ``start`` is rejected where the step takes other paths
        there, as a model with LoRA's adapters does)."""
        if steps.can_confirm and steps.fits(self.start, card) and not steps.fits(self.start + 1, card):
            best: int | None = self.start
        else:
            (best, _), = max_batches(steps, [card], self.start, self.options.confirm, Notes())
        rec, _, _ = recommend(steps, card, self.start, best, self.options.headroom, align=self.options.align)
        return best, rec

    def _worlds_of(self, base: Lever) -> Worlds:
        key = _key(base)
        if key not in self._worlds:
            self._worlds[key] = Worlds(self.source_for, self.options.reserve_bytes, "fsdp",
                                       base={**base.change, "training.distributed.strategy": "fsdp"})
        return self._worlds[key]

    def _fsdp(self, chosen: list[Lever], card: GPU) -> Suggestion | None:
        """FSDP (with the ``chosen`` levers) over the fewest ranks (2 to 1024) at which a batch is recommended;
        then, at that world, the levers it does not need dropped (the last first: the most expensive). A stack
        whose step cannot run under FSDP (torch's Adafactor raises on a sharded parameter's norm) is tried without
        its last lever, down to none (FSDP alone, which ``for_card`` tried first)."""
        try:
            world = self._worlds_of(stacked(chosen)).min_world(card, self.start, least=2,
                                                               headroom=self.options.headroom)
        except SpecError:
            return None  # a lever this job cannot take under FSDP
        except SimulationError:
            if not chosen:
                raise  # FSDP alone: not a lever's doing
            return self._fsdp(chosen[:-1], card) if len(chosen) > 1 else None
        if world is None:
            return None
        kept = list(chosen)
        for lever in reversed(chosen):
            fewer = [x for x in kept if x is not lever]
            try:
                if self._worlds_of(stacked(fewer)).fits(world, card, self.start, self.options.headroom):
                    kept = fewer
            except SimulationError:
                continue  # without it the step cannot run under FSDP: kept
        base = stacked(kept)
        best, rec = self._batches(self._worlds_of(base).steps(world), card)
        words = f"FSDP (fully_shard per block) over {world} ranks" + (f" + {base.text}" if base.change else "")
        change = {**base.change, "training.distributed.strategy": "fsdp", WORLD: world}
        return Suggestion(change, words, best, rec, world, changes_method=base.method)

    def for_card(self, card: GPU) -> list[Suggestion]:
        """The checked changes for ``card``, cheapest first: each single recipe lever that lands, else their first
        stack that does; then each change of method that lands; then FSDP over the fewest ranks (with the recipe's
        stack when FSDP alone is not enough)."""
        landed = [lever for lever in self._rolling(self.levers, card, self.start) if self._lands(lever, card)]
        out = [self._suggestion(lever, card)
               for lever in self._rolling([x for x in landed if not x.method], card, self.start + 1)]
        # stacks combine the recipe's levers; a change of method is offered on its own, after them
        taken = [lever for lever in self._taken() if not lever.method]
        if not out:
            for n in range(2, len(taken) + 1):
                stack = stacked(taken[:n])
                if self._lands(stack, card):
                    out.append(self._suggestion(stack, card))
                    break
        fsdp = self._fsdp([], card)
        if fsdp is None and not out and len(taken) > 1:
            fsdp = self._fsdp(taken, card)
        methods = [self._suggestion(lever, card)
                   for lever in self._rolling([x for x in landed if x.method], card, self.start + 1)]
        return out + methods + ([fsdp] if fsdp is not None else [])

    def _rolling(self, chosen: list[Lever], card: GPU, batch: int) -> Iterator[Lever]:
        """``chosen`` in order, the next one's step at ``batch`` started in a forked child while the caller works
        on this one (estimator/simulate/background.py): the levers' steps are independent, and a second core
        simulates the next while the first searches this one."""
        for i, lever in enumerate(chosen):
            if i + 1 < len(chosen):
                self._prefetch(chosen[i + 1], card, batch)
            yield lever

    def _prefetch(self, lever: Lever, card: GPU, batch: int) -> None:
        steps = self._of(lever)
        prefetch = getattr(steps.source, "prefetch", None) if steps is not None else None
        if steps is not None and prefetch is not None and (batch, steps.signature(card)) not in steps.traces:
            prefetch(batch, headroom_card(card, steps.reserve_bytes, self.options.headroom))

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self._steps.values()) + sum(w.simulations for w in self._worlds.values())


def _key(lever: Lever) -> str:
    return repr(sorted(lever.change.items()))


def _words(s: Suggestion) -> str:
    per = " per rank" if s.world_size > 1 else ""
    return f"{s.description} (max {s.max_batch_size}, recommended {s.recommended_batch_size}{per})"


def with_suggestions(response: EstimateResponse, suggester: Suggester, cards: list[GPU], notes: Notes,
                     t0: float) -> EstimateResponse:
    """A single-GPU answer with what would give each card that recommends no batch a recommended one; each such
    card's warning names the first change (and the others) and the batches they reach."""
    results = []
    for card, result in zip(cards, response.results, strict=True):
        if result.recommended_batch_size is not None:
            results.append(result)
            continue
        found = suggester.for_card(card)
        results.append(dataclasses.replace(result, suggestions=found))
        unfit = result.max_batch_size is None
        entry = notes.find(WarningCode.DOES_NOT_FIT if unfit else WarningCode.NO_RECOMMENDATION, card=card.name)
        if found and entry is not None:
            lead = "it fits with" if unfit else "a batch is recommended with"
            others = f" (or: {'; '.join(_words(s) for s in found[1:])})" if len(found) > 1 else ""
            notes.reword(entry, f"{entry.message}; {lead} {_words(found[0])}{others}")
    simulations = response.provenance.simulations + suggester.simulations
    return dataclasses.replace(response, results=results, warnings=notes.warnings(),
                               provenance=provenance(simulations, t0))
