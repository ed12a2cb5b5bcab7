"""Later iterations' forward and backward written from the first's instead of simulated again.

>>> repeat = Repeat()                                  # doctest: +SKIP
>>> repeat.copy(recorder, 1, Kept(grads, batch, once))  # True: iteration 1's zero_grad..backward are in the trace

A step's second iteration runs the same program as its first on the same
shapes: zero_grad (``set_to_none``) frees the first's gradients, the input
allocates a batch and the previous one is freed as it is replaced, then
the forward and backward allocate and free what the first's did, in the
same order. So the trace of iteration ``i``'s zero_grad..backward is the
first's input..backward with fresh allocations (``iteration = i``), the
gradients freed before it and the old batch freed as the forward starts;
only the optimizer step, which meets the state the first step made, is
simulated again: about 40% of a simulation's time is not spent (a forward and a
backward of the two it ran).

It is written only where the first iteration shows nothing else lives on
from it: what it allocated and had not freed by its backward's end is the
gradients (still gradients, not kept as optimizer state), the batch, and
allocations made once (a cuBLAS handle's workspace, a GradScaler's scale),
it freed nothing older than itself and emptied no cache, and no module holds
the batch or a view of it (then the next forward frees it, not the input).
Anything else (a cache a module fills, what selective checkpointing keeps
under FSDP, a user's own step, optimizer or set-up code) and the iteration,
and every later one, is simulated. Not detected: a batch factory of the
user's that hands the same tensor out again (batchfit's sources make a new
batch per call). Under FSDP2 a block's unsharded parameters are
made by the first all-gather and refilled by ``resize_`` from then on: their
copies are ``resize_`` allocations. Not tried with accumulation, with
zero_grad after the forward or without ``set_to_none``, with cudnn.benchmark
(the first call of each shape searches, later ones do not), or under DDP and
ZeRO-1 (DDP rebuilds its gradient buckets after the first iteration).
tests/test_iterations.py checks the traces against simulated iterations,
allocation for allocation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from estimator.trace import Allocation, Category, Phase

if TYPE_CHECKING:
    from estimator.simulate.recipe import Recipe
    from estimator.simulate.record import Recorder


def tried(recipe: Recipe) -> bool:
    """Whether the loop of ``recipe`` may have its later iterations written (a user's own step aside): one
    micro-step, zero_grad to None before it, no cudnn.benchmark, one GPU or FSDP."""
    return (recipe.grad_accumulation_steps == 1 and recipe.zero_grad_at == "step-start"
            and recipe.zero_grad_set_to_none and not recipe.cudnn_benchmark
            and recipe.distributed.strategy in ("none", "fsdp"))


@dataclass(frozen=True)
class Kept:
    """What legitimately lives on from one iteration's micro-step, as the loop holds it when the next iteration
    starts: the gradients and the batch (made again by each iteration) and tensors made once (a GradScaler's)."""

    grads: list[torch.Tensor]
    batch: list[torch.Tensor]
    once: list[torch.Tensor] = field(default_factory=list)
    held: list[torch.Tensor] = field(default_factory=list)  # tensors the model's modules hold as attributes


def _only_views(batch: list[torch.Tensor]) -> bool:
    """No tensor outside ``batch`` shares its storages (a module that keeps a view of its input holds one)."""
    impls: dict[int, set[int]] = {}
    for t in batch:
        if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
            impls.setdefault(t.untyped_storage()._cdata, set()).add(id(t))
    # the storage's users: the batch's tensors, and the storage object ``untyped_storage()`` makes to ask
    return all(torch._C._storage_Use_Count(key) <= len(users) + 1 for key, users in impls.items())


def _keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storages of ``tensors`` (a DTensor's are its local shard's)."""
    keys: set[int] = set()
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            keys |= _keys(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            keys.add(t.untyped_storage()._cdata)
    return keys


@dataclass
class Repeat:
    """The first iteration's micro-step as the recorder saw it: events ``[start, end)``, the forward from
    ``forward``, its first allocation ``first``; ``copy`` writes a later iteration's from it."""

    zero_grad: int | None = None
    start: int | None = None
    first: int = 0
    forward: int | None = None
    end: int | None = None
    refused: bool = False  # an iteration was simulated: so are the later ones
    _plan_of_first: tuple[dict[int, int], set[int]] | None = None

    def mark(self, phase: Phase, events: int, allocations: int) -> None:
        """The first iteration enters ``phase`` with ``events`` events and ``allocations`` allocations so far."""
        if phase == Phase.ZERO_GRAD:
            self.zero_grad = events
        elif phase == Phase.INPUT and self.start is None:
            self.start, self.first = events, allocations
        elif phase == Phase.FORWARD and self.forward is None:
            self.forward = events
        elif phase == Phase.OPTIMIZER:
            self.end = events

    def copy(self, rec: Recorder, iteration: int, kept: Kept) -> bool:
        """Write ``iteration``'s zero_grad..backward into ``rec``'s trace from the first iteration's; False (nothing
        written) where the first iteration does not show that it would record the same."""
        grads, batch_keys = _keys(kept.grads), _keys(kept.batch)
        plan = None if self.refused else self._plan_of_first or self._plan(rec, kept, grads, batch_keys)
        # the storages the loop keeps are the ones the first micro-step made (a gradient not replaced since)
        if (plan is None or set(plan[0]) != grads | batch_keys
                or _keys(kept.held) & batch_keys or not _only_views(kept.batch)):
            self.refused = True  # or a module holds (a view of) the batch: the next forward frees it, not the input
            return False
        self._plan_of_first = plan
        carried, once = plan
        trace = rec.trace
        events, allocations = trace.events, trace.allocations
        rec.enter(Phase.ZERO_GRAD, iteration)
        batch = [rec.live[key] for key in carried if key not in grads]  # the previous batch, freed as it is replaced
        for key in carried:
            if key in grads:
                _free(rec, rec.live[key])
        assert self.start is not None and self.end is not None
        new: dict[int, int] = {}
        for i in range(self.start, self.end):
            if i == self.forward:
                for aid in batch:
                    _free(rec, aid)
            is_alloc, aid = events[i]
            if not is_alloc:
                _free(rec, new[aid])
            elif aid not in once:
                new[aid] = len(allocations)
                allocations.append(_again(rec, aid, iteration))
                events.append((True, new[aid]))
                rec.live_bytes += allocations[aid].nbytes
                rec.peak_bytes = max(rec.peak_bytes, rec.live_bytes)
                if aid in rec.survivors:
                    rec.survivors.add(new[aid])
        rec.enter(Phase.BACKWARD, iteration)
        for key, aid in carried.items():  # the storages the loop holds are this iteration's allocations now
            rec.live[key] = rec.moved[aid] = new[aid]
        rec.micro_flops[iteration, 0] = rec.micro_flops.get((0, 0), 0)
        return True

    def _plan(self, rec: Recorder, kept: Kept, grads: set[int],
              batch: set[int]) -> tuple[dict[int, int], set[int]] | None:
        """(storage -> its allocation in the first micro-step, for the gradients and the batch (storages
        ``grads`` and ``batch``); the allocations made once), or None where the first micro-step shows something
        else living on or freed."""
        if None in (self.zero_grad, self.start, self.forward, self.end) or rec.cuts:
            return None
        assert self.start is not None and self.end is not None
        events, allocations = rec.trace.events, rec.trace.allocations
        if self.zero_grad != self.start:  # the first zero_grad freed something: grads from before the loop
            return None
        live: set[int] = set()
        for is_alloc, aid in events[self.start:self.end]:
            if is_alloc:
                if allocations[aid].category == Category.EMPTY_CACHE:
                    return None  # an empty_cache call (cudnn.benchmark's, after its first search of a shape)
                live.add(aid)
            elif aid in live:
                live.discard(aid)
            else:
                return None  # something older freed: it would not be freed again
        once_keys = _keys(kept.once)
        owner = {aid: key for key, aid in rec.live.items() if aid >= self.first}
        carried: dict[int, int] = {}
        once: set[int] = set()
        for aid in live:
            key = owner.get(aid)
            a = allocations[aid]
            if key is None and a.category == Category.WORKSPACE:
                once.add(aid)  # a cuBLAS handle's workspace, made by the first matmul on each thread
            elif key in once_keys:
                once.add(aid)
            elif (key in grads and a.category == Category.GRADIENT) or (key in batch and a.phase == Phase.INPUT):
                carried[key] = aid
            else:
                return None
        return carried, once  # ``copy`` checks that it made every gradient and batch storage


def _again(rec: Recorder, aid: int, iteration: int) -> Allocation:
    """Allocation ``aid`` of the first iteration as ``iteration`` makes it: a storage the first made by its op and
    then resized in place (FSDP2's gathered parameters) is refilled by ``resize_``, with its storage's category."""
    a = rec.trace.allocations[aid]
    key = rec.refilled.get(aid)
    if key is not None:
        return dataclasses.replace(a, op="resize_", iteration=iteration, category=rec.key_category.get(key, a.category))
    return dataclasses.replace(a, iteration=iteration)


def _free(rec: Recorder, aid: int) -> None:
    rec.trace.events.append((False, aid))
    rec.live_bytes -= rec.trace.allocations[aid].nbytes
