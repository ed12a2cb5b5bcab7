"""Allocator replays of steps (traces and affine traces), cached for a search."""

from __future__ import annotations

from estimator.gpus import GPU
from estimator.plan.affine import AffineTrace
from estimator.replay.allocator import AllocatorConfig, ReplayResult, replay_sized
from estimator.replay.report import MemoryReport, report_from_replays
from estimator.trace import Trace

Step = Trace | AffineTrace


class ReplayCache:
    """Allocator replays of steps (traces and affine traces), cached: a search, the curve and the
    reports of one card ask for the same batches, and cards that share a step and a workspace size
    share the replays without a capacity and those that never reach their capacity."""

    def __init__(self, reserve_bytes: int = 0) -> None:
        self.reserve_bytes = reserve_bytes  # kept free on every card besides the CUDA context
        self._capped: dict[tuple[tuple[int, int, int], int], ReplayResult] = {}  # ((step, batch, workspace), cap)
        self._unlimited: dict[tuple[int, int, int], ReplayResult] = {}

    @staticmethod
    def _sized(step: Step, batch: int, workspace: int) -> tuple[list[tuple[bool, int]], list[int], list[str]]:
        if isinstance(step, Trace):
            return step.events, step.sizes(workspace), step.categories()
        return step.events, step.sizes_at(batch, workspace), step.categories

    @staticmethod
    def _streams(step: Step) -> list[int] | None:
        return step.streams() if isinstance(step, Trace) else step.streams

    def replay(self, step: Step, batch: int, gpu: GPU, capped: bool = True) -> ReplayResult:
        """The step's replay on the card (its capacity less the reserve), or without a capacity."""
        ws = gpu.cublas_workspace_bytes
        key = (id(step), batch, ws)
        known = self._unlimited.get(key)
        if not capped:
            if known is None:
                known = self._unlimited[key] = replay_sized(*self._sized(step, batch, ws), AllocatorConfig(),
                                                            timelines=False, streams=self._streams(step))
            return known
        cap = gpu.usable_bytes(self.reserve_bytes)
        if known is not None and known.reserved_peak <= cap:
            return known  # below the capacity no cudaMalloc fails: the same replay
        if (key, cap) not in self._capped:
            r = replay_sized(*self._sized(step, batch, ws), AllocatorConfig(cap), timelines=False,
                             streams=self._streams(step))
            self._capped[key, cap] = r
            if r.fits and not r.failed_mallocs:
                self._unlimited[key] = r
        return self._capped[key, cap]

    def step_report(self, step: Step, batch: int, gpu: GPU, unsupported: list[str],
                    assumptions: list[str]) -> MemoryReport:
        capped = self.replay(step, batch, gpu)
        unlimited = capped if capped.fits else self.replay(step, batch, gpu, capped=False)
        return report_from_replays(capped, unlimited, step.events, batch, gpu, step.where, unsupported, assumptions,
                                   self.reserve_bytes, step if isinstance(step, Trace) else None)
