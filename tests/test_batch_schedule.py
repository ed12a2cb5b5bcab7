"""planner.batch_schedule: per card and stage the micro-batch x accumulation x ranks that reaches each global batch
at the recommended memory, the step time and the learning rate, from the answer's own steps (no simulation of
its own), the same from a profile; and the schedule's bounds."""

from __future__ import annotations

import pytest

from estimator import estimate, estimate_from_profile, make_profile, parse_request
from estimator.errors import SpecError
from estimator.plan.schedule import stages

pytestmark = pytest.mark.sim

SCHEDULE = [64, 256, 1000, 4096]
JOB = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
       "training": {"optimizer": {"name": "sgd", "momentum": 0.9}}, "gpus": ["T4-16GB", "A100-80GB"],
       "planner": {"curve_points": 0, "confirm": "none"}}


@pytest.mark.parametrize("rec, target, ranks, micro, steps, reached", [
    (96, 256, 1, 64, 4, 256),      # 256 = 64 x 4: an exact split costs one step more than ceil(256/96) = 3
    (300, 256, 1, 256, 1, 256),    # fits in one micro-batch
    (100, 1000, 4, 50, 5, 1000),   # 250 per rank: 5 x 50, two steps past the fewest (3) for an exact split
    (100, 1010, 1, 92, 11, 1012),  # 1010 has no divisor from 11 to 22 steps: the global batch rounded up
    (7, 4096, 8, 4, 128, 4096),
])
def test_a_stage_is_the_fewest_accumulation_steps_at_most_the_recommended_batch(rec, target, ranks, micro, steps,
                                                                                reached) -> None:
    (stage,) = stages(rec, [target], ranks, seconds=lambda m: 0.01 * m)
    assert (stage.micro_batch, stage.accumulation_steps, stage.ranks, stage.reached_global_batch) == \
        (micro, steps, ranks, reached)
    assert stage.micro_batch <= rec and stage.reached_global_batch >= target
    assert stage.step_seconds == pytest.approx(0.01 * micro * steps)  # every accumulation step runs the micro-batch


@pytest.fixture(scope="module")
def answered():
    plain = estimate(parse_request(JOB))
    schedule = {**JOB, "planner": {**JOB["planner"], "batch_schedule": SCHEDULE, "base_lr": 0.1}}
    return plain, estimate(parse_request(schedule)), schedule


def test_the_schedule_reads_the_answers_own_steps(answered) -> None:
    plain, scheduled, _ = answered
    assert scheduled.provenance.simulations == plain.provenance.simulations  # no simulation of its own
    assert [r.batch_schedule for r in plain.results] == [[], []]
    for result, before in zip(scheduled.results, plain.results, strict=True):
        assert result.recommended_batch_size == before.recommended_batch_size
        rec = result.recommended_batch_size
        assert rec is not None and [s.global_batch for s in result.batch_schedule] == SCHEDULE
        for stage in result.batch_schedule:
            assert stage.micro_batch <= rec  # fits at the recommended memory
            assert stage.micro_batch * stage.accumulation_steps * stage.ranks == stage.reached_global_batch
            assert stage.reached_global_batch >= stage.global_batch
            # SGD: the linear rule from the first stage's batch (no planner.base_batch)
            assert stage.learning_rate is not None and stage.learning_rate.rule == "linear"
            assert stage.learning_rate.lr == pytest.approx(0.1 * stage.reached_global_batch / SCHEDULE[0])
        at_rec = [s for s in result.batch_schedule if s.micro_batch == rec and s.accumulation_steps == 1]
        for stage in at_rec:  # one micro-batch of the recommended batch: the answer's own step time
            assert stage.step_seconds == pytest.approx(result.step_seconds)
        first = result.batch_schedule[0]
        last = result.batch_schedule[-1]
        assert last.step_seconds > first.step_seconds  # more samples per optimizer step


def test_a_profile_answers_the_same_schedule(answered) -> None:
    _, scheduled, schedule = answered
    profile = make_profile(parse_request({**JOB, "gpus": None}))
    again = estimate_from_profile(profile, gpus=JOB["gpus"], planner={"batch_schedule": SCHEDULE, "base_lr": 0.1})
    assert again.provenance.simulations == 0
    assert [r.batch_schedule for r in again.results] == [r.batch_schedule for r in scheduled.results]


@pytest.mark.parametrize("schedule", [[], [0], [2**31], list(range(1, 66)), [1.5]])
def test_a_schedule_out_of_bounds_is_refused(schedule) -> None:
    with pytest.raises(SpecError) as info:
        parse_request({**JOB, "planner": {"batch_schedule": schedule}})
    assert info.value.field.startswith("planner.batch_schedule")
