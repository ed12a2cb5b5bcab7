"""What to train with at a card's answer: step and epoch time, the memory curve, accumulation, learning rate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from estimator.gpus import GPU
from estimator.options import DEFAULT_EFFICIENCY, AdviceOptions

if TYPE_CHECKING:
    from estimator.plan.steps import Steps



@dataclass(frozen=True)
class AccumulationPlan:
    """micro_batch x steps x ranks = global_batch (>= the target, equal when it divides)."""

    micro_batch: int
    steps: int
    ranks: int
    global_batch: int


def accumulation_plan(target: int, max_micro: int, ranks: int = 1) -> AccumulationPlan:
    """Fewest accumulation steps with a micro-batch no larger than ``max_micro``.

    >>> accumulation_plan(1024, max_micro=100, ranks=4)
    AccumulationPlan(micro_batch=64, steps=4, ranks=4, global_batch=1024)
    """
    per_rank = -(-target // ranks)
    fewest = -(-per_rank // max_micro)
    for steps in range(fewest, 2 * fewest + 1):  # an exact split, if one costs at most 2x the steps
        if per_rank % steps == 0:
            micro = per_rank // steps
            return AccumulationPlan(micro, steps, ranks, micro * steps * ranks)
    micro = -(-per_rank // fewest)  # else round the global batch up
    return AccumulationPlan(micro, fewest, ranks, micro * fewest * ranks)


@dataclass(frozen=True)
class LearningRate:
    rule: str
    lr: float
    warmup: str
    why: str


def lr_advice(optimizer: str, base_lr: float, base_batch: int, batch: int) -> LearningRate:
    """The learning rate for ``batch`` from one tuned at ``base_batch``.

    SGD: the linear scaling rule with gradual warm-up (Goyal et al. 2017);
    the Adam family: square-root scaling (Hoffer et al. 2017; Malladi et al.
    2022 derive it for adaptive methods).
    """
    k = batch / base_batch
    if optimizer in ("sgd", "rmsprop"):
        return LearningRate("linear", base_lr * k,
                            "gradual warm-up: ramp linearly from the base LR to this one over the first 5 epochs",
                            f"batch x{k:g}: gradient noise falls as 1/batch, so the step grows with it "
                            "(Goyal et al. 2017, valid up to ~8k for ResNet-50)")
    return LearningRate("sqrt", base_lr * k ** 0.5, "keep the base recipe's warm-up, at least 1% of the steps",
                        f"batch x{k:g}: adaptive optimizers normalize the gradient, the noise scale grows as "
                        "sqrt(batch) (Hoffer et al. 2017; Malladi et al. 2022)")


def step_seconds(flops: int, peak_tflops: float, efficiency: float = DEFAULT_EFFICIENCY) -> float | None:
    """Seconds per optimizer step: the step's FLOPs at ``efficiency`` of the card's peak."""
    if peak_tflops <= 0:
        return None
    return flops / (peak_tflops * 1e12 * efficiency)


def curve_batches(start: int, best: int, points: int = 10) -> list[int]:
    """About ``points`` batch sizes (at most 2 more) from ``start`` to ``best``, both ends included.

    Powers of two, and 3 x 2^k as well when powers alone give fewer than
    ``points``: the batch sizes people train with, and the same on every card
    (one replay of a shared trace serves them all). Thinned evenly when there
    are more than ``points + 2``; none within 10% below ``best``.

    >>> curve_batches(1, 681)
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 681]
    """
    if best <= start or points <= 1:
        return [best]
    top = best / 1.1
    grid = sorted({start} | {2**k for k in range(best.bit_length()) if start < 2**k < top})
    if len(grid) + 1 < points:
        grid = sorted(set(grid) | {3 * 2**k for k in range(best.bit_length()) if start < 3 * 2**k < top})
    grid.append(best)
    return _thinned(grid, points)


def simulated_curve_batches(simulated: list[int], start: int, best: int, points: int = 10) -> list[int]:
    """The curve of a step searched with full simulations: the batches those simulated from ``start`` to ``best``
    (both simulated: the smallest batch and the max), thinned evenly to about ``points``; no batch that would
    take a simulation of its own.

    >>> simulated_curve_batches([1, 2, 3, 4, 6, 12, 13, 14, 15], 1, 14, points=4)
    [1, 3, 12, 14]
    """
    if best <= start or points <= 1:
        return [best]
    return _thinned(sorted({start, best} | {b for b in simulated if start < b < best}), points)


def _thinned(grid: list[int], points: int) -> list[int]:
    """``grid`` (ascending) evenly thinned to ``points`` when it has more than ``points + 2``, both ends kept."""
    if len(grid) > points + 2:
        grid = sorted({grid[round(i * (len(grid) - 1) / (points - 1))] for i in range(points)})
    return grid


# --- one card's advice ------------------------------------------------------------

@dataclass(frozen=True)
class CurvePoint:
    batch_size: int
    device_peak_bytes: int
    step_seconds: float | None = None
    epoch_seconds: float | None = None
    meets_epoch_limit: Annotated[bool | None, Field(description="epoch_seconds <= planner.max_epoch_seconds")] = None


@dataclass(frozen=True)
class Advice:
    """What to train with on one card: the memory curve up to the max, and for the recommended batch its
    step and epoch time, accumulation plan and learning rate."""

    curve: list[CurvePoint] = field(default_factory=list)
    step_seconds: float | None = None
    epoch_seconds: float | None = None
    meets_epoch_limit: bool | None = None
    max_tokens_per_batch: int | None = None
    accumulation: AccumulationPlan | None = None
    learning_rate: LearningRate | None = None


def advise(steps: Steps, card: GPU, start: int, best: int | None, rec: int | None,
           options: AdviceOptions) -> Advice:
    """Curve, step and epoch time, accumulation and learning rate for one card's answer."""
    if best is None:
        return Advice()
    peak = card.peak_tflops_bf16 if options.low_precision else card.peak_tflops_fp32

    def timing(b: int) -> tuple[float | None, float | None]:
        step = step_seconds(steps.flops(b, card, start), peak, options.efficiency)
        if step is None or options.dataset_size is None:
            return step, None
        return step, -(-options.dataset_size // (b * options.ranks)) * step

    def meets(epoch: float | None) -> bool | None:
        return None if epoch is None or options.max_epoch_seconds is None else epoch <= options.max_epoch_seconds

    curve = []
    batches = curve_batches(start, best, options.curve_points) if options.curve_points else []
    if batches and steps.can_confirm and steps.known_affine(card) is None:
        # searched with full simulations (not affine in the batch): a point elsewhere would cost one more
        batches = simulated_curve_batches(steps.simulated(card), start, best, options.curve_points)
    for b in batches:
        step, epoch = timing(b)
        curve.append(CurvePoint(b, steps.report(b, card, exact=False).device_peak_bytes, step, epoch, meets(epoch)))
    tokens = best * options.seq_len if options.seq_len is not None else None
    if rec is None:  # step time, accumulation and learning rate are for the recommended batch
        return Advice(curve, max_tokens_per_batch=tokens)
    step, epoch = timing(rec)
    accumulation = None
    if options.target_global_batch is not None:
        accumulation = accumulation_plan(options.target_global_batch, rec, options.ranks)
    lr = None
    if options.base_lr is not None and options.base_batch is not None:
        global_batch = accumulation.global_batch if accumulation else rec * options.ranks
        lr = lr_advice(options.optimizer, options.base_lr, options.base_batch, global_batch)
    return Advice(curve, step, epoch, meets(epoch), tokens, accumulation, lr)
