"""The planner's answer driven by a fake step source: ``plan.answer`` needs no model, no torch, no simulation,
only steps (estimator/plan/steps.py's ``StepSource``)."""

from __future__ import annotations

import dataclasses

import pytest

from estimator.gpus import GPU, custom_gpu
from estimator.options import ConfirmMode, PlanOptions
from estimator.plan.answer import answer
from estimator.plan.results import SearchMethod, WarningCode
from estimator.plan.steps import ModelFacts
from estimator.trace import Allocation, Category, Phase, Trace

pytestmark = pytest.mark.unit
MIB = 2**20


class FakeSource:
    """A step of 64 MiB of parameters and 32 MiB of activations per sample, alike on every card."""

    model = ModelFacts("fake", 16 * MIB)
    can_simulate = True
    seeds: dict = {}

    def __init__(self) -> None:
        self.simulated: list[int] = []

    def signature(self, gpu: GPU) -> str:
        return "shared"

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        self.simulated.append(batch)
        allocations = [Allocation(64 * MIB, Phase.SETUP, "", "empty", 0, Category.PARAMETER),
                       Allocation(32 * MIB * batch, Phase.FORWARD, "fc", "mm", 1, Category.ACTIVATION)]
        return Trace(allocations, [(True, 0), (True, 1), (False, 1)], flops=1000 * batch), 1


# Sizes above 10 MiB in multiples of 2 MiB get a segment of exactly their size (CUDACachingAllocator.cpp,
# get_allocation_size), so the step at batch b holds 64 + 32 b MiB at its peak.
CARD = custom_gpu("fake-card", (64 + 32 * 10) * MIB, "8.0", context_bytes=0)  # usable: 384 MiB


def test_the_answer_from_a_fake_source_is_the_hand_derived_one() -> None:
    source = FakeSource()
    response = answer(source, [CARD], PlanOptions(reserve_bytes=0))
    result = response.results[0]
    assert result.max_batch_size == 10  # 64 + 32 x 10 = 384 MiB = usable; batch 11 needs 416
    assert result.search.method == SearchMethod.AFFINE_CHECKED and result.search.checked_batch == 11
    # headroom 10 %: the device peak within 0.9 x 384 = 345.6 MiB: 64 + 32 x 8 = 320 fits, 9 needs 352
    assert result.recommended_batch_size == 8
    assert response.warnings == []
    assert response.per_sample_bytes == 32 * MIB and response.fixed_bytes == 64 * MIB
    assert response.flops_per_sample == 1000
    assert response.provenance.simulations == len(set(source.simulated)) == 3  # batches 1, 2 and the check at 11


def test_a_card_that_does_not_fit_batch_one_is_named_with_its_batch() -> None:
    small = custom_gpu("tiny-card", (64 + 16 + 500) * MIB, "8.0", context_bytes=500 * MIB)
    response = answer(FakeSource(), [small], PlanOptions(reserve_bytes=0, confirm=ConfirmMode.NONE,
                                                         suggestions=False))
    assert response.results[0].max_batch_size is None
    assert [(w.code, w.message) for w in response.warnings] == [
        (WarningCode.DOES_NOT_FIT, "fake does not fit on tiny-card even at batch 1")]


def test_step_time_under_fsdp_mixed_precision_uses_the_16_bit_peak() -> None:
    """FSDP2's recipe: training.precision fp32 with fsdp.param_dtype bf16 computes in bf16, so the step takes
    the card's bf16 tensor-core peak (an A100: 312 TFLOP/s, not 19.5 fp32), and the assumption line says which."""
    from estimator.options import AdviceOptions
    from estimator.request.adapt import job_of
    from estimator.request.parse import parse_request

    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-80GB"],
                             "training": {"precision": "fp32", "distributed": {
                                 "strategy": "fsdp", "world_size": 8, "fsdp": {"param_dtype": "bf16"}}}})
    advice = job_of(request).plan.advice
    assert (advice.compute, advice.compute_from) == ("bf16", "training.distributed.fsdp.param_dtype bf16")
    card = custom_gpu("fast-card", (64 + 32 * 10) * MIB, "8.0", context_bytes=0)
    card = dataclasses.replace(card, peak_tflops_bf16=312.0, peak_tflops_fp32=19.5)
    response = answer(FakeSource(), [card], PlanOptions(reserve_bytes=0, advice=dataclasses.replace(
        AdviceOptions(), compute=advice.compute, compute_from=advice.compute_from)))
    # 1000 FLOPs per sample at the recommended batch 8, at 40 % of 312 TFLOP/s
    assert response.results[0].step_seconds == pytest.approx(8 * 1000 / (312e12 * 0.4))
    assert any("bf16 tensor-core peak (training.distributed.fsdp.param_dtype bf16)" in a
               for a in response.assumptions)
