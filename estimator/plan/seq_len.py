"""The largest ``seq_len`` that fits at one batch, per card (``planner.max_seq_len``).

>>> search = SeqLenSearch(source_for, reserve_bytes=0, batch=1, limit=8192)       # doctest: +SKIP
>>> search.max_seq_len(get_gpu("A100-80GB"))
6144

By bisection on full simulations: memory is not affine in the sequence
length (attention scores grow with its square on the math backend), so each
length probed is its own job, built again by the caller's ``source_for``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.plan.answer import provenance
from estimator.plan.results import EstimateResponse
from estimator.plan.search import max_fitting
from estimator.plan.steps import Steps

if TYPE_CHECKING:
    from estimator.plan.answer import SourceFor

# The longest sequence probed for a model without a position table.
NO_TABLE_LIMIT = 2**17


class SeqLenSearch:
    """Steps per sequence length at one batch; cards that simulate alike share them."""

    def __init__(self, source_for: SourceFor, reserve_bytes: int, batch: int, limit: int) -> None:
        self.source_for, self.reserve_bytes, self.batch, self.limit = source_for, reserve_bytes, batch, limit
        self._steps: dict[int, Steps] = {}

    def fits(self, seq: int, card: GPU) -> bool:
        if seq not in self._steps:
            self._steps[seq] = Steps(self.source_for({"input.seq_len": seq}), self.reserve_bytes)
        return self._steps[seq].fits(self.batch, card)

    def max_seq_len(self, card: GPU) -> int | None:
        return max_fitting(lambda seq: self.fits(seq, card), self.limit)

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self._steps.values())


def with_max_seq_len(response: EstimateResponse, source_for: SourceFor, steps: Steps, cards: list[GPU], batch: int,
                     t0: float) -> EstimateResponse:
    """``response`` with each card's ``max_seq_len`` at ``batch`` (the request's ``batch_size`` or the smallest)."""
    if "seq_len" not in steps.model.input:
        raise SpecError("planner.max_seq_len", True, "a text model (one with input.seq_len)")
    search = SeqLenSearch(source_for, steps.reserve_bytes, batch, steps.model.max_seq_len or NO_TABLE_LIMIT)
    results = [dataclasses.replace(r, max_seq_len=search.max_seq_len(card))
               for card, r in zip(cards, response.results, strict=True)]
    return dataclasses.replace(response, results=results, provenance=provenance(
        response.provenance.simulations + search.simulations, t0))
