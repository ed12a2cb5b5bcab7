"""One training step on one card as its views show it (``timeline``, ``snapshot``): the step at a batch, the card,
the memory kept free on it, and the report whose replay the views draw.

>>> view = view_of(trace, 32, get_gpu("A100-80GB"), reserve_bytes=256 * 2**20)     # doctest: +SKIP
>>> view.replay().allocated_peak == view.report.allocated_peak_bytes
True
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.gpus import GPU
from estimator.replay.allocator import AllocatorConfig, ReplayResult, replay_sized
from estimator.replay.report import MemoryReport, report_from_step
from estimator.trace import Sized, Step


@dataclass(frozen=True)
class StepView:
    """``step`` at ``batch_size`` on ``card`` with ``reserve_bytes`` kept free besides the CUDA context (the
    planner's margin), and its report."""

    step: Step
    card: GPU
    batch_size: int
    reserve_bytes: int
    report: MemoryReport

    def sized(self) -> Sized:
        """The step's events and each allocation's bytes, category and stream at the batch, on the card."""
        return self.step.sized(self.batch_size, self.card.cublas_workspace_bytes)

    def replay(self, *, record: bool = False) -> ReplayResult:
        """The replay the report shows, with its timelines: held to the card's usable bytes when the step fits
        there, else without a capacity (what it would need). ``record``: with the allocator's actions."""
        events, sizes, categories, streams = self.sized()
        cap = self.card.usable_bytes(self.reserve_bytes) if self.report.fits else None
        return replay_sized(events, sizes, categories, AllocatorConfig(capacity=cap), True, streams, record=record)


def view_of(step: Step, batch_size: int, card: GPU, reserve_bytes: int = 0) -> StepView:
    """The view of ``step`` at ``batch_size`` on ``card``, its report replayed as the planner replays it."""
    return StepView(step, card, batch_size, reserve_bytes, report_from_step(step, batch_size, card,
                                                                            reserve_bytes=reserve_bytes))
