"""Accumulation micro-steps that a simulation stands for instead of running them.

With ``grad_accumulation_steps: N`` an optimizer step runs N micro-steps
(input -> forward -> loss -> backward, ``estimator.simulate.step``). From the
second on they are one program: the gradients exist (the first made them),
and all one micro-step hands to the next is its batch, freed when the next
batch is made. So the simulation stops as soon as two micro-steps in a row
record the same events (``repeats``: the second and third, as a rule), and
the trace repeats the last one for the rest (``expand``).

The trace holds ``micro_steps_in_trace(N)`` of them, not N: at micro-step
boundaries the caching allocator's state settles, within a few, into a cycle
of two (two batches alternate between two places). ``REPLAYED`` micro-steps,
one more when that keeps N's parity, replay to the peaks N would
(tests/test_accumulation.py shows it).

>>> [micro_steps_in_trace(n) for n in (2, 3, 6, 7, 8, 4096, 4097)]
[2, 3, 6, 7, 6, 6, 7]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from estimator.trace import Allocation, Trace

# Micro-steps the trace holds for a long accumulation: the replays of
# tests/test_accumulation.py settle by the 5th (resnet18 at batch 48 on a card that
# runs it short of memory), every other case there by the 3rd.
REPLAYED = 6


def micro_steps_in_trace(accumulation: int, simulated: int = 0) -> int:
    """How many of ``accumulation`` micro-steps the trace holds (at least ``simulated``): all of a short
    accumulation, else ``REPLAYED`` or one more, of ``accumulation``'s parity."""
    least = max(REPLAYED, simulated)
    if accumulation <= least + 1:
        return accumulation
    return least + (accumulation - least) % 2


@dataclass(frozen=True)
class Cut:
    """Where a simulation stopped an iteration's accumulation: events ``[prev, start)`` are one micro-step,
    ``[start, end)`` the next, the same program (``repeats``); ``simulated`` micro-steps ran."""

    prev: int
    start: int
    end: int
    simulated: int


def _key(a: Allocation) -> tuple:
    return a.nbytes, a.phase, a.module, a.op, a.iteration, a.category


def _runs_sorted(events: list[tuple[bool, int]]) -> list[tuple[bool, int]]:
    """``events`` with each run of frees in allocation order, as ``Recorder.finish`` leaves them."""
    out: list[tuple[bool, int]] = []
    run: list[tuple[bool, int]] = []
    for e in events:
        if e[0]:
            out.extend(sorted(run, key=lambda f: f[1]))
            run = []
            out.append(e)
        else:
            run.append(e)
    return out + sorted(run, key=lambda f: f[1])


def repeats(allocations: list[Allocation], events: list[tuple[bool, int]], prev: int, start: int, end: int,
            activations: AbstractSet[int] = frozenset()) -> bool:
    """Whether micro-step ``[start, end)`` repeats ``[prev, start)``, so that a third would repeat it too.

    The same allocations (bytes, phase, module, op, category, whether an
    activation) and events in the same order (runs of frees in any order);
    each frees at the same place what it allocated itself, or, where the
    first frees something older, the second frees one of the first's
    allocations (its batch); and nothing of the first outlives the second,
    so a micro-step leaves nothing behind but what the next one frees.
    """
    first, second = _runs_sorted(events[prev:start]), _runs_sorted(events[start:end])
    if len(first) != len(second):
        return False
    pos_first = {k: i for i, k in enumerate(k for alloc, k in first if alloc)}
    pos_second = {k: i for i, k in enumerate(k for alloc, k in second if alloc)}
    freed: set[int] = set()  # allocations of the first micro-step freed by either
    for (alloc_a, a), (alloc_b, b) in zip(first, second, strict=True):
        if alloc_a != alloc_b:
            return False
        if alloc_a:
            if _key(allocations[a]) != _key(allocations[b]) or (a in activations) != (b in activations):
                return False
        elif a in pos_first:
            if pos_second.get(b) != pos_first[a]:
                return False
            freed.add(a)
        else:  # the first frees something older: the second must free the first's
            if b not in pos_first:
                return False
            freed.add(b)
    return freed == pos_first.keys()


def expand(trace: Trace, cuts: list[Cut], accumulation: int) -> None:
    """Insert, at each cut, copies of its last micro-step before it, so that the trace holds
    ``micro_steps_in_trace`` micro-steps; then number the allocations in event order, as a full
    simulation does (the same trace, allocation for allocation)."""
    allocations, events = trace.allocations, trace.events
    out: list[tuple[bool, int]] = []
    done = 0
    for cut in sorted(cuts, key=lambda c: c.start):
        out.extend(events[done:cut.start])
        template = events[cut.start:cut.end]
        earlier = [k for alloc, k in events[cut.prev:cut.start] if alloc]
        pos_earlier = {k: i for i, k in enumerate(earlier)}
        own = {k for alloc, k in template if alloc}
        last = earlier  # the previous micro-step's allocations, by position
        for _ in range(micro_steps_in_trace(accumulation, cut.simulated) - cut.simulated):
            fresh: dict[int, int] = {}
            for alloc, k in template:
                if alloc:
                    fresh[k] = len(allocations)
                    allocations.append(dataclasses.replace(allocations[k]))
                    out.append((True, fresh[k]))
                else:
                    out.append((False, fresh[k] if k in own else last[pos_earlier[k]]))
            last = [fresh[k] for alloc, k in template if alloc]
        # the last simulated micro-step, freeing the last copy's batch instead of the one before it
        out.extend((alloc, k if alloc or k in own else last[pos_earlier[k]]) for alloc, k in template)
        done = cut.end
    out.extend(events[done:])
    order = [k for alloc, k in out if alloc]
    number = {k: i for i, k in enumerate(order)}
    trace.allocations = [allocations[k] for k in order]
    trace.events = [(alloc, number[k]) for alloc, k in out]
