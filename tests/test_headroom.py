"""The headroom behind ``recommended_batch_size`` (planner.headroom, default 0.10).

``max_batch_size`` stays the simulator's exact answer; the recommendation is
the largest (aligned) batch that fits with its device peak (reserved + CUDA
context) at most (1 - headroom) x usable memory, usable = capacity - CUDA
context - reserve: the max of the card with its allocator held there.
"""

from __future__ import annotations

import pytest
from support import build_request

from estimator.errors import SpecError
from estimator.gpus import CATALOG, custom_gpu, get_gpu
from estimator.models import BuiltModel
from estimator.options import DEFAULT_HEADROOM, DEFAULT_RESERVE_BYTES, MAX_BATCH
from estimator.pipeline import estimate
from estimator.plan.results import WarningCode
from estimator.plan.search import aligned_within, headroom_capacity
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim


def test_headroom_capacity() -> None:
    # 10% of 1000 usable bytes kept free, and the 100 B context counted in the device peak: 800 for the allocator
    assert headroom_capacity(1000, 100, 0.10) == 800
    assert headroom_capacity(1000, 100, 0.0) == 900
    assert headroom_capacity(100, 100, 0.5) == 0


@pytest.mark.parametrize("fails_at, room, expected", [
    ((), 101, 96),        # 96 gives up 5%: aligned
    ((96,), 101, 101),    # 96 does not fit (allocator blocks); 88 would give up 12.9%: the probed batch
    ((88,), 95, 95),      # 88 gives up 7.4% but does not fit; 80 would give up 15.8%
    ((192,), 199, 184),   # 192 does not fit; 184 gives up 7.5% and fits
    ((), 9, 9),           # 8 would give up 11%
])
def test_aligned_within(fails_at, room, expected) -> None:
    assert aligned_within(lambda b: b not in fails_at, room) == expected


def _limit(gpu: str, headroom: float = DEFAULT_HEADROOM) -> int:
    return int((1 - headroom) * get_gpu(gpu).usable_bytes(DEFAULT_RESERVE_BYTES))


def _held(gpu: str, headroom: float = DEFAULT_HEADROOM) -> dict:
    """The card with its allocator held to the headroom, as a custom card of the request."""
    card = get_gpu(gpu)
    capacity = headroom_capacity(card.usable_bytes(DEFAULT_RESERVE_BYTES), card.context_bytes, headroom)
    return {"name": f"{gpu} held", "memory_bytes": capacity + card.context_bytes + DEFAULT_RESERVE_BYTES,
            "compute_capability": card.compute_capability, "context_bytes": card.context_bytes}


@pytest.mark.zoo  # a sweep over models: the zoo tier
@pytest.mark.parametrize("name", sorted(ZOO))
def test_recommended_leaves_the_headroom_on_every_card(name: str) -> None:
    mf, bf, lf = ZOO[name]
    built = BuiltModel(f"test:{name}", mf, bf, lf, {}, 0)
    request = parse_request({"model": {"source": "custom", "factory": "x:y"}, "planner": {"align": False}},
                            allow_local_code=True)
    response = estimate(request, built=built)
    assert len(response.results) == len(CATALOG)
    for r in response.results:
        if r.max_batch_size is None:
            assert r.recommended_batch_size is None
            continue
        rec = r.recommended_batch_size
        assert rec is not None and rec <= r.max_batch_size, r.gpu
        assert r.recommended_memory.batch_size == rec and r.max_memory.batch_size == r.max_batch_size
        assert r.recommended_memory.fits and r.recommended_memory.device_peak_bytes <= _limit(r.gpu), r.gpu
    assert any("headroom" in line for line in response.assumptions)
    # the largest such batch: one more does not fit with the allocator held there (the smallest card
    # where the recommendation lies below the max)
    r = next((r for r in response.results if r.max_batch_size and r.recommended_batch_size < r.max_batch_size), None)
    if r is None:  # a model so small that every card, held or not, reaches the batch limit
        assert {r.max_batch_size for r in response.results} == {r.recommended_batch_size
                                                                  for r in response.results} == {MAX_BATCH}
        return
    held = {"model": {"source": "custom", "factory": "x:y"}, "gpus": [_held(r.gpu)],
            "batch_size": r.recommended_batch_size + 1}
    above = estimate(parse_request(held, allow_local_code=True), built=built).results[0]
    assert not above.memory.fits, r.gpu
    # the held card's max is the recommendation, up to the allocator's few non-monotone batches near it
    assert abs(above.max_batch_size - r.recommended_batch_size) <= 0.01 * r.recommended_batch_size


def test_recommended_is_aligned_and_independently_leaves_the_headroom() -> None:
    """resnet18 on a T4 and an A100: a fresh full simulation at the recommendation, with the allocator held
    to the headroom, fits within 90% of the usable memory."""
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                             "gpus": ["T4-16GB", "A100-40GB"]})
    response = estimate(request)
    built = build_request(request)
    for r in response.results:
        rec = r.recommended_batch_size
        assert rec % 8 == 0 and rec < r.max_batch_size
        held = _held(r.gpu)
        card = custom_gpu(held["name"], held["memory_bytes"], held["compute_capability"], held["context_bytes"])
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, rec, Recipe(), card)
        fresh = report_from_trace(trace, rec, card, reserve_bytes=DEFAULT_RESERVE_BYTES)
        assert fresh.fits and fresh.device_peak_bytes == r.recommended_memory.device_peak_bytes <= _limit(r.gpu)
        # ... and without alignment, the largest batch that does lies above, by less than 10%
        unaligned = estimate(request.model_copy(update={"gpus": [r.gpu]}), align=False).results[0]
        assert rec <= unaligned.recommended_batch_size < rec / 0.9


def test_more_headroom_recommends_less() -> None:
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-40GB"]}
    recs = [estimate(parse_request({**body, "planner": {"headroom": h, "align": False}})).results[0]
            for h in (0.0, 0.1, 0.3)]
    assert recs[0].max_batch_size == recs[1].max_batch_size == recs[2].max_batch_size
    assert recs[0].recommended_batch_size > recs[1].recommended_batch_size > recs[2].recommended_batch_size
    # headroom 0: the max with the context counted twice (in the device peak and out of the usable
    # memory), 420 MiB less for the allocator: within 2% of the max here
    assert 0.98 * recs[0].max_batch_size <= recs[0].recommended_batch_size <= recs[0].max_batch_size
    for r, h in zip(recs, (0.0, 0.1, 0.3), strict=True):
        assert r.recommended_memory.device_peak_bytes <= _limit("A100-40GB", h)
        # about (1 - h) of the max: memory is close to affine in the batch
        assert abs(r.recommended_batch_size / r.max_batch_size - (1 - h)) < 0.05


def test_no_recommendation_when_the_smallest_batch_leaves_no_headroom() -> None:
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
            "planner": {"headroom": 0.99}}
    response = estimate(parse_request(body))
    (r,) = response.results
    assert r.max_batch_size is not None and r.recommended_batch_size is None and r.recommended_memory is None
    assert r.step_seconds is None
    assert [w.code for w in response.warnings] == [WarningCode.NO_RECOMMENDATION]
    # the FSDP searches of the suggestions stop once what FSDP does not shard (activations, inputs, buffers)
    # exceeds the 1% left: 12 simulations, where doubling to 1024 ranks (twice) took 44
    assert response.provenance.simulations <= 16 and r.suggestions == []


@pytest.mark.parametrize("value, expected", [
    (1.0, "less than 1"), (-0.1, "greater than or equal to 0"), ("0.1", "a valid number"),
])
def test_headroom_errors_name_the_field(value, expected) -> None:
    with pytest.raises(SpecError) as err:
        parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "planner": {"headroom": value}})
    assert err.value.field == "planner.headroom" and expected in str(err.value)


def test_zero_grad_after_the_forward_keeps_the_gradients_through_it() -> None:
    """vit_b_16 at batch 8: its peak, the forward's end, then carries the previous step's gradients too."""
    peaks = {}
    for where in ("step-start", "after-forward"):
        request = parse_request({"model": {"source": "torchvision", "name": "vit_b_16"}, "gpus": ["A100-40GB"],
                                 "batch_size": 8, "training": {"zero_grad_at": where, "optimizer": {"name": "sgd"}},
                                 "planner": {"confirm": "none", "curve_points": 0}})
        response = estimate(request)
        peaks[where] = (response.results[0].memory, response.breakdown)
        assert any("zero_grad before" in line for line in response.assumptions) == (where == "step-start")
    (late, late_parts), (first, _) = peaks["after-forward"], peaks["step-start"]
    assert late.peak_phase == "forward" and first.peak_phase == "backward"
    # every fp32 gradient is live at that peak: 86,567,656 parameters x 4 B, in blocks at least that large
    assert late_parts.gradients >= 4 * 86_567_656
    # the peak grows by nearly that much (1.397 GB -> 1.729 GB: the step-start peak, in backward, already
    # held 12.8 MB of new gradients and more temporaries)
    grown = late.allocated_peak_bytes - first.allocated_peak_bytes
    assert 0.9 * 4 * 86_567_656 < grown <= 4 * 86_567_656
