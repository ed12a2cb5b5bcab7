"""The growing trace: a step whose loops over the samples add the same events for each sample.

A detection model's step loops over its images (the transform resizes each
one, anchors, proposals and the RoI heads' samples are chosen per image):
its ops change with the batch, so it has no affine trace
(estimator/plan/affine.py). Read as tokens (an allocation by what it is and
its bytes as a line through two batches, a free by its rank among the live
allocations of that kind and line, from the end where the rank stays the
same at the next batch: ``tokens_of``), the trace at ``b + 1`` is often the
trace at ``b`` with the same segments inserted at fixed points (a rule,
estimator/plan/periodic.py), the inserted allocations of constant bytes.
Then the step at any batch follows from the full simulations at three to
five consecutive small batches (``grow``), checked as the affine trace is:
the rule, found on the tokens, must give the trace two samples past its
base byte for byte, and the planner checks the result once more by a full
simulation just past the group's largest answer (``matches``).

>>> growing = grow({1: t1, 2: t2, 3: t3, 4: t4, 5: t5}, start=1)          # doctest: +SKIP
>>> growing.at(40).events == simulate(40).events                         # the same events, every byte
True
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from estimator.plan.periodic import NotPeriodic, Rule, Token, drifting, inserts, repeated
from estimator.plan.search import max_batch_between
from estimator.trace import Allocation, Category, Sized, Trace

MORE = 4  # the most batches past the smallest a rule may need: a drifting rule at start + 2 is found on start + 1
# to start + 4
KEEP = 6  # the synthesized traces kept (the replays of each are cached by the planner; a trace is rebuilt cheaply)
MAX_EVENTS = 4_000_000  # the longest step synthesized (about 4 s to decode): past it, full simulations



def _kind(a: Allocation) -> Hashable:
    return a.phase, a.module, a.op, a.category, a.stream, a.iteration


def _aligned(first: Sequence[Hashable], second: Sequence[Hashable]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each item of ``first`` is in ``second`` (``second`` is ``first`` with segments inserted, each as far
    on as it goes: a loop's new last pass), and each inserted segment's (start, end) in ``second``."""
    where, segments, shift = [], [], 0
    found = iter(inserts(first, second, rightmost=True))
    nxt = next(found, None)
    for i in range(len(first) + 1):
        while nxt is not None and nxt[0] == i:
            segments.append((i + shift, i + shift + len(nxt[1])))
            shift += len(nxt[1])
            nxt = next(found, None)
        if i < len(first):
            where.append(i + shift)
    return where, segments


def _ranks(trace: Trace, sizes: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Per free event, the rank of what it frees among the live allocations of its kind and size line
    (``sizes``: per allocation, its bytes as (constant, per sample)), from the oldest and from the newest."""
    live: dict[Hashable, list[int]] = {}
    out = {}
    for e, (is_alloc, k) in enumerate(trace.events):
        stack = live.setdefault((_kind(trace.allocations[k]), sizes[k]), [])
        if is_alloc:
            stack.append(k)
        else:
            pos = stack.index(k)
            del stack[pos]
            out[e] = (pos, len(stack) - pos)  # from the newest, 0 is the newest
    return out


def tokens_of(trace: Trace, batch: int, after: Trace) -> list[Token]:
    """The tokens of ``trace`` (the step at ``batch``) as the step one sample on, ``after``, tells them.

    ``after``'s allocations are ``trace``'s, in the order they are made, with segments inserted (NotPeriodic
    when not). An allocation's token is ``("A", (kind, (constant, per_sample)))``: what it is and its bytes as a
    line through its bytes at both batches (an inserted one's: constant). A free's is ``("F", (kind, line),
    (side, rank))``: what it frees, ranked among the live allocations of the same kind and line from the end its
    rank stays the same at the next batch (the newest for a stack, the oldest for a queue; NotPeriodic when
    neither does)."""
    ids = [k for alloc, k in trace.events if alloc]  # allocations in the order they are made
    ids_after = [k for alloc, k in after.events if alloc]
    where, inserted = _aligned([_kind(trace.allocations[k]) for k in ids],
                               [_kind(after.allocations[k]) for k in ids_after])
    lines: dict[int, tuple[int, int]] = {}
    lines_after: dict[int, tuple[int, int]] = {}
    for n, k in enumerate(ids):
        k2 = ids_after[where[n]]
        then, now = trace.allocations[k].nbytes, after.allocations[k2].nbytes
        if now < then:
            raise NotPeriodic(f"allocation {n} is smaller at batch {batch + 1} than at {batch}")
        lines[k] = lines_after[k2] = (then - (now - then) * batch, now - then)
    for start, end in inserted:
        for n in range(start, end):
            lines_after[ids_after[n]] = (after.allocations[ids_after[n]].nbytes, 0)
    ranks, ranks_after = _ranks(trace, lines), _ranks(after, lines_after)
    frees_after = {k: e for e, (alloc, k) in enumerate(after.events) if not alloc}
    to_after = {k: ids_after[where[n]] for n, k in enumerate(ids)}
    tokens: list[Token] = []
    for e, (is_alloc, k) in enumerate(trace.events):
        kind = (_kind(trace.allocations[k]), lines[k])
        if is_alloc:
            tokens.append(("A", kind))
            continue
        free_after = frees_after.get(to_after[k])
        if free_after is None:
            raise NotPeriodic(f"an allocation freed at batch {batch} and not at {batch + 1}")
        (oldest, newest), (oldest_after, newest_after) = ranks[e], ranks_after[free_after]
        if newest == newest_after:
            tokens.append(("F", kind, ("newest", newest)))
        elif oldest == oldest_after:
            tokens.append(("F", kind, ("oldest", oldest)))
        else:
            raise NotPeriodic(f"a free whose rank changes with the batch from both ends ({kind[0]})")
    if len(frees_after) != sum(1 for alloc, _ in trace.events if not alloc) + sum(
            1 for start, end in inserted for n in range(start, end) if ids_after[n] in frees_after):
        raise NotPeriodic(f"an allocation freed at batch {batch + 1} and not at {batch}")
    return tokens


def decode(tokens: Sequence[Token], batch: int) -> tuple[list[Allocation], list[tuple[bool, int]]]:
    """The allocations and events of tokens at ``batch``; NotPeriodic for a free of nothing."""
    allocations: list[Allocation] = []
    events: list[tuple[bool, int]] = []
    live: dict[Hashable, list[int]] = {}
    for token in tokens:
        kind = token[1]
        stack = live.setdefault(kind, [])
        if token[0] == "A":
            (phase, module, op, category, stream, iteration), (const, per_sample) = kind
            stack.append(len(allocations))
            events.append((True, len(allocations)))
            allocations.append(Allocation(const + per_sample * batch, phase, module, op, iteration, category, stream))
        else:
            side, rank = token[2]
            pos = len(stack) - 1 - rank if side == "newest" else rank
            if not 0 <= pos < len(stack):
                raise NotPeriodic(f"a free of rank {rank} among {len(stack)}")
            events.append((False, stack.pop(pos)))
    return allocations, events


def _same(a: list[Allocation], b: list[Allocation]) -> bool:
    """The same allocations, the cuBLAS workspace's bytes aside (each card has its own)."""
    if len(a) != len(b):
        return False
    return all(x == y or (x.category == y.category == Category.WORKSPACE
                          and dataclasses.replace(x, nbytes=y.nbytes) == y) for x, y in zip(a, b, strict=True))


@dataclass(eq=False)
class GrowingTrace:
    """The step at any batch from ``min_batch`` on: a full simulation where one was run (``known``), else the
    tokens at ``rule.base`` grown by ``rule`` and decoded at the batch."""

    rule: Rule
    base: list[Token]
    known: dict[int, Trace]
    note: str
    counts: tuple[tuple[int, ...], ...]  # per segment, per token: how much a free's rank grows per copy (0: none)
    _made: OrderedDict[int, Trace] = field(default_factory=OrderedDict, repr=False)
    _tokens: OrderedDict[int, list[Token]] = field(default_factory=OrderedDict, repr=False)
    _live: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @property
    def min_batch(self) -> int:
        return min(self.known)

    def at(self, batch: int) -> Trace:
        """The full step at ``batch`` (>= ``min_batch``); NotPeriodic where it cannot be synthesized (past
        ``MAX_EVENTS``, or a free of nothing: the planner simulates that batch instead)."""
        if batch in self.known:
            return self.known[batch]
        if batch < self.min_batch:
            raise ValueError(f"batch {batch} is below the growing trace's first, {self.min_batch}")
        made = self._made.get(batch)
        if made is None:
            allocations, events = decode(self._tokens_at(batch), batch)
            template, after = self.known[self.rule.base], self.known[self.rule.base + 1]
            made = dataclasses.replace(template, allocations=allocations, events=events,
                                       flops=template.flops + (after.flops - template.flops) * (batch - self.rule.base),
                                       assumptions=[*template.assumptions, self.note])
            self._made[batch] = made
            while len(self._made) > KEEP:
                self._made.popitem(last=False)
        self._made.move_to_end(batch)
        return made

    def _tokens_at(self, batch: int) -> list[Token]:
        """The tokens at ``batch``, grown from the nearest batch below whose tokens are kept (each copy costs a
        pass over the tokens: growing from the base every time would cost the batch squared)."""
        per_sample = sum(len(s) for s in self.rule.segments)
        if len(self.base) + per_sample * (batch - self.rule.base) > MAX_EVENTS:
            raise NotPeriodic(f"the step at batch {batch} is longer than {MAX_EVENTS} events")
        below = max((b for b in self._tokens if b <= batch), default=self.rule.base)
        tokens = self._tokens[below] if below in self._tokens else self.base
        tokens = grown(self.rule, self.counts, tokens, batch - below, done=below - self.rule.base)
        self._tokens[batch] = tokens
        while len(self._tokens) > KEEP:
            self._tokens.popitem(last=False)
        return tokens

    # the planner's ``Step``, and what it asks of an affine trace
    @property
    def events(self) -> list[tuple[bool, int]]:
        raise TypeError("a growing trace's events depend on the batch: use at(batch)")

    def sized(self, batch: int, workspace: int) -> Sized:
        return self.at(batch).sized(batch, workspace)

    def where(self, k: int) -> tuple[str, str, int]:
        raise TypeError("a growing trace's allocations depend on the batch: use at(batch)")

    def live_at(self, batch: int, workspace: int) -> int:
        """The peak of requested bytes live at once at ``batch`` (the allocations a replay may skip left out)."""
        key = (batch, workspace)
        if key not in self._live:
            self._live[key] = self.at(batch).live_peak(hard_only=True, workspace=workspace)[0]
        return self._live[key]

    def live_bound(self, capacity: int, workspace: int, limit: int) -> int:
        """The largest batch <= ``limit`` whose requested bytes live at once stay within ``capacity`` (no larger
        batch can fit, whatever the allocator does); the search starts on the line through two known batches."""
        lo = self.min_batch
        if self.live_at(lo, workspace) > capacity:
            return min(lo - 1, limit)
        if lo >= limit:
            return limit
        hi = max(self.known)
        low, high = self.live_at(lo, workspace), self.live_at(hi, workspace)
        per_sample = (high - low) / max(hi - lo, 1)
        # a flat peak at small batches (the optimizer's): gallop up from the last known batch instead
        guess = 2 * hi if per_sample <= 0 else lo + int((capacity - low) / per_sample)
        return max_batch_between(lambda b: self.live_at(b, workspace) <= capacity, lo, limit + 1,
                                 min(max(guess, lo + 1), limit))

    def matches(self, trace: Trace, batch: int) -> bool:
        """Whether ``trace`` (a fresh simulation at ``batch``) is the step this trace synthesizes there."""
        mine = self.at(batch)
        return mine.events == trace.events and _same(mine.allocations, trace.allocations)


def counted(rule: Rule, first: list[Token], second: list[Token]) -> tuple[tuple[int, ...], ...]:
    """Per segment token of a drifting ``rule`` (found on ``first``, ``second`` and the trace after), how much
    its rank grows from the copy ``second`` has inserted to the rule's own: a loop that frees the k-th item of a
    list at its k-th pass ranks that free k (0 for an allocation, or a free ranked alike in each copy);
    NotPeriodic for tokens that differ otherwise."""
    before = inserts(first, second, rightmost=True)
    if [len(s) for _, s in before] != [len(s) for s in rule.segments]:
        raise NotPeriodic("the segments differ from one batch to the next")
    counts = []
    for (_, old), new in zip(before, rule.segments, strict=True):
        count = []
        for x, y in zip(old, new, strict=True):
            if x == y:
                count.append(0)
            elif x[0] == y[0] == "F" and x[1] == y[1] and x[2][0] == y[2][0]:
                count.append(y[2][1] - x[2][1])
            else:
                raise NotPeriodic(f"a segment's tokens differ from one batch to the next: {x} {y}")
        counts.append(tuple(count))
    return tuple(counts)


def grown(rule: Rule, counts: Sequence[Sequence[int]], tokens: list[Token], blocks: int,
          done: int = 0) -> list[Token]:
    """``Rule.grown`` with counted ranks: the ``k``-th copy of a segment past the rule's own has each free's
    rank grown by ``k`` times its count; ``done``: the copies ``tokens`` already has past the rule's base."""
    if not any(any(c) for c in counts):
        return rule.grown(tokens, blocks, done)

    def copy(i: int, k: int) -> list[Token]:
        return [t if not c else (*t[:2], (t[2][0], t[2][1] + c * k))
                for t, c in zip(rule.segments[i], counts[i], strict=True)]
    return rule.grown(tokens, blocks, done, copy)


class Deeper(NotPeriodic):
    """No rule holds of the batches simulated so far; the next one may tell."""


def grow(traces: Mapping[int, Trace], start: int) -> GrowingTrace:
    """The growing trace through the full steps ``traces`` (by batch, consecutive from ``start``): the first
    rule found on their tokens that gives the trace two samples past its base byte for byte. Deeper when a
    rule may hold with the next batch's trace too; NotPeriodic when none can."""
    last = max(traces)
    if len(traces[last].allocations) == len(traces[last - 1].allocations):
        raise NotPeriodic("as many allocations at two batches: an affine step, or none")
    tokens = {}  # but the last's (only a check): the batches whose step grows into the next one's
    for b in range(start, last):
        try:
            tokens[b] = tokens_of(traces[b], b, traces[b + 1])
        except NotPeriodic as exc:  # the smallest batch may take other paths; no other one may
            if b > start:
                raise NotPeriodic(f"batches {b} and {b + 1}: {exc}") from exc
    for kind, base in (("repeated", start), ("repeated", start + 1), ("drifting", start + 1),
                       ("drifting", start + 2)):
        if base + 2 > last or any(b not in tokens for b in range(base - (kind == "drifting"), base + 2)):
            continue
        try:
            if kind == "repeated":
                rule = repeated(base, tokens[base], tokens[base + 1], rightmost=True)
                counts = tuple((0,) * len(s) for s in rule.segments)
            else:
                rule = drifting(base, tokens[base - 1], tokens[base], tokens[base + 1], rightmost=True)
                counts = counted(rule, tokens[base - 1], tokens[base])
            allocations, events = decode(grown(rule, counts, tokens[base], 2), base + 2)
        except NotPeriodic:
            continue
        if events == traces[base + 2].events and _same(allocations, traces[base + 2].allocations):
            per = sum(len(s) for s in rule.segments)
            note = (f"the step's loops over the samples grown from full simulations at batches {start} to {last} "
                    f"({per} events more per sample, at {len(rule.segments)} points: the events a full simulation "
                    "records)")
            return GrowingTrace(rule, tokens[base], dict(traces), note, counts)
    if last - start < MORE:
        raise Deeper(f"no rule holds at batches {start} to {last}")
    raise NotPeriodic(f"the samples do not repeat alike at batches {start} to {last}")
