"""The headroom behind ``recommended_batch_size`` (planner.headroom, default 0.10).

``max_batch_size`` stays the simulator's exact answer; the recommendation is
the largest (aligned) batch whose predicted device peak is at most
(1 - headroom) x usable memory, usable = capacity - CUDA context - reserve.
"""

from __future__ import annotations

import pytest

from estimator.errors import SpecError
from estimator.estimate import estimate
from estimator.gpus import CATALOG, get_gpu
from estimator.models import BuiltModel, build
from estimator.planner import DEFAULT_HEADROOM, DEFAULT_RESERVE_BYTES, headroom_batch
from estimator.recipe import Recipe
from estimator.report import report_from_trace
from estimator.spec import parse_request
from estimator.trace import record_training
from zoo import ZOO


@pytest.mark.parametrize("peaks, limit, expected", [
    # peak(b) = 100 + 10 b: 100 + 10 b <= 450 up to b = 35
    ({b: 100 + 10 * b for b in range(1, 41)}, 450, 35),
    ({b: 100 + 10 * b for b in range(1, 41)}, 10_000, 40),  # the max itself leaves the headroom
    ({b: 100 + 10 * b for b in range(1, 41)}, 109, None),   # not even batch 1
    ({b: 100 + 10 * b for b in range(1, 41)}, 110, 1),
])
def test_headroom_batch(peaks, limit, expected) -> None:
    assert headroom_batch(peaks.__getitem__, limit, 1, max(peaks)) == expected


def _limit(gpu: str, headroom: float = DEFAULT_HEADROOM) -> int:
    return int((1 - headroom) * get_gpu(gpu).usable_bytes(DEFAULT_RESERVE_BYTES))


@pytest.mark.parametrize("name", sorted(n for n in ZOO if n != "lstm"))  # LSTMs: CPU target only (cuDNN RNN)
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
        limit = _limit(r.gpu)
        rec = r.recommended_batch_size
        assert rec is not None and rec <= r.max_batch_size, r.gpu
        assert r.recommended_memory.batch_size == rec and r.max_memory.batch_size == r.max_batch_size
        assert r.recommended_memory.device_peak_bytes <= limit, r.gpu
    assert any("headroom" in line for line in response.assumptions)
    # the largest such batch: one more crosses the limit (on the smallest card where the max lies above)
    r = next((r for r in response.results if r.max_batch_size and r.recommended_batch_size < r.max_batch_size), None)
    if r is not None:
        above = estimate(request.model_copy(update={"gpus": [r.gpu], "batch_size": r.recommended_batch_size + 1}),
                         built=built).results[0]
        assert above.memory.device_peak_bytes > _limit(r.gpu), r.gpu


def test_recommended_is_aligned_and_independently_leaves_the_headroom() -> None:
    """resnet18 on a T4 and an A100: a fresh full simulation at the recommendation stays within 90%."""
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                             "gpus": ["T4-16GB", "A100-40GB"]})
    response = estimate(request)
    built = build(request)
    for r in response.results:
        card = get_gpu(r.gpu)
        rec = r.recommended_batch_size
        assert rec % 8 == 0 and rec < r.max_batch_size
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, rec, Recipe(), card)
        fresh = report_from_trace(trace, rec, card, reserve_bytes=DEFAULT_RESERVE_BYTES)
        assert fresh.device_peak_bytes == r.recommended_memory.device_peak_bytes
        assert fresh.device_peak_bytes <= _limit(r.gpu)
        # ... and without alignment, the largest batch that does lies above, by less than 10%
        unaligned = estimate(request.model_copy(update={"gpus": [r.gpu]}), align=False).results[0]
        assert rec <= unaligned.recommended_batch_size < rec / 0.9


def test_more_headroom_recommends_less() -> None:
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-40GB"]}
    recs = [estimate(parse_request({**body, "planner": {"headroom": h, "align": False}})).results[0]
            for h in (0.0, 0.1, 0.3)]
    assert recs[0].max_batch_size == recs[1].max_batch_size == recs[2].max_batch_size
    assert recs[0].recommended_batch_size > recs[1].recommended_batch_size > recs[2].recommended_batch_size
    for r, h in zip(recs, (0.0, 0.1, 0.3)):
        assert r.recommended_memory.device_peak_bytes <= _limit("A100-40GB", h)


def test_no_recommendation_when_the_smallest_batch_leaves_no_headroom() -> None:
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
            "planner": {"headroom": 0.99}}
    response = estimate(parse_request(body))
    (r,) = response.results
    assert r.max_batch_size is not None and r.recommended_batch_size is None and r.recommended_memory is None
    assert any("leaves less than 99%" in w for w in response.warnings)


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
