"""The planner's answer driven by a fake step source: ``plan.answer`` needs no model, no torch, no simulation,
only steps (estimator/plan/steps.py's ``StepSource``)."""

from __future__ import annotations

import dataclasses

import pytest

from estimator.gpus import GPU, custom_gpu
from estimator.options import AdviceOptions, ConfirmMode, PlanOptions
from estimator.plan.answer import answer
from estimator.plan.results import SearchMethod, WarningCode
from estimator.plan.steps import ModelFacts
from estimator.plan.worlds import WORLD
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

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """Nothing runs beside the caller here."""


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


def test_a_fit_is_the_reports_without_the_replay_without_a_capacity() -> None:
    """``Steps.fits`` answers as ``report(...).fits`` does, from the replay with the card's capacity alone: a step
    that does not fit is not replayed again without one (what a report says it would need)."""
    from estimator.plan.steps import Steps

    quick, full = Steps(FakeSource()), Steps(FakeSource())
    batches = range(1, 13)
    assert [quick.fits(b, CARD) for b in batches] == [full.report(b, CARD).fits for b in batches] == \
        [b <= 10 for b in batches]
    assert len(quick.replays._unlimited) == 10  # those that fit stand for their own replay without a capacity
    assert len(full.replays._unlimited) == 12  # the reports of batches 11 and 12 replayed theirs too


def test_a_card_that_does_not_fit_batch_one_is_named_with_its_batch() -> None:
    small = custom_gpu("tiny-card", (64 + 16 + 500) * MIB, "8.0", context_bytes=500 * MIB)
    response = answer(FakeSource(), [small], PlanOptions(reserve_bytes=0, confirm=ConfirmMode.NONE,
                                                         suggestions=False))
    assert response.results[0].max_batch_size is None
    assert [(w.code, w.message) for w in response.warnings] == [
        # 64 + 32 MiB at batch 1 against 80 MiB usable
        (WarningCode.DOES_NOT_FIT, "fake does not fit on tiny-card even at batch 1: needs 0.094 GiB at batch 1; "
                                   "tiny-card has 0.078 GiB usable")]


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


class FakeJob(FakeSource):
    """The fake step as a request change makes it: checkpointing keeps 12 MiB of activations per sample instead
    of 32, pure bf16 halves the parameters (and their state: here one 64 MiB block), FSDP shards them. (Sizes of
    10 MiB and more get segments of their own size, rounded to 2 MiB: CUDACachingAllocator.cpp,
    get_allocation_size.)"""

    def __init__(self, change: dict) -> None:
        super().__init__()
        self.change = change

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        params = 64 * MIB // (2 if self.change.get("training.precision") == "bf16" else 1)
        params //= self.change.get("training.distributed.world_size", 1)
        per_sample = (12 if self.change.get("training.gradient_checkpointing") else 32) * MIB
        allocations = [Allocation(params, Phase.SETUP, "", "empty", 0, Category.PARAMETER),
                       Allocation(per_sample * batch, Phase.FORWARD, "fc", "mm", 1, Category.ACTIVATION)]
        return Trace(allocations, [(True, 0), (True, 1), (False, 1)], flops=1000 * batch), 1


def _suggested(card: GPU, options: PlanOptions):
    made: list[dict] = []

    def source_for(change):
        made.append(dict(change))
        return FakeJob(dict(change))
    return answer(FakeJob({}), [card], options, source_for=source_for), made


def test_suggestions_land_on_a_recommended_batch_and_say_what_they_reach() -> None:
    # usable 96 MiB: batch 1 needs 96 (fits, max 1) but the headroom holds 86.4: no recommendation
    card = custom_gpu("card-96", 96 * MIB, "8.0", context_bytes=0)
    response, _ = _suggested(card, PlanOptions(reserve_bytes=0, confirm=ConfirmMode.NONE))
    result = response.results[0]
    assert (result.max_batch_size, result.recommended_batch_size) == (1, None)
    # checkpointing: 64 + 12 b: max 2 (88), recommended 1 (76 <= 86.4); pure bf16: 32 + 32 b: max 2 (96),
    # recommended 1 (64); FSDP over 2 ranks: 32 + 32 b per rank, as bf16. foreach and SGD change nothing here.
    assert [(s.description.split(" (")[0], s.max_batch_size, s.recommended_batch_size, s.world_size)
            for s in result.suggestions] == [("gradient checkpointing", 2, 1, 1), ("pure bf16", 2, 1, 1),
                                             ("FSDP", 2, 1, 2)]
    assert result.suggestions[-1].change == {"training.distributed.strategy": "fsdp",
                                             "training.distributed.world_size": 2}
    warning = next(w for w in response.warnings if w.code == WarningCode.NO_RECOMMENDATION)
    assert "; a batch is recommended with gradient checkpointing" in warning.message
    assert "(max 2, recommended 1)" in warning.message and "over 2 ranks (max 2, recommended 1 per rank)" \
        in warning.message


def test_a_card_no_single_change_lands_on_gets_their_combination() -> None:
    # usable 50 MiB, 45 within the headroom: checkpointing alone needs 64 + 12 = 76, pure bf16 32 + 32 = 64;
    # together 32 + 12 = 44 lands. Plain FSDP doubles the ranks: 2 and 4 leave 32 and 16 MiB shards (64, 48);
    # 8 to 32 leave shards under 10 MiB, which take a 20 MiB segment each (52); 64 leave 1 MiB, a 2 MiB
    # small-pool segment (34): the search lands at 64 (bisecting 33-63 finds no fewer)
    card = custom_gpu("card-50", 50 * MIB, "8.0", context_bytes=0)
    response, _ = _suggested(card, PlanOptions(reserve_bytes=0, confirm=ConfirmMode.NONE))
    result = response.results[0]
    assert result.max_batch_size is None
    stack, fsdp = result.suggestions
    assert stack.change == {"training.gradient_checkpointing": True, "training.optimizer.foreach": False,
                            "training.precision": "bf16"}
    assert stack.description == "gradient checkpointing + optimizer.foreach false + pure bf16"
    assert (stack.max_batch_size, stack.recommended_batch_size) == (1, 1)
    assert fsdp.world_size == 64 and fsdp.change == {"training.distributed.strategy": "fsdp",
                                                     "training.distributed.world_size": 64}
    warning = next(w for w in response.warnings if w.code == WarningCode.DOES_NOT_FIT)
    assert warning.message.startswith("fake does not fit on card-50 even at batch 1: needs 0.1 GiB at batch 1; "
                                      "card-50 has 0.0 GiB usable; it fits with gradient checkpointing + ")


def test_fsdp_takes_the_levers_it_needs_when_ranks_alone_are_not_enough() -> None:
    # usable 34 MiB, 30.6 within the headroom: 32 MiB of activations per sample never fit however many ranks
    # shard the parameters; every lever together needs 32 + 12 = 44; FSDP with them: 32 / 2 + 12 = 28 at 2
    # ranks, and with checkpointing alone 64 / 2 + 12 = 44, with bf16 alone 16 + 32: both are needed
    card = custom_gpu("card-34", 34 * MIB, "8.0", context_bytes=0)
    response, made = _suggested(card, PlanOptions(reserve_bytes=0, confirm=ConfirmMode.NONE))
    (fsdp,) = response.results[0].suggestions
    assert fsdp.change == {"training.gradient_checkpointing": True, "training.precision": "bf16",
                           "training.distributed.strategy": "fsdp", "training.distributed.world_size": 2}
    assert fsdp.description == "FSDP (fully_shard per block) over 2 ranks + gradient checkpointing + pure bf16"
    # plain FSDP was tried and given up at 2 ranks, not doubled to 1024: its 32 MiB of activations, which no
    # rank count shards, already exceed the 30.6 MiB the headroom leaves
    plain = [c[WORLD] for c in made if set(c) == {"training.distributed.strategy", WORLD}]
    assert plain == [2]


class CopiesPastOne(FakeJob):
    """The fake job whose step copies 2 MiB a sample from batch 2 on (at batch 1 the op folds into a view): the
    fit through batches 1 and 2 is rejected, the planner's search would fit through 2 and 3."""

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        self.simulated.append(batch)
        trace, runs = super().simulate(batch, gpu)
        if batch == 1:
            return trace, runs
        copy = Allocation(2 * MIB * batch, Phase.FORWARD, "fc", "clone", 1, Category.ACTIVATION)
        return Trace([*trace.allocations, copy], [(True, 0), (True, 1), (True, 2), (False, 2), (False, 1)],
                     flops=trace.flops), runs


def test_a_suggestion_whose_next_batch_does_not_fit_simulates_no_further() -> None:
    # usable 80 MiB, 72 within the headroom: batch 1 needs 96; pure bf16 32 + 32 = 64 lands, and its full step
    # at batch 2 (32 + 64 + 4 = 100) does not fit: max 1 without a fit through batches 2 and 3; FSDP over 2
    # ranks is the same step
    card = custom_gpu("card-80", 80 * MIB, "8.0", context_bytes=0)
    sources: dict[str, CopiesPastOne] = {}

    def source_for(change):
        sources[repr(sorted(change.items()))] = job = CopiesPastOne(dict(change))
        return job
    response = answer(CopiesPastOne({}), [card], PlanOptions(reserve_bytes=0), source_for=source_for)
    assert [(s.description.split(" (")[0], s.max_batch_size, s.recommended_batch_size, s.world_size)
            for s in response.results[0].suggestions] == [("pure bf16", 1, 1, 1), ("FSDP", 1, 1, 2)]
    bf16 = sources[repr([("training.precision", "bf16")])]
    fsdp = sources[repr(sorted({"training.distributed.strategy": "fsdp", WORLD: 2}.items()))]
    assert sorted(set(bf16.simulated)) == sorted(set(fsdp.simulated)) == [1, 2]


class NotAffineSource(FakeSource):
    """The fake step with one more op per sample (a per-image loop, as detection models have) whose op also
    changes with the batch's parity: neither affine nor growing by segments in the batch, so every card is
    searched with full simulations. Records the guesses the planner starts beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.guesses: list[tuple[int, int | None]] = []

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        self.simulated.append(batch)
        allocations = [Allocation(64 * MIB, Phase.SETUP, "", "empty", 0, Category.PARAMETER)]
        events = [(True, 0)]
        op = "mm" if batch % 2 else "bmm"
        for _ in range(batch):
            allocations.append(Allocation(32 * MIB, Phase.FORWARD, "fc", op, 1, Category.ACTIVATION))
            events.append((True, len(allocations) - 1))
        events += [(False, k) for k in range(1, len(allocations))]
        return Trace(allocations, events, flops=1000 * batch), 1

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        self.guesses.append((batch, keep))


def test_a_step_not_affine_is_searched_by_full_simulations_its_curve_from_them() -> None:
    """Cards searched with full simulations: each new probe starts the one a batch above beside it (the probe
    being asked for kept), and the curve takes its points from the batches simulated: none of its own."""
    source = NotAffineSource()
    response = answer(source, [CARD], PlanOptions(reserve_bytes=0))
    result = response.results[0]
    assert result.search.method == SearchMethod.FULL
    assert (result.max_batch_size, result.recommended_batch_size) == (10, 8)  # as the affine fake's
    simulated = set(source.simulated)
    assert {p.batch_size for p in result.curve} <= simulated
    assert result.curve[0].batch_size == 1 and result.curve[-1].batch_size == 10
    without = NotAffineSource()
    answer(without, [CARD], PlanOptions(reserve_bytes=0, advice=AdviceOptions(curve_points=0)))
    assert set(without.simulated) == simulated  # the curve simulated nothing more
    new = [b for b, _ in source.guesses]
    assert source.guesses and all(keep == b - 1 for b, keep in source.guesses)
    assert all(b - 1 in simulated for b in new)  # each guess sits a batch above a probe that was simulated


def test_beside_a_recommendation_probe_the_multiple_of_8_it_would_take_is_guessed() -> None:
    """Max 20 (64 + 32 x 20 MiB usable); with the headroom (0.9 x 704 = 633.6 MiB) 17 fits, 18 does not, and 17
    rounds down to 16 (giving up under 10 %): while 17 is probed, 16 is simulated beside it."""
    source = NotAffineSource()
    card = custom_gpu("fake-card-20", (64 + 32 * 20) * MIB, "8.0", context_bytes=0)
    result = answer(source, [card], PlanOptions(reserve_bytes=0)).results[0]
    assert (result.max_batch_size, result.recommended_batch_size) == (20, 16)
    assert (16, 17) in source.guesses and 16 in source.simulated


def test_the_recommendations_replays_run_while_the_top_check_simulates(monkeypatch) -> None:
    """On several cards the top check simulates beside the replays: the replays each card's recommendation
    searches by (its headroom's capacity) and its memory curve's run before the check is collected, none again
    after it, and the answer and the replays run are those of the order without it."""
    import estimator.plan.replays as replays
    from estimator.plan import strategy
    from estimator.plan.results import to_json
    from estimator.plan.steps import Steps

    cards = [CARD, custom_gpu("wider", (64 + 32 * 20) * MIB, "8.0", context_bytes=0),
             custom_gpu("widest", (64 + 32 * 37) * MIB, "8.0", context_bytes=0)]
    run: list[tuple[str, int | None]] = []  # replays run (by capacity) and the check, in order
    replay_sized, check = replays.replay_sized, Steps.check

    def counted(events, sizes, categories, config, **kw):
        run.append(("replay", config.capacity))
        return replay_sized(events, sizes, categories, config, **kw)

    def checked(self, *args):
        run.append(("check", None))
        return check(self, *args)

    monkeypatch.setattr(replays, "replay_sized", counted)
    monkeypatch.setattr(Steps, "check", checked)
    fast = answer(FakeSource(), cards, PlanOptions(reserve_bytes=0))
    ahead = list(run)
    run.clear()
    monkeypatch.setattr(strategy, "_while_checking", lambda *args: None)
    plain = answer(FakeSource(), cards, PlanOptions(reserve_bytes=0))
    after_check = ahead[ahead.index(("check", None)):]
    capacities = {c.usable_bytes(0) for c in cards}
    assert [r.recommended_batch_size for r in fast.results] == [r.recommended_batch_size for r in plain.results] \
        == [8, 16, 32]
    assert {**to_json(fast), "provenance": None} == {**to_json(plain), "provenance": None}
    assert sorted(ahead, key=str) == sorted(run, key=str)  # the same replays, in another order
    headroom = [cap for what, cap in ahead if what == "replay" and cap is not None and cap not in capacities]
    assert headroom and not [cap for what, cap in after_check if what == "replay" and cap in headroom]
    # the memory curves' replays ran before it too (five replays after the check without them): one is left
    assert len([what for what, _ in after_check if what == "replay"]) == 1
