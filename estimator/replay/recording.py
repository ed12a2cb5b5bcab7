"""What an allocator replay records when asked (``replay_sized(..., record=True)``): the allocator's actions in
the order it took them, named as torch's memory snapshot names them, and its segments at the end.

>>> from estimator.replay.allocator import AllocatorConfig, Event, replay
>>> r = replay([Event(True, 7, 4096), Event(False, 7, 4096)], AllocatorConfig(), record=True)
>>> [(str(a.action), a.addr, a.size, a.key) for a in r.recording.actions]
[('segment_alloc', 1048576, 2097152, -1), ('alloc', 1048576, 4096, 0), ('free', 1048576, 4096, 0)]

The addresses are the replay's own (segments from 1 MiB up, 1 MiB apart): only their order and the offsets
inside a segment mean anything. Expandable segments are modelled by their sizes alone, so a replay with them
records nothing (``replay_sized`` refuses).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class Action(StrEnum):
    """What the allocator did; torch's TraceEntry actions (torch/csrc/cuda/memory_snapshot.cpp action_to_str)."""

    ALLOC = "alloc"  # a block handed out for an allocation
    FREE = "free"  # the block given back (torch records free_requested, then free_completed)
    SEGMENT_ALLOC = "segment_alloc"  # cudaMalloc of a new segment
    SEGMENT_FREE = "segment_free"  # cudaFree of a whole cached segment (a failed cudaMalloc, empty_cache)
    OOM = "oom"  # an allocation that could not be had: a cuDNN workspace skipped, or the replay's end


class Entry(NamedTuple):
    """One action. ``addr``, ``size``: the block's (as the allocator counts it allocated) or the segment's;
    for ``OOM`` the bytes cudaMalloc still had (``addr``, as torch keeps device_free in TraceEntry::addr_) and
    the request. ``event``: the replayed event it happened at; ``key``: the allocation (its index in the replay's
    sizes; -1: a segment's)."""

    action: Action
    addr: int
    size: int
    stream: int
    event: int
    key: int = -1


class Block(NamedTuple):
    """A block of a segment at the end: ``key`` is the allocation holding it, None when it is cached free."""

    addr: int
    size: int
    key: int | None


class Segment(NamedTuple):
    """A cudaMalloc'd segment at the end, its blocks in address order (they tile it)."""

    addr: int
    size: int
    stream: int
    small: bool
    blocks: tuple[Block, ...]


@dataclass
class Recording:
    """The actions of one replay, in order, and the segments it holds when it ends."""

    actions: list[Entry]
    segments: list[Segment]
