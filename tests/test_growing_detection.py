"""A real detection model's step grows by the sample (estimator/plan/growing.py): torchvision's Faster R-CNN
loops over its images in the transform, the anchors, the proposals and the RoI heads' sampling, so its step is
not affine in the batch; the growing trace found on batches 1 to 5 is its full simulation at a larger batch,
byte for byte, and the planner answers from it with six full simulations."""

from __future__ import annotations

import pytest

from estimator.gpus import get_gpu
from estimator.models import build
from estimator.pipeline import estimate
from estimator.plan.growing import Deeper, GrowingTrace, grow
from estimator.plan.results import SearchMethod
from estimator.request.adapt import job_of
from estimator.request.parse import parse_request
from estimator.simulate.source import Simulator

pytestmark = pytest.mark.sim
DETECTION = {"source": "torchvision", "name": "fasterrcnn_mobilenet_v3_large_320_fpn"}


def test_detection_grows_byte_for_byte() -> None:
    job = job_of(parse_request({"model": DETECTION, "gpus": ["A100-80GB"]}))
    simulator = Simulator(build(job.model, job.input), job.recipe)
    card = get_gpu("A100-80GB")
    traces, found = {}, None
    for batch in range(1, 6):
        traces[batch] = simulator.simulate(batch, card)[0]
        if batch >= 3:
            try:
                found = grow(traces, 1)
                break
            except Deeper:
                continue
    assert isinstance(found, GrowingTrace)
    assert found.rule.segments  # the images' loops: events inserted per image
    full = simulator.simulate(9, card)[0]
    assert found.matches(full, 9)
    assert found.at(9).allocations == full.allocations and found.at(9).events == full.events


@pytest.mark.sim_slow
def test_a_detection_estimate_searches_by_replays_of_the_growing_trace() -> None:
    """Two cards: the growing trace, checked by a full simulation at the larger max + 1, answers both."""
    response = estimate(parse_request({"model": DETECTION, "gpus": ["T4-16GB", "L4-24GB"],
                                       "planner": {"suggestions": False, "curve_points": 0}}))
    assert [r.search.method for r in response.results] == [SearchMethod.AFFINE_CHECKED] * 2
    top = max(r.max_batch_size or 0 for r in response.results)
    assert {r.search.checked_batch for r in response.results} == {top + 1}
    assert response.provenance.simulations == 6  # batches 1 to 5 and the check
    assert any("loops over the samples grown" in a for a in response.assumptions)
