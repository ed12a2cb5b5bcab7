"""The growing trace (estimator/plan/growing.py): a step with loops over its samples, synthesized at any batch
from full simulations at a few small ones, byte for byte; the planner searches it by replays and checks it by a
full simulation past the largest answer. Fake steps here (no torch); tests/test_growing_detection.py checks a real
detection model."""

from __future__ import annotations

import pytest

from estimator.errors import SpecError
from estimator.gpus import GPU, custom_gpu
from estimator.options import ConfirmMode, PlanOptions
from estimator.plan.answer import answer
from estimator.plan.growing import Deeper, GrowingTrace, grow
from estimator.plan.periodic import NotPeriodic
from estimator.plan.results import SearchMethod
from estimator.plan.steps import ModelFacts, Steps
from estimator.portable.profile import profile_of
from estimator.trace import Allocation, Category, Phase, Trace

pytestmark = pytest.mark.unit
MIB = 2**20


def looped(batch: int, *, queue: bool = True, counted: bool = True, quadratic: bool = False) -> Trace:
    """A detection-like step: 64 MiB of parameters; a batched activation (1 MiB per sample, affine); per sample a
    box list (2 MiB) and a 30 MiB feature; batch 1 takes another path (no batched copy). The boxes are freed
    oldest first (``queue``) or newest first, the features newest first; ``counted``: per sample a 1 MiB mask
    interleaved with 4 KiB scratch, the masks then freed as a loop frees a list's k-th item at its k-th pass
    (the rank from the oldest grows by one per sample); ``quadratic``: a pairwise (IoU-like) matrix of b x b
    KiB, not affine in the batch."""
    allocations: list[Allocation] = []
    events: list[tuple[bool, int]] = []

    def alloc(nbytes: int, op: str, module: str = "head", phase: str = Phase.FORWARD,
              category: str = Category.ACTIVATION) -> int:
        allocations.append(Allocation(nbytes, phase, module, op, 1, category))
        events.append((True, len(allocations) - 1))
        return len(allocations) - 1

    def free(k: int) -> None:
        events.append((False, k))

    alloc(64 * MIB, "empty", "", Phase.SETUP, Category.PARAMETER)
    batched = alloc(MIB * batch, "cat")
    if batch > 1:
        free(alloc(MIB * batch, "copy"))
    if quadratic:
        free(alloc(1024 * batch * batch, "iou"))
    boxes, features = [], []
    for _ in range(batch):
        boxes.append(alloc(2 * MIB, "index"))
        features.append(alloc(30 * MIB, "mm"))
    for k in boxes if queue else reversed(boxes):
        free(k)
    if counted:
        masks, scratch = [], []
        for _ in range(batch):
            masks.append(alloc(MIB, "mask"))
            scratch.append(alloc(MIB, "mask"))  # the same kind and size line: one stack with the masks
        live = [k for pair in zip(masks, scratch, strict=True) for k in pair]
        for k in range(batch):  # the k-th mask is at place k of what is left: rank k from the oldest
            free(live.pop(k))
        for k in live:
            free(k)
    for k in reversed(features):
        free(k)
    free(batched)
    return Trace(allocations, events, flops=1000 * batch)


@pytest.mark.parametrize("queue", [True, False])
@pytest.mark.parametrize("counted", [True, False])
def test_the_growing_trace_is_the_step_at_every_batch(queue: bool, counted: bool) -> None:
    traces = {b: looped(b, queue=queue, counted=counted) for b in range(1, 6)}
    found = None
    for last in range(3, 6):  # as the planner asks: one batch more while a rule may yet hold
        try:
            found = grow({b: traces[b] for b in range(1, last + 1)}, 1)
            break
        except Deeper:
            continue
    assert isinstance(found, GrowingTrace)
    for b in [97, 13, 40, 6, 7, 1, 2, 41]:  # out of order: each grown from the nearest batch kept below it
        step = looped(b, queue=queue, counted=counted)
        assert found.matches(step, b)
        mine = found.at(b)
        assert (mine.allocations, mine.events) == (step.allocations, step.events)
        assert mine.flops == 1000 * b
    # the live bound: the largest batch whose requested bytes live at once fit, as the steps themselves say
    capacity = 64 * MIB + 33 * MIB * 20 + 5 * MIB
    bound = found.live_bound(capacity, 0, 4096)
    assert looped(bound).live_peak(hard_only=True)[0] <= capacity < looped(bound + 1).live_peak(hard_only=True)[0]


def test_a_step_that_grows_otherwise_has_no_growing_trace() -> None:
    with pytest.raises(NotPeriodic):  # a b x b matrix: its bytes not affine in the batch
        grow({b: looped(b, quadratic=True) for b in range(1, 6)}, 1)
    with pytest.raises(NotPeriodic):  # the same ops at every batch: an affine step's business
        grow({b: Trace([Allocation(MIB * b, Phase.FORWARD, "", "mm", 1)], [(True, 0)]) for b in range(1, 4)}, 1)


class LoopSource:
    """``looped`` as the planner's step source: records what it simulates."""

    model = ModelFacts("looped", 16 * MIB)
    can_simulate = True
    seeds: dict = {}

    def __init__(self, **kwargs: bool) -> None:
        self.kwargs = kwargs
        self.simulated: list[int] = []

    def signature(self, gpu: GPU) -> str:
        return "shared"

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        self.simulated.append(batch)
        return looped(batch, **self.kwargs), 1

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """Nothing runs beside the caller here."""


def test_the_planner_searches_a_growing_step_by_replays_and_checks_it_past_the_top() -> None:
    """The answers of the growing trace's replays are the full search's, from batches 1 to 5 and the check
    instead of a search's dozens."""
    cards = [custom_gpu(f"card-{n}", n * MIB, "8.0", context_bytes=0) for n in (400, 800, 1600)]
    grown_source = LoopSource()
    grown = answer(grown_source, cards, PlanOptions(reserve_bytes=0))
    top = max(r.max_batch_size or 0 for r in grown.results) + 1
    assert [r.search.method for r in grown.results] == [SearchMethod.AFFINE_CHECKED] * 3
    assert {r.search.checked_batch for r in grown.results} == {top}
    assert sorted(set(grown_source.simulated)) == [1, 2, 3, 4, 5, top]
    assert any("loops over the samples grown from full simulations" in a for a in grown.assumptions)

    class FullSource(LoopSource):  # the same bytes, but an op named by the batch's parity: no rule holds
        def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
            trace, runs = super().simulate(batch, gpu)
            if batch % 2:
                trace.allocations[-1].op = "odd"
            return trace, runs

    full_source = FullSource()
    full = answer(full_source, cards, PlanOptions(reserve_bytes=0))
    assert [r.search.method for r in full.results] == [SearchMethod.FULL] * 3
    assert [(r.max_batch_size, r.recommended_batch_size) for r in grown.results] == [
        (r.max_batch_size, r.recommended_batch_size) for r in full.results] == [(9, 8), (21, 19), (46, 40)]
    for mine, theirs in zip(grown.results, full.results, strict=True):  # the curve's points the two share agree
        by_batch = {p.batch_size: p for p in theirs.curve}
        shared = [p for p in mine.curve if p.batch_size in by_batch]
        assert shared and all(p == by_batch[p.batch_size] for p in shared)
    assert len(set(full_source.simulated)) > 2 * len(set(grown_source.simulated))


@pytest.mark.parametrize(("confirm", "method"), [(ConfirmMode.NONE, SearchMethod.AFFINE),
                                                 (ConfirmMode.EVERY_CARD, SearchMethod.AFFINE_CONFIRMED)])
def test_the_other_confirm_modes_take_the_growing_trace_too(confirm: ConfirmMode, method: SearchMethod) -> None:
    """``none`` checks it at start + 8 only, ``every-card`` by full simulations at each max and max + 1: the same
    answers as ``top``'s."""
    cards = [custom_gpu(f"card-{n}", n * MIB, "8.0", context_bytes=0) for n in (400, 800)]
    top = answer(LoopSource(), cards, PlanOptions(reserve_bytes=0))
    source = LoopSource()
    other = answer(source, cards, PlanOptions(reserve_bytes=0, confirm=confirm))
    assert [r.search.method for r in other.results] == [method] * 2
    assert [(r.max_batch_size, r.recommended_batch_size) for r in other.results] == [
        (r.max_batch_size, r.recommended_batch_size) for r in top.results]
    assert 9 in source.simulated  # the fit's check at start + 8


def test_a_growing_step_cannot_be_profiled() -> None:
    """A portable profile holds affine traces only: a step that grows by the sample is refused, as before, once
    its affine fits fail."""
    source = LoopSource()
    with pytest.raises(SpecError, match="ops do not change with the batch size"):
        profile_of(Steps(source), lambda card: "shared", [custom_gpu("card", 400 * MIB, "8.0", context_bytes=0)], 1,
                   request={}, versions={})
    assert sorted(set(source.simulated)) == [1, 2, 3]  # the affine fits' batches: no growing trace is sought


def test_past_the_longest_step_it_synthesizes_the_search_is_by_full_simulations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A live bound that would need a step longer than ``MAX_EVENTS`` (here 200 events: about batch 24) is not
    synthesized: the group is searched by full simulations, to the same answers; a flat live peak at the known
    batches gallops up from them rather than jumping to the batch limit."""
    from estimator.plan import growing

    cards = [custom_gpu(f"card-{n}", n * MIB, "8.0", context_bytes=0) for n in (400, 1600)]
    expected = [(r.max_batch_size, r.recommended_batch_size) for r in
                answer(LoopSource(), cards, PlanOptions(reserve_bytes=0)).results]
    monkeypatch.setattr(growing, "MAX_EVENTS", 200)
    capped = answer(LoopSource(), cards, PlanOptions(reserve_bytes=0))
    assert [r.search.method for r in capped.results] == [SearchMethod.FULL] * 2
    assert [(r.max_batch_size, r.recommended_batch_size) for r in capped.results] == expected
    monkeypatch.undo()
    found = grow({b: looped(b) for b in range(1, 6)}, 1)
    probed: list[int] = []
    live_at = found.live_at
    monkeypatch.setattr(found, "live_at", lambda b, ws: probed.append(b) or (live_at(b, ws) if b <= 5 else 0))
    assert found.live_bound(10**12, 0, 4096) == 4096  # nothing bounds a flat peak: the limit, by galloping
    assert sorted(probed)[-2] <= 2048 and len(probed) < 20
