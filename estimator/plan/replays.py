"""Allocator replays of steps (traces, affine and growing traces), cached for a search.

>>> cache = ReplayCache(reserve_bytes=256 * 2**20)                         # doctest: +SKIP
>>> cache.replay(affine, 64, get_gpu("A100-80GB")).fits
True
"""

from __future__ import annotations

from collections.abc import Sequence

from estimator.gpus import GPU
from estimator.plan.affine import AffineTrace
from estimator.plan.growing import GrowingTrace
from estimator.replay.allocator import AllocatorConfig, ReplayResult, replay_sized
from estimator.replay.native import Encoded, available, encode
from estimator.replay.report import MemoryReport, peak_allocation, report_from_replays
from estimator.trace import Sized, Step, Trace


class ReplayCache:
    """Allocator replays of steps, cached: a search, the curve and the reports of one card ask for the same
    batches, and cards that share a step and a workspace size share the replays without a capacity and those
    that never reach their capacity."""

    def __init__(self, reserve_bytes: int = 0) -> None:
        self.reserve_bytes = reserve_bytes  # kept free on every card besides the CUDA context
        self._capped: dict[tuple[tuple[int, int, int], int], ReplayResult] = {}  # ((step, batch, workspace), cap)
        self._unlimited: dict[tuple[int, int, int], ReplayResult] = {}
        self._steps: dict[int, Step] = {}  # the steps keyed by id(), held so that no id is reused
        # a full trace's lists as the replay reads them, made once (a finished trace's never change): its events'
        # encoding for the C replay, and its sizes per cuBLAS workspace with its categories and streams
        self._encoded: dict[int, Encoded | None] = {}
        self._sized: dict[tuple[int, int], Sized] = {}

    def replay(self, step: Step, batch: int, gpu: GPU, capped: bool = True) -> ReplayResult:
        """The step's replay on the card (its capacity less the reserve), or without a capacity."""
        ws = gpu.cublas_workspace_bytes
        self._steps.setdefault(id(step), step)
        key = (id(step), batch, ws)
        known = self._unlimited.get(key)
        if not capped:
            if known is None:
                known = self._unlimited[key] = self._replay(step, batch, ws, AllocatorConfig())
            return known
        cap = gpu.usable_bytes(self.reserve_bytes)
        if known is not None and max(known.reserved_peak, known.device_peak) <= cap:
            return known  # below the capacity no cudaMalloc fails: the same replay
        if (key, cap) not in self._capped:
            r = self._replay(step, batch, ws, AllocatorConfig(cap))
            self._capped[key, cap] = r
            if r.fits and not r.failed_mallocs:
                self._unlimited[key] = r
        return self._capped[key, cap]

    def _replay(self, step: Step, batch: int, ws: int, config: AllocatorConfig) -> ReplayResult:
        events, sizes, categories, streams = self._lists(step, batch, ws)
        return replay_sized(events, sizes, categories, config, timelines=False, streams=streams,
                            encoded=self._encoding(step, ws))

    def _lists(self, step: Step, batch: int, ws: int) -> Sized:
        """``step.sized(batch, ws)``; a full trace's once per workspace (it is the step at one batch)."""
        if not isinstance(step, Trace):
            return step.sized(batch, ws)
        key = (id(step), ws)
        if key not in self._sized:
            self._sized[key] = step.sized(batch, ws)
        return self._sized[key]

    def _encoding(self, step: Step, ws: int) -> Encoded | None:
        """The step's events, categories and streams in the C replay's form, where the step keeps them: an affine
        trace's own, a full trace's made once here; None for a growing trace (its events differ by batch)."""
        if isinstance(step, AffineTrace):
            return step.encoded
        if not isinstance(step, Trace) or not available():
            return None
        if id(step) not in self._encoded:
            events, _, categories, streams = self._lists(step, 0, ws)
            self._encoded[id(step)] = encode(events, categories, streams)
        return self._encoded[id(step)]

    def step_report(self, step: Step, batch: int, gpu: GPU, unsupported: Sequence[str] = (),
                    assumptions: Sequence[str] = ()) -> MemoryReport:
        capped = self.replay(step, batch, gpu)
        unlimited = capped if capped.fits else self.replay(step, batch, gpu, capped=False)
        at = step.at(batch) if isinstance(step, GrowingTrace) else step  # the events of this batch
        k = peak_allocation(at.events, capped, unlimited)  # where the peak falls: the step's own record
        return report_from_replays(capped, unlimited, batch, gpu, where=("", "", 0) if k is None else at.where(k),
                                   unsupported=unsupported, assumptions=assumptions, reserve_bytes=self.reserve_bytes,
                                   trace=at if isinstance(at, Trace) else None)
