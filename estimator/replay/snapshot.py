"""The simulated step as a CUDA memory snapshot, the dict ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history()``: pickled, it opens at https://pytorch.org/memory_viz.

>>> snap = snapshot_of(view)                                       # doctest: +SKIP
>>> pickle.dump(snap, open("step.pickle", "wb"))

``device_traces[0]`` holds the replay's actions in order, with torch's names and fields
(torch/csrc/cuda/memory_snapshot.cpp): ``alloc``, ``free_requested`` then ``free_completed``,
``segment_alloc``, ``segment_free`` (and ``oom`` for a cuDNN workspace that could not be had), each with
``addr``, ``size``, ``stream`` and ``frames``; ``segments`` holds the segments at the end of the step with
their blocks. Two differences from torch's own:

- an alloc's or free's ``size`` is its block's bytes (torch's trace has the requested bytes): the allocated
  bytes the viewer adds up are then what ``torch.cuda.max_memory_allocated()`` counts, the report's
  ``allocated_peak_bytes``; a block's ``requested_size`` in ``segments`` is the request, as torch has it;
- ``frames`` are not a Python stack but where the step made the allocation: innermost
  ``{"filename": "batchfit/<category>", "line": 0, "name": <op>}``, then
  ``{"filename": <module>, "line": <iteration>, "name": <phase>}``.

Addresses are the replay's own, and there are no ``time_us``.
"""

from __future__ import annotations

from typing import Any

from estimator.replay.recording import Action, Entry
from estimator.replay.view import StepView
from estimator.trace import Trace

Frames = list[dict[str, Any]]


def snapshot_of(view: StepView) -> dict[str, Any]:
    """``{"segments": [...], "device_traces": [[...]]}`` of ``view``'s step, from the replay its report shows."""
    r = view.replay(record=True)
    assert r.recording is not None  # asked for
    _events, sizes, categories, _streams = view.sized()
    frames = _Frames(view, categories)
    trace: list[dict[str, Any]] = []
    for e in r.recording.actions:
        trace.extend(_entries(e, frames))
    segments = []
    for s in r.recording.segments:
        blocks = [{"address": b.addr, "size": b.size, "requested_size": 0 if b.key is None else sizes[b.key],
                   "state": "inactive" if b.key is None else "active_allocated",
                   "frames": [] if b.key is None else frames(b.key)} for b in s.blocks]
        held = [b for b in s.blocks if b.key is not None]
        allocated = sum(b.size for b in held)
        segments.append({
            "device": 0, "address": s.addr, "total_size": s.size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(sizes[b.key] for b in held if b.key is not None),
            "stream": s.stream, "segment_type": "small" if s.small else "large", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": blocks,
        })
    return {"segments": segments, "device_traces": [trace]}


def _entries(e: Entry, frames: _Frames) -> list[dict[str, Any]]:
    """torch's trace entries for one action of the replay."""
    if e.action == Action.OOM:
        return [{"action": "oom", "device_free": e.addr, "size": e.size, "stream": e.stream, "frames": frames(e.key)}]
    where = [] if e.key < 0 else frames(e.key)
    entry = {"addr": e.addr, "size": e.size, "stream": e.stream, "frames": where}
    if e.action == Action.FREE:  # torch records the request to free, then its completion (no other stream used it)
        return [{"action": "free_requested", **entry}, {"action": "free_completed", **entry}]
    return [{"action": str(e.action), **entry}]


class _Frames:
    """Each allocation's frames, one list per distinct place (the pickle then stores each once)."""

    def __init__(self, view: StepView, categories: list[str]) -> None:
        self.step, self.categories = view.step, categories
        self.ops = [a.op for a in view.step.allocations] if isinstance(view.step, Trace) else None
        self.known: dict[tuple[str, str, str, str, int], Frames] = {}

    def __call__(self, k: int) -> Frames:
        phase, module, iteration = self.step.where(k)
        category = self.categories[k] or "unknown"
        op = self.ops[k] if self.ops is not None else ""
        place = (category, op, phase, module, iteration)
        if place not in self.known:
            self.known[place] = [{"filename": f"batchfit/{category}", "line": 0, "name": op or category},
                                 {"filename": module or "(no module)", "line": iteration, "name": phase}]
        return self.known[place]
