"""What the planner advises beyond the max: curve, time, accumulation, learning rate, seq_len, the
portable profile and the plot."""

from __future__ import annotations

import json

import pytest
from support import build_request

from estimator.errors import SpecError
from estimator.gpus import get_gpu
from estimator.pipeline import estimate, estimate_from_profile, make_profile
from estimator.plan.advice import AccumulationPlan, accumulation_plan, curve_batches, lr_advice, step_seconds
from estimator.portable.profile import PortableProfile
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training

pytestmark = pytest.mark.sim

SMALL_GPT2 = {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 2}}


@pytest.mark.parametrize("target, max_micro, ranks, plan", [
    (1024, 100, 4, AccumulationPlan(64, 4, 4, 1024)),   # 256 per rank: 4 steps of 64
    (1000, 64, 1, AccumulationPlan(50, 20, 1, 1000)),   # 16..19 steps do not divide 1000; 20 x 50 does
    (7, 3, 1, AccumulationPlan(3, 3, 1, 9)),            # no exact split within 2x the steps: round up to 9
    (256, 1000, 8, AccumulationPlan(32, 1, 8, 256)),    # fits in one step per rank
    (1009, 64, 1, AccumulationPlan(64, 16, 1, 1024)),   # 1009 is prime: 16 steps of 64
])
def test_accumulation_plan(target, max_micro, ranks, plan) -> None:
    got = accumulation_plan(target, max_micro, ranks)
    assert got == plan
    assert got.micro_batch <= max_micro and got.global_batch >= target


def test_lr_advice() -> None:
    sgd = lr_advice("sgd", 0.1, 256, 8192)
    assert sgd.rule == "linear" and sgd.lr == pytest.approx(3.2)      # 0.1 x 8192/256 (Goyal et al.)
    adam = lr_advice("adamw", 1e-4, 256, 1024)
    assert adam.rule == "sqrt" and adam.lr == pytest.approx(2e-4)     # 1e-4 x sqrt(4)
    assert "warm-up" in sgd.warmup and "5 epochs" in sgd.warmup


def test_curve_and_step_time() -> None:
    assert curve_batches(1, 681) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 681]  # powers of two, the max
    assert curve_batches(1, 46) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 46]  # and 3 x 2^k when they are too few
    assert curve_batches(2, 20, points=4) == [2, 4, 8, 16, 20]  # at most 2 over
    thinned = curve_batches(1, 2**20)  # 21 powers of two: evenly thinned to 10, both ends kept
    assert len(thinned) == 10 and thinned[0] == 1 and thinned[-1] == 2**20
    assert curve_batches(5, 5) == [5]
    assert curve_batches(1, 100, points=1) == [100]
    # 312 TFLOP/s at 40%: 1.248e14 FLOP take one second
    assert step_seconds(int(1.248e14), 312.0, 0.4) == pytest.approx(1.0)
    assert step_seconds(10, 0.0) is None


def test_resnet50_flops_per_sample() -> None:
    # torchvision's resnet50: 4.089 GMACs forward (its model table) = 8.18 GFLOP; backward is twice
    # the forward (grad wrt inputs and weights) less the first conv's unneeded input gradient
    response = estimate(parse_request({"model": {"source": "torchvision", "name": "resnet50"}, "gpus": ["A100-80GB"],
                                       "planner": {"curve_points": 0}}), confirm="none")
    assert response.flops_per_sample == pytest.approx(3 * 2 * 4.089e9, rel=0.02)


def test_epoch_time_and_limit() -> None:
    base = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-80GB"]}
    planner = {"dataset_size": 1_281_167, "data_parallel_ranks": 8, "target_global_batch": 1024,
               "base_lr": 0.1, "base_batch": 256}
    fast = estimate(parse_request({**base, "planner": {**planner, "max_epoch_seconds": 3600}}), confirm="none")
    (r,) = fast.results
    steps = -(-1_281_167 // (r.recommended_batch_size * 8))
    assert r.epoch_seconds == pytest.approx(steps * r.step_seconds)
    assert r.meets_epoch_limit is True
    limit = r.epoch_seconds / 2
    slow = estimate(parse_request({**base, "planner": {**planner, "max_epoch_seconds": limit}}), confirm="none")
    assert slow.results[0].meets_epoch_limit is False
    # each curve point says whether its batch meets the limit
    assert [p.meets_epoch_limit for p in slow.results[0].curve] == [p.epoch_seconds <= limit
                                                                    for p in slow.results[0].curve]
    assert r.accumulation.global_batch == 1024 and r.accumulation.ranks == 8
    # AdamW (the default optimizer): square-root scaling, 0.1 x sqrt(1024 / 256)
    assert r.learning_rate.rule == "sqrt" and r.learning_rate.lr == pytest.approx(0.2)
    assert [p.batch_size for p in r.curve][-1] == r.max_batch_size
    # from batch 2 on the curve rises (batch 1 takes other paths: 2 MiB more reserved here)
    peaks = [p.device_peak_bytes for p in r.curve]
    assert peaks[1:] == sorted(peaks[1:]) and peaks[-1] == max(peaks)


def test_profile_answers_like_the_spec(tmp_path) -> None:
    request = parse_request({"model": SMALL_GPT2, "input": {"seq_len": 128}, "gpus": ["T4-16GB", "A100-40GB"],
                             "training": {"precision": "amp-bf16"}})
    profile = make_profile(request)
    assert set(profile.steps) == {"MATH", "EFFICIENT"}  # sm75 bf16 falls to math; sm80+ gets efficient (mask)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_json()))
    again = PortableProfile.from_json(json.loads(path.read_text()))
    from_spec = estimate(request, confirm="none")
    from_profile = estimate_from_profile(again, gpus=["T4-16GB", "A100-40GB"])
    assert from_profile.provenance.simulations == 0
    for a, b in zip(from_spec.results, from_profile.results, strict=True):
        assert (a.max_batch_size, a.recommended_batch_size, a.memory, a.curve, a.step_seconds) == \
               (b.max_batch_size, b.recommended_batch_size, b.memory, b.curve, b.step_seconds)
    assert (from_spec.breakdown, from_spec.per_sample_bytes, from_spec.fixed_bytes, from_spec.flops_per_sample) == \
           (from_profile.breakdown, from_profile.per_sample_bytes, from_profile.fixed_bytes,
            from_profile.flops_per_sample)
    with pytest.raises(SpecError) as info:
        PortableProfile.from_json({**profile.to_json(), "version": 999})
    assert info.value.field == "--profile.version"


def test_cli_profile_estimate_and_plot(tmp_path, capsys) -> None:
    """The CLI in-process (estimator.cli.main): a profile answers like the spec, and draws the step."""
    from estimator.cli.main import main

    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({"model": SMALL_GPT2, "input": {"seq_len": 64}, "gpus": ["T4-16GB"]}))

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    made = run("profile", "--spec", str(spec), "-o", str(tmp_path / "p.json"))
    assert made[0] == 0, made[2]
    answered = run("estimate", "--profile", str(tmp_path / "p.json"), "--gpus", "T4-16GB", "--json",
                   "--plot", str(tmp_path / "step.png"))
    assert answered[0] == 0, answered[2]
    direct = run("estimate", "--spec", str(spec), "--json")
    a, b = json.loads(answered[1])["results"][0], json.loads(direct[1])["results"][0]
    assert a["max_batch_size"] == b["max_batch_size"] and a["memory"] == b["memory"]
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = run("estimate", "--spec", str(spec), "--profile", str(tmp_path / "p.json"))
    assert both[0] == 2 and "exactly one of" in both[2]


def test_max_seq_len_fits_and_one_more_does_not() -> None:
    card = {"name": "small", "memory_bytes": 3 * 2**30, "compute_capability": "8.0"}
    request = parse_request({"model": SMALL_GPT2, "input": {"seq_len": 64}, "gpus": [card], "batch_size": 4,
                             "planner": {"max_seq_len": True, "curve_points": 0}})
    (r,) = estimate(request, confirm="none").results
    assert r.max_seq_len is not None and 64 < r.max_seq_len < 1024
    gpu = get_gpu("A100-80GB").__class__("small", 3 * 2**30, (8, 0), 450 * 2**20, 0.0, 0.0)

    def fits(seq: int) -> bool:
        req = parse_request({"model": SMALL_GPT2, "input": {"seq_len": seq}})
        b = build_request(req)
        trace = record_training(b.factory, b.batch_factory, b.loss_fn, 4, Recipe(), gpu)
        return report_from_trace(trace, 4, gpu, reserve_bytes=request.planner.reserve_bytes).fits
    assert fits(r.max_seq_len) and not fits(r.max_seq_len + 1)
