"""Rules by which a trace grows by one repeat: a block more of a deep model (estimator/simulate/depth.py), a
sample more of a step with loops over its samples (estimator/plan/growing.py).

A trace is read as tokens (what each event is, not which storage). When one
more repeat inserts the same segments at fixed points, the trace at any
count follows from a shallow one: ``Rule.grown``. A rule is found from the
traces at consecutive counts and checked against the next one (``holds``).

>>> rule = repeated(1, tokens[1], tokens[2])                                  # doctest: +SKIP
>>> rule.grown(tokens[1], 31) == tokens[32]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T", bound=Hashable)
Token = tuple[Any, ...]  # ("A", kind, layer code) or ("F", kind, (side, rank))


class NotPeriodic(Exception):
    """The traces do not repeat as the rule needs (blocks with depth, samples with the batch): simulate in full."""


def inserts(base: Sequence[T], more: Sequence[T], rightmost: bool = False) -> list[tuple[int, list[T]]]:
    """(position in ``base``, tokens inserted there) that make ``more`` from ``base``; NotPeriodic if ``more``
    is not ``base`` with insertions. ``rightmost``: each segment moved as far on as it goes with the same result
    (inserted after the run of copies it joins, rotated: a loop's new last pass, not one in its middle)."""
    # compared as small ints (one hash per token: a token's nested tuple, enums included, rehashes on each lookup)
    ids: dict[T, int] = {}
    matcher = difflib.SequenceMatcher(None, [ids.setdefault(t, len(ids)) for t in base],
                                      [ids.setdefault(t, len(ids)) for t in more], autojunk=False)
    found = []
    for tag, i1, _, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            found.append((i1, list(more[j1:j2])))
        elif tag != "equal":
            raise NotPeriodic(f"a {tag} at event {i1}")
    if rightmost:
        for n, (pos, segment) in enumerate(found):
            limit = found[n + 1][0] if n + 1 < len(found) else len(base)
            while pos < limit and base[pos] == segment[0]:  # the same: base[:p+1] + s[1:] + s[:1] + base[p+1:]
                segment = segment[1:] + segment[:1]
                pos += 1
            found[n] = (pos, segment)
    return found


@dataclass(frozen=True)
class Rule:
    """How a trace grows by one repeat (a block, a sample): each ``segments[i]`` inserted at ``positions[i]`` of
    the trace at count ``base``, at ``positions[i] + k * shifts[i]`` of the trace ``k`` repeats past it."""

    kind: str  # "repeated" (checked by each third count) or "drifting" (fitted on three, checked at a fourth once)
    base: int
    positions: tuple[int, ...]
    shifts: tuple[int, ...]
    segments: tuple[tuple[Token, ...], ...]
    reading: str = ""  # how the caller read the traces into tokens, where it has a choice (depth.py's ``TIES``)

    def grown(self, tokens: list[Token], blocks: int, done: int = 0,
              copy: Callable[[int, int], Sequence[Token]] | None = None) -> list[Token]:
        """The tokens ``blocks`` repeats more than ``tokens``, the trace ``done`` repeats past ``base`` (by default
        the trace at ``base`` itself). ``copy(i, k)``: segment ``i`` as the ``k``-th repeat past ``base`` inserts
        it, where copies differ (by default each is ``segments[i]``)."""
        for k in range(done, done + blocks):
            out: list[Token] = []
            at = 0
            for i, (pos, shift, segment) in enumerate(zip(self.positions, self.shifts, self.segments, strict=True)):
                out.extend(tokens[at:pos + k * shift])
                out.extend(segment if copy is None else copy(i, k))
                at = pos + k * shift
            out.extend(tokens[at:])
            tokens = out
        return tokens

    @property
    def depths(self) -> range:
        """The shallow depths the rule is found from."""
        return range(self.base, self.base + 3) if self.kind == "repeated" else range(self.base - 1, self.base + 2)

    @property
    def again(self) -> range:
        """The shallow depths the rule is found from again at another batch, its shape known: the two whose
        difference gives its segments."""
        return range(self.base, self.base + 2)

    @property
    def shape(self) -> tuple[Any, ...]:
        """What a rule checked at one batch shares with the same rule at another: how long its segments are
        (the places may move: batch 1 takes other paths in places) and how far each moves per block."""
        return self.kind, tuple(len(s) for s in self.segments)


def repeated(base: int, first: list[Token], second: list[Token], rightmost: bool = False) -> Rule:
    """The rule that inserts each segment of ``second`` again next to its first copy (a repeat more repeats
    each segment once more)."""
    found = inserts(first, second, rightmost)
    shifts, before = [], 0
    for _, segment in found:
        shifts.append(before)
        before += len(segment)
    return Rule("repeated", base, tuple(p for p, _ in found), tuple(shifts), tuple(tuple(s) for _, s in found))


def drifting(base: int, first: list[Token], second: list[Token], third: list[Token], rightmost: bool = False) -> Rule:
    """The rule whose insertion points move as the two steps ``first`` -> ``second`` -> ``third`` (counts
    ``base - 1`` to ``base + 1``) show, growing ``second``: for a segment the alignment put at another copy of
    its run the second time (a rotation of the first). Fitted on three counts: a fourth must check it."""
    one, two = inserts(first, second, rightmost), inserts(second, third, rightmost)
    if [len(s) for _, s in one] != [len(s) for _, s in two]:
        raise NotPeriodic("the segments inserted from one count to the next differ")
    shifts = tuple(q - p for (p, _), (q, _) in zip(one, two, strict=True))
    return Rule("drifting", base, tuple(q for q, _ in two), shifts, tuple(tuple(s) for _, s in two))


def holds(kind: str, base: int, tokens: dict[int, list[Token]]) -> Rule | None:
    """The rule of ``kind`` at ``base`` when the tokens two repeats past ``base`` are what it grows into (a
    repeated rule is found from two counts, so checked by a third; a drifting one from three, checked by a
    fourth), else None. ``tokens``: by count."""
    first = base if kind == "repeated" else base - 1
    if any(n not in tokens for n in range(first, base + 3)):
        return None
    try:
        rule = (repeated(base, tokens[base], tokens[base + 1]) if kind == "repeated"
                else drifting(base, tokens[base - 1], tokens[base], tokens[base + 1]))
    except NotPeriodic:
        return None
    return rule if rule.grown(tokens[base], 2) == tokens[base + 2] else None
