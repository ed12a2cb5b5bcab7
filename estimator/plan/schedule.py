"""A batch-size schedule: the global batch grows during training, and each stage is planned on each card.

Large-batch recipes grow the batch in stages (Goyal et al. 2017 warm up to 8k;
Smith et al. 2018, "Don't decay the learning rate, increase the batch size",
grow it where a schedule would decay the rate). A stage's global batch is
reached with the fewest accumulation steps at a micro-batch no larger than
the card's recommended batch, so every stage fits at the recommended memory.
Every stage reads the same steps: the answer's affine trace and FLOPs, no
simulation of its own.

>>> [s.micro_batch for s in stages(rec=96, targets=[256, 1024], ranks=1)]
[64, 64]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from estimator.gpus import GPU
from estimator.options import AdviceOptions
from estimator.plan.advice import LearningRate, accumulation_plan, lr_advice, step_seconds

if TYPE_CHECKING:
    from estimator.plan.steps import Steps


@dataclass(frozen=True)
class ScheduleStage:
    """One stage on one card: micro_batch x accumulation_steps x ranks = reached_global_batch."""

    global_batch: Annotated[int, Field(description="the stage's global batch, as planner.batch_schedule names it")]
    micro_batch: Annotated[int, Field(description="per rank and forward: at most the recommended batch")]
    accumulation_steps: int
    ranks: int
    reached_global_batch: Annotated[int, Field(description="micro_batch x accumulation_steps x ranks: the "
                                               "global batch when it divides, else the next one that does")]
    step_seconds: Annotated[float | None, Field(description="one optimizer step of the stage (all its "
                                                "accumulation steps)")] = None
    learning_rate: Annotated[LearningRate | None, Field(description="with planner.base_lr: scaled from "
                                                        "planner.base_batch (else the first stage's batch)")] = None


def stages(rec: int, targets: Sequence[int], ranks: int,
           seconds: Callable[[int], float | None] = lambda micro: None,
           lr: Callable[[int], LearningRate | None] = lambda batch: None) -> list[ScheduleStage]:
    """Each target's stage at micro-batches up to ``rec``; ``seconds(micro)``: one micro-batch's step,
    ``lr(global batch)``: its learning rate."""
    out = []
    for target in targets:
        plan = accumulation_plan(target, rec, ranks)
        micro = seconds(plan.micro_batch)
        out.append(ScheduleStage(target, plan.micro_batch, plan.steps, plan.ranks, plan.global_batch,
                                 None if micro is None else micro * plan.steps, lr(plan.global_batch)))
    return out


def batch_schedule(steps: Steps, card: GPU, start: int, rec: int | None,
                   options: AdviceOptions) -> list[ScheduleStage]:
    """``planner.batch_schedule`` on ``card`` whose recommended batch is ``rec`` ([] without either)."""
    if rec is None or not options.batch_schedule:
        return []
    peak = card.peak_tflops_bf16 if options.low_precision else card.peak_tflops_fp32

    def seconds(micro: int) -> float | None:
        # the simulated step holds training.grad_accumulation_steps micro-batches: one is its share
        step = step_seconds(steps.flops(micro, card, start), peak, options.efficiency)
        return None if step is None else step / options.accumulation

    base_lr, base_batch = options.base_lr, options.base_batch or options.batch_schedule[0]

    def lr(batch: int) -> LearningRate | None:
        return None if base_lr is None else lr_advice(options.optimizer, base_lr, base_batch, batch)

    return stages(rec, options.batch_schedule, options.ranks, seconds, lr)
