"""Which card is searched how: the max batch and the recommendation for every card of a request.

Cards whose steps share a trace (the same attention backends and kernel
thresholds) form a group and are searched together by replays of one affine
trace (``estimator.plan.affine``), confirmed as ``ConfirmMode`` says; a step
that is not affine in the batch is searched with full simulations alone. The
searches themselves are ``estimator.plan.search``'s; where the steps come from
(full simulations, or a portable profile) are ``estimator.plan.steps.Steps``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from estimator.gpus import GPU
from estimator.options import MAX_BATCH, ConfirmMode
from estimator.plan.advice import curve_batches
from estimator.plan.notes import Notes
from estimator.plan.periodic import NotPeriodic
from estimator.plan.results import Search, SearchMethod, WarningCode
from estimator.plan.search import aligned_within, headroom_capacity, max_batch, max_batch_between, recommended
from estimator.plan.steps import Fitted, Steps
from estimator.replay.report import MemoryReport

Answer = tuple[int | None, Search]


@dataclasses.dataclass(frozen=True)
class Recommending:
    """How the recommendations will be searched (``recommend``'s headroom and alignment): what the replays run
    ahead of them need."""

    headroom: float
    align: bool = True
    curve_points: int = 0  # each card's memory curve (``advise``): its batches' replays run ahead too


def max_batches(steps: Steps, cards: list[GPU], start: int, confirm: ConfirmMode,
                notes: Notes, ahead: Recommending | None = None) -> list[Answer]:
    """(max batch, how it was found) per card; cards whose steps share a trace are searched together. With
    ``ahead``, the replays the recommendations will ask for run while the top check simulates
    (``_while_checking``)."""
    answers: list[Answer | None] = [None] * len(cards)
    groups: dict[Hashable, list[int]] = {}
    for i, card in enumerate(cards):
        if not steps.report(start, card).fits:
            answers[i] = (None, Search(SearchMethod.FULL if steps.can_confirm else SearchMethod.PROFILE))
        else:
            groups.setdefault(steps.signature(card), []).append(i)
    for members in groups.values():
        found = _search_group(steps, [cards[i] for i in members], start, confirm, notes, ahead)
        for i, answer in zip(members, found, strict=True):
            answers[i] = answer
    return [a for a in answers if a is not None]


def _search_group(steps: Steps, cards: list[GPU], start: int, confirm: ConfirmMode,
                  notes: Notes, ahead: Recommending | None = None) -> list[Answer]:
    """Replays of one affine trace for every card of a group, confirmed as ``confirm`` says.

    TOP: one full simulation just past the group's largest max must record
    exactly the step the affine trace synthesizes there; the trace is then
    exact at four batches spanning every answer of the group (the two it
    was fitted through, the top, and the smaller cards' answers lie between).
    """
    first = cards[0]
    names = ", ".join(c.name for c in cards)
    if confirm != ConfirmMode.TOP or not steps.can_confirm:
        profile = steps.affine(start, first)
        if profile is None:
            notes.add(WarningCode.NOT_AFFINE, f"{names}: the step's ops or sizes change with the batch; searched "
                      "with full simulations")
            return [_full_search(steps, card, start) for card in cards]
        bests = _replay_searches(steps, profile, cards, start)
        if confirm == ConfirmMode.EVERY_CARD and steps.can_confirm:
            return [_confirm_card(steps, card, best, start, notes) for card, best in zip(cards, bests, strict=True)]
        method = SearchMethod.AFFINE if steps.can_confirm else SearchMethod.PROFILE  # a profile simulates nothing
        return [(best, Search(method)) for best in bests]
    checked: list[int] = []
    for profile in steps.candidates(start, first):
        beside = None  # the batch simulated beside the replays
        try:
            if len(cards) > 1:  # the check at the widest card's max + 1, simulated beside the other cards' replays
                widest = max(cards, key=lambda c: c.usable_bytes(steps.reserve_bytes))
                beside = min(replay_search(steps, profile, widest, start)[0] + 1, MAX_BATCH)
                steps.prefetch(beside, first)
            bests = _replay_searches(steps, profile, cards, start)
        except NotPeriodic:  # a growing trace's live bound past what it synthesizes: full simulations
            continue
        top = min(max(bests) + 1, MAX_BATCH)
        if ahead is not None and top == beside:
            _while_checking(steps, profile, cards, start, bests, ahead)
        if steps.check(profile, top, first):
            return [(best, Search(SearchMethod.AFFINE_CHECKED, top)) for best in bests]
        checked.append(top)
    if checked:
        notes.add(WarningCode.CHECK_DIFFERS, f"{names}: a full simulation at batch {checked[-1]} differs from "
                  "the affine trace (the step's ops or sizes change with the batch); searched with full simulations")
    else:
        notes.add(WarningCode.NOT_AFFINE, f"{names}: the step's ops or sizes change with the batch; searched with "
                  "full simulations")
    return [_full_search(steps, card, start) for card in cards]


def _while_checking(steps: Steps, profile: Fitted, cards: list[GPU], start: int, bests: list[int],
                    ahead: Recommending) -> None:
    """The replays of ``profile`` that each card's recommendation (``recommend``) searches by, and its memory
    curve's, run while the top check simulates in a child: cached, they answer ``recommend`` and ``advise`` at
    once once the check holds (the same replays, so the same answers; wasted where it does not). Only replays:
    nothing here may simulate."""
    if profile.min_batch > start + 1:
        return  # recommend searches otherwise
    gap = 2
    for card, best in zip(cards, bests, strict=True):
        shrunk = headroom_card(card, steps.reserve_bytes, ahead.headroom)
        # recommend's first question, of the full step at ``start`` (simulated: a report of it simulates nothing)
        if start not in steps.simulated(shrunk) or not steps.report(start, shrunk, exact=False).fits:
            continue
        room, gap = replay_search(steps, profile, shrunk, start, gap)
        room = min(room, best)
        aligned = recommended(room, ahead.align)
        if aligned is not None and aligned != room:  # the multiple of 8 it asks about first
            steps.replay(profile, aligned, shrunk)
    if ahead.curve_points:  # each card's curve (``advise``): the points below its max, where no full step is known
        for card, best in zip(cards, bests, strict=True):
            simulated = steps.simulated(card)
            for b in curve_batches(start, best, ahead.curve_points):
                if b not in simulated:
                    steps.replay(profile, b, card)


def _replay_searches(steps: Steps, profile: Fitted, cards: list[GPU], start: int) -> list[int]:
    bests, gap = [], 2
    for card in cards:
        best, gap = replay_search(steps, profile, card, start, gap)
        bests.append(best)
    return bests


def replay_search(steps: Steps, profile: Fitted, card: GPU, start: int, gap: int = 2) -> tuple[int, int]:
    """(max batch on ``card`` by replays of ``profile``, how far below the bound it lies); the step fits
    at ``start``.

    The requested bytes live at once bound the answer from above (the
    allocator's blocks are never smaller than requests), and closely: the
    allocator frees its cache and retries before it fails, so the answer is
    a few batches below the bound, about as far as on the group's previous
    card (``gap``). Probes gallop out from there.
    """
    capacity, workspace = card.usable_bytes(steps.reserve_bytes), card.cublas_workspace_bytes
    upper = max(profile.live_bound(capacity, workspace, MAX_BATCH), start)
    # upper + 1 cannot fit (or is past MAX_BATCH)
    best = max_batch_between(lambda b: steps.replay(profile, b, card).fits, start, upper + 1, upper - gap)
    return best, upper - best


def _full_search(steps: Steps, card: GPU, start: int) -> Answer:
    def full(b: int) -> tuple[bool, int]:
        r = _probe(steps, b, card)
        return r.fits, r.allocated_peak_bytes

    return max_batch(full, card.usable_bytes(steps.reserve_bytes), start=start), Search(SearchMethod.FULL)


def _probe(steps: Steps, b: int, card: GPU, ahead: int | None = None) -> MemoryReport:
    """The full step's report at ``b`` on ``card``; when ``b`` is a new simulation, the one at ``ahead`` (``b + 1``:
    a search whose probe fits asks there next, when its guess was good) starts beside it (``Steps.prefetch``)."""
    if b not in steps.simulated(card):
        steps.prefetch(b + 1 if ahead is None else ahead, card, keep=b)
    return steps.report(b, card)


def _confirm_card(steps: Steps, card: GPU, best: int, start: int, notes: Notes) -> Answer:
    """Full simulations at ``best`` and ``best + 1`` on the card; a full search when they disagree."""
    if steps.report(best, card).fits and (best == MAX_BATCH or not steps.report(best + 1, card).fits):
        return best, Search(SearchMethod.AFFINE_CONFIRMED)
    notes.add(WarningCode.CONFIRMATION_DIFFERS, f"{card.name}: full simulations disagree with the affine trace at "
              f"batch {best}; searched again", card=card.name, batch=best)
    return _full_search(steps, card, start)


def headroom_card(card: GPU, reserve_bytes: int, headroom: float) -> GPU:
    """``card`` as the recommendation sees it: an allocator held to ``headroom_capacity`` (the same card to
    torch.cuda, so the same simulated step)."""
    capacity = headroom_capacity(card.usable_bytes(reserve_bytes), card.context_bytes, headroom)
    return dataclasses.replace(card, allocator_bytes=capacity)


def recommend(steps: Steps, card: GPU, start: int, best: int | None, headroom: float, *, align: bool = True,
              gap: int = 2) -> tuple[int | None, GPU, int]:
    """(The largest batch, aligned, that fits with the allocator held to (1 - headroom) of the usable memory
    less the CUDA context; the card as that replay sees it; how far below its live-bytes bound the answer
    lay, where the next card's search starts). Monotone like the max: the same searches."""
    shrunk = headroom_card(card, steps.reserve_bytes, headroom)
    if best is None:
        return None, shrunk, gap

    profile = steps.known_affine(card)

    def fits(b: int) -> bool:
        if profile is None:  # full simulations; beside b, the multiple of 8 below it that the answer would take
            down = recommended(b, align)
            return _probe(steps, b, shrunk, ahead=down if down != b else None).fits
        return steps.report(b, shrunk, exact=False).fits

    if not fits(start):
        return None, shrunk, gap
    if profile is not None and profile.min_batch <= start + 1:  # replays from the live-bytes bound, as the max
        room, gap = replay_search(steps, profile, shrunk, start, gap)
        room = min(room, best)
    else:
        room = best if fits(best) else max_batch_between(fits, start, best, _headroom_guess(steps, card, shrunk,
                                                                                             start, best))
    return aligned_within(fits, room, align), shrunk, gap


def _headroom_guess(steps: Steps, card: GPU, shrunk: GPU, start: int, best: int) -> int:
    """Where the recommendation likely lies: the line through the card's allocated peaks at ``start`` and ``best``
    (both known) meets the memory the headroom leaves (memory is close to affine in the batch, as the max's
    search assumes)."""
    low, high = steps.report(start, card, exact=False), steps.report(best, card, exact=False)
    per_sample = (high.allocated_peak_bytes - low.allocated_peak_bytes) / max(best - start, 1)
    if per_sample <= 0:
        return start
    room = shrunk.usable_bytes(steps.reserve_bytes) - low.allocated_peak_bytes
    return min(max(start + int(room / per_sample), start), best)
