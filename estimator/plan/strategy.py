"""Which card is searched how: the max batch and the recommendation for every card of a request.

Cards whose steps share a trace (the same attention backends and kernel
thresholds) form a group and are searched together by replays of one affine
trace (``estimator.plan.affine``), confirmed as ``ConfirmMode`` says; a step
that is not affine in the batch is searched with full simulations alone. The
searches themselves are ``estimator.plan.search``'s; where the steps come from
(full simulations, or a portable profile) is a ``StepSource``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from enum import StrEnum
from typing import Protocol

from estimator.gpus import GPU
from estimator.plan.affine import AffineTrace
from estimator.plan.replays import Step
from estimator.plan.results import Note, Search, SearchMethod, WarningCode
from estimator.plan.search import MAX_BATCH, aligned_within, headroom_capacity, max_batch, max_batch_between
from estimator.replay.allocator import ReplayResult
from estimator.replay.report import MemoryReport


class ConfirmMode(StrEnum):
    """How the affine trace's answers are confirmed by full simulations (``planner.confirm``)."""

    TOP = "top"  # one full simulation per group, just past its largest max, must equal the synthesized step
    EVERY_CARD = "every-card"  # full simulations at every card's max and max + 1
    NONE = "none"  # the fit is checked at one more batch only


class StepSource(Protocol):
    """Where a card's steps come from: full simulations (``estimator.sources.Simulator``) or a portable
    profile (``estimator.sources.ProfileReplayer``)."""

    reserve_bytes: int
    can_confirm: bool  # whether full simulations can check an answer

    @property
    def simulations(self) -> int: ...

    def signature(self, gpu: GPU) -> Hashable:
        """Cards with the same signature get the same step."""

    def report(self, batch: int, gpu: GPU) -> MemoryReport:
        """The report of the step at ``batch`` (a full simulation where the source has one)."""

    def report_fast(self, batch: int, gpu: GPU) -> MemoryReport:
        """``report``, from a checked affine trace where one is known."""

    def profile(self, start: int, gpu: GPU) -> AffineTrace | None:
        """The checked affine trace from ``start`` on; None when the step is not affine in the batch."""

    def known_profile(self, gpu: GPU) -> AffineTrace | None: ...

    def candidates(self, start: int, gpu: GPU) -> Iterator[AffineTrace]:
        """Affine fits to check, in order."""

    def check(self, profile: AffineTrace, batch: int, gpu: GPU) -> bool:
        """Whether a full simulation at ``batch`` is exactly what ``profile`` synthesizes."""

    def replay(self, step: Step, batch: int, gpu: GPU, capped: bool = True) -> ReplayResult: ...

    def flops(self, batch: int, gpu: GPU, start: int) -> int: ...


Answer = tuple[int | None, Search]


def max_batches(source: StepSource, cards: list[GPU], start: int, confirm: ConfirmMode,
                warnings: list[Note]) -> list[Answer]:
    """(max batch, how it was found) per card; cards whose steps share a trace are searched together."""
    answers: list[Answer | None] = [None] * len(cards)
    groups: dict[Hashable, list[int]] = {}
    for i, card in enumerate(cards):
        if not source.report(start, card).fits:
            answers[i] = (None, Search(SearchMethod.FULL))
        else:
            groups.setdefault(source.signature(card), []).append(i)
    for members in groups.values():
        found = _search_group(source, [cards[i] for i in members], start, confirm, warnings)
        for i, answer in zip(members, found, strict=True):
            answers[i] = answer
    return [a for a in answers if a is not None]


def _search_group(source: StepSource, cards: list[GPU], start: int, confirm: ConfirmMode,
                  warnings: list[Note]) -> list[Answer]:
    """Replays of one affine trace for every card of a group, confirmed as ``confirm`` says.

    TOP: one full simulation just past the group's largest max must record
    exactly the step the affine trace synthesizes there; the trace is then
    exact at four batches spanning every answer of the group (the two it
    was fitted through, the top, and the smaller cards' answers lie between).
    """
    first = cards[0]
    names = ", ".join(c.name for c in cards)
    if confirm != ConfirmMode.TOP or not source.can_confirm:
        profile = source.profile(start, first)
        if profile is None:
            warnings.append(Note(WarningCode.NOT_AFFINE, f"{names}: the step's ops or sizes change with the batch; "
                                 "searched with full simulations"))
            return [_full_search(source, card, start) for card in cards]
        bests = _replay_searches(source, profile, cards, start)
        if confirm == ConfirmMode.EVERY_CARD and source.can_confirm:
            return [_confirm_card(source, card, best, start, warnings) for card, best in zip(cards, bests, strict=True)]
        return [(best, Search(SearchMethod.AFFINE)) for best in bests]
    checked: list[int] = []
    for profile in source.candidates(start, first):
        bests = _replay_searches(source, profile, cards, start)
        top = min(max(bests) + 1, MAX_BATCH)
        if source.check(profile, top, first):
            return [(best, Search(SearchMethod.AFFINE_CHECKED, top)) for best in bests]
        checked.append(top)
    if checked:
        warnings.append(Note(WarningCode.CHECK_DIFFERS, f"{names}: a full simulation at batch {checked[-1]} differs "
                             "from the affine trace (the step's ops or sizes change with the batch); searched with "
                             "full simulations"))
    else:
        warnings.append(Note(WarningCode.NOT_AFFINE, f"{names}: the step's ops or sizes change with the batch; "
                             "searched with full simulations"))
    return [_full_search(source, card, start) for card in cards]


def _replay_searches(source: StepSource, profile: AffineTrace, cards: list[GPU], start: int) -> list[int]:
    bests, gap = [], 2
    for card in cards:
        best, gap = replay_search(source, profile, card, start, gap)
        bests.append(best)
    return bests


def replay_search(source: StepSource, profile: AffineTrace, card: GPU, start: int, gap: int = 2) -> tuple[int, int]:
    """(max batch on ``card`` by replays of ``profile``, how far below the bound it lies); the step fits
    at ``start``.

    The requested bytes live at once bound the answer from above (the
    allocator's blocks are never smaller than requests), and closely: the
    allocator frees its cache and retries before it fails, so the answer is
    a few batches below the bound, about as far as on the group's previous
    card (``gap``). Probes gallop out from there.
    """
    capacity, workspace = card.usable_bytes(source.reserve_bytes), card.cublas_workspace_bytes
    upper = max(profile.live_bound(capacity, workspace, MAX_BATCH), start)
    # upper + 1 cannot fit (or is past MAX_BATCH)
    best = max_batch_between(lambda b: source.replay(profile, b, card).fits, start, upper + 1, upper - gap)
    return best, upper - best


def _full_search(source: StepSource, card: GPU, start: int) -> Answer:
    def full(b: int) -> tuple[bool, int]:
        r = source.report(b, card)
        return r.fits, r.allocated_peak_bytes

    return max_batch(full, card.usable_bytes(source.reserve_bytes), start=start), Search(SearchMethod.FULL)


def _confirm_card(source: StepSource, card: GPU, best: int, start: int, warnings: list[Note]) -> Answer:
    """Full simulations at ``best`` and ``best + 1`` on the card; a full search when they disagree."""
    if source.report(best, card).fits and (best == MAX_BATCH or not source.report(best + 1, card).fits):
        return best, Search(SearchMethod.AFFINE_CONFIRMED)
    warnings.append(Note(WarningCode.CONFIRMATION_DIFFERS, f"{card.name}: full simulations disagree with the affine "
                         f"trace at batch {best}; searched again"))
    return _full_search(source, card, start)


def headroom_card(card: GPU, reserve_bytes: int, headroom: float) -> GPU:
    """``card`` as the recommendation sees it: an allocator held to ``headroom_capacity``."""
    capacity = headroom_capacity(card.usable_bytes(reserve_bytes), card.context_bytes, headroom)
    return dataclasses.replace(card, memory_bytes=capacity + card.context_bytes + reserve_bytes)


def recommend(source: StepSource, card: GPU, start: int, best: int | None, headroom: float, align: bool,
              gap: int = 2) -> tuple[int | None, GPU, int]:
    """(The largest batch, aligned, that fits with the allocator held to (1 - headroom) of the usable memory
    less the CUDA context; the card as that replay sees it; how far below its live-bytes bound the answer
    lay, where the next card's search starts). Monotone like the max: the same searches."""
    shrunk = headroom_card(card, source.reserve_bytes, headroom)
    if best is None:
        return None, shrunk, gap

    def fits(b: int) -> bool:
        return source.report_fast(b, shrunk).fits

    if not fits(start):
        return None, shrunk, gap
    profile = source.known_profile(card)
    if profile is not None and profile.min_batch <= start + 1:  # replays from the live-bytes bound, as the max
        room, gap = replay_search(source, profile, shrunk, start, gap)
        room = min(room, best)
    else:
        guess = start + int((best - start) * (1 - headroom))
        room = best if fits(best) else max_batch_between(fits, start, best, guess)
    return aligned_within(fits, room, align), shrunk, gap
