"""The views of one step on hand-made traces: the timeline (estimator/replay/timeline.py) and the memory snapshot
(estimator/replay/snapshot.py); each byte count derived in a comment."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from support import A100_80 as A100

from estimator.gpus import custom_gpu
from estimator.replay.snapshot import snapshot_of
from estimator.replay.timeline import MAX_POINTS, ORDER, category_timeline, sample, timeline_of
from estimator.replay.view import view_of
from estimator.trace import Allocation, Category, Trace

pytestmark = pytest.mark.unit

MiB = 2**20

# (bytes, phase, module, op, category) of each allocation
ALLOCATIONS = [
    (4 * MiB, "setup", "fc", "empty", Category.PARAMETER),          # 0
    (1 * MiB, "input", "", "empty", Category.INPUT),                # 1
    (3 * MiB, "forward", "fc", "mm", Category.ACTIVATION),          # 2
    (614400, "forward", "fc", "relu", Category.TEMPORARY),          # 3: 600 KiB
    (4 * MiB, "backward", "fc", "mm", Category.GRADIENT),           # 4
    (2 * MiB, "backward", "fc", "conv", Category.CONV_WORKSPACE),   # 5
    (512, "optimizer", "", "all_reduce", Category.COMMUNICATION),   # 6
]
EVENTS = [(True, 0), (True, 1), (True, 2), (True, 3), (False, 3), (True, 4), (False, 2), (True, 5), (False, 5),
          (False, 1), (True, 6), (False, 6)]
# The replay, event by event (large requests, 1-10 MiB, get a 20 MiB segment and split when more than 1 MiB
# remains; small ones, <= 1 MiB, a 2 MiB segment, split when 512 B remain):
#  0 param 4 MiB: segment A (20 MiB) at 1 MiB, block A[0:4]          allocated  4 MiB  reserved 20 MiB
#  1 input 1 MiB: small segment B (2 MiB) at 22 MiB, block B[0:1]     allocated  5 MiB  reserved 22 MiB
#  2 act 3 MiB: A[4:7] (13 MiB stay)                                  allocated  8 MiB
#  3 temp 600 KiB: B[1 MiB:+600 KiB]                                  allocated  8 MiB + 614400
#  4 free temp                                                        allocated  8 MiB
#  5 grad 4 MiB: A[7:11] (9 MiB stay)                                 allocated 12 MiB  <- the peak, first reached
#  6 free act: A[4:7] free, between two live blocks                   allocated  9 MiB
#  7 conv workspace 2 MiB: best fit A[4:7]; 1 MiB would remain, not more than 1 MiB: the whole 3 MiB block
#                                                                     allocated 12 MiB (not above the peak)
#  8, 9 frees                                                         allocated  8 MiB
# 10 communication 512 B: B, merged whole again                       allocated  8 MiB + 512
# 11 free                                                             allocated  8 MiB
ALLOCATED = [4 * MiB, 5 * MiB, 8 * MiB, 8 * MiB + 614400, 8 * MiB, 12 * MiB, 9 * MiB, 12 * MiB, 9 * MiB, 8 * MiB,
             8 * MiB + 512, 8 * MiB]
RESERVED = [20 * MiB] + [22 * MiB] * 11


def _trace() -> Trace:
    allocations = [Allocation(n, phase, module, op, 0, category) for n, phase, module, op, category in ALLOCATIONS]
    return Trace(allocations, list(EVENTS))


def test_timeline_of_a_hand_made_step() -> None:
    t = timeline_of(view_of(_trace(), 4, A100))
    assert (t.gpu, t.batch_size, t.events, t.points) == ("A100-80GB", 4, 12, list(range(12)))
    assert (t.capacity_bytes, t.usable_bytes) == (A100.memory_bytes, A100.memory_bytes - A100.context_bytes)
    assert (t.allocated, t.reserved) == (ALLOCATED, RESERVED)
    assert (t.allocated_peak_bytes, t.reserved_peak_bytes) == (12 * MiB, 22 * MiB)
    assert t.device_peak_bytes == 22 * MiB + A100.context_bytes
    assert (t.peak_event, t.peak_phase) == (5, "backward")
    # requested bytes, not blocks: the workspace lane holds the 2 MiB asked for, the communication buffer
    # counts with the temporaries
    assert list(t.categories) == [str(c) for c in ORDER]
    assert t.categories["parameter"] == [4 * MiB] * 12
    assert t.categories["input"] == [0] + [MiB] * 8 + [0] * 3
    assert t.categories["activation"] == [0, 0] + [3 * MiB] * 4 + [0] * 6
    assert t.categories["gradient"] == [0] * 5 + [4 * MiB] * 7
    assert t.categories["temporary"] == [0, 0, 0, 614400] + [0] * 6 + [512, 0]
    assert t.categories["workspace"] == [0] * 7 + [2 * MiB] + [0] * 4
    assert t.categories["buffer"] == t.categories["optimizer_state"] == [0] * 12
    assert [(p.phase, p.iteration, p.start) for p in t.phases] == [
        ("setup", 0, 0), ("input", 0, 1), ("forward", 0, 2), ("backward", 0, 5), ("optimizer", 0, 10)]


def test_a_step_that_does_not_fit_shows_what_it_would_need() -> None:
    # 16 MiB usable: segment A (20 MiB) cannot be had at event 0; the timeline is the replay without a capacity
    # (as the report), with the card's usable line below its peaks
    tiny = custom_gpu("tiny", 16 * MiB + A100.context_bytes, "8.0", A100.context_bytes)
    view = view_of(_trace(), 4, tiny)
    t = timeline_of(view)
    assert not view.report.fits
    assert (t.usable_bytes, t.allocated_peak_bytes, t.reserved_peak_bytes) == (16 * MiB, 12 * MiB, 22 * MiB)
    assert t.allocated == ALLOCATED


def test_the_json_is_the_dataclass() -> None:
    doc = json.loads(json.dumps(dataclasses.asdict(timeline_of(view_of(_trace(), 4, A100)))))
    assert list(doc) == ["gpu", "batch_size", "capacity_bytes", "usable_bytes", "allocated_peak_bytes",
                         "reserved_peak_bytes", "device_peak_bytes", "peak_event", "peak_phase", "events", "points",
                         "categories", "allocated", "reserved", "phases"]
    assert doc["phases"][3] == {"phase": "backward", "iteration": 0, "start": 5}


@pytest.mark.parametrize("n, keep, expected", [
    (0, (), []),
    (5, (3,), [0, 1, 2, 3, 4]),                       # up to the limit: every event
    (MAX_POINTS, (), list(range(MAX_POINTS))),
    (2 * MAX_POINTS - 1, (), list(range(0, 2 * MAX_POINTS - 1, 2))),   # i * (n - 1) // (limit - 1) = 2i
    (2 * MAX_POINTS - 1, (1, 3), [0, 1, 2, 3] + list(range(4, 2 * MAX_POINTS - 1, 2))),  # the odd ones kept
])
def test_sample(n: int, keep: tuple[int, ...], expected: list[int]) -> None:
    assert sample(n, keep) == expected


def test_a_long_step_is_sampled_and_keeps_its_peaks_exactly() -> None:
    # 3000 pairs of a 1 KiB alloc (two 512 B blocks' worth: one 1024 B block) and its free, and right after
    # small allocation 1501 (event 3002) a 4 MiB one that stays (event 3003): 6001 events. The peak,
    # 1024 + 4 MiB, is first reached at event 3003, which evenly sampling 2000 of 6001 passes over
    allocations = [Allocation(1024, "forward", "m", "op", 0, Category.ACTIVATION) for _ in range(3000)]
    allocations.append(Allocation(4 * MiB, "forward", "m", "big", 0, Category.ACTIVATION))
    events: list[tuple[bool, int]] = []
    for k in range(3000):
        events.append((True, k))
        if k == 1501:
            events.append((True, 3000))
        events.append((False, k))
    t = timeline_of(view_of(Trace(allocations, events), 1, A100))
    assert t.events == 6001 and 3003 not in sample(6001)
    assert (t.peak_event, t.allocated_peak_bytes) == (3003, 4 * MiB + 1024)
    # 2 MiB small segment + the 4 MiB request's 20 MiB segment, first reached there too
    assert t.reserved_peak_bytes == 22 * MiB
    assert len(t.points) == MAX_POINTS + 1 and t.points[0] == 0 and t.points[-1] == 6000
    assert t.allocated[t.points.index(3003)] == t.allocated_peak_bytes
    assert max(t.reserved) == t.reserved_peak_bytes
    assert all(len(lane) == len(t.points) for lane in t.categories.values())


def test_category_timeline_at_points() -> None:
    # events 3 and 5 of the hand-made step: 600 KiB of temporaries, then none; 4 MiB of gradients at 5
    sized = _trace().sized(1, A100.cublas_workspace_bytes)
    lanes = category_timeline(sized[0], sized[1], sized[2], [3, 5])
    assert (lanes["temporary"], lanes["gradient"]) == ([614400, 0], [0, 4 * MiB])


def test_snapshot_of_a_hand_made_step() -> None:
    snap = snapshot_of(view_of(_trace(), 4, A100))
    trace = snap["device_traces"][0]
    # segment A (20 MiB at 1 MiB), parameter A[0:4]; small segment B (2 MiB) at 1 MiB + 20 MiB + 1 MiB = 22 MiB
    assert [(e["action"], e["addr"], e["size"]) for e in trace[:4]] == [
        ("segment_alloc", MiB, 20 * MiB), ("alloc", MiB, 4 * MiB), ("segment_alloc", 22 * MiB, 2 * MiB),
        ("alloc", 22 * MiB, MiB)]
    assert trace[1]["frames"] == [{"filename": "batchfit/parameter", "line": 0, "name": "empty"},
                                  {"filename": "fc", "line": 0, "name": "setup"}]
    # the temporary's free: requested, then completed, the same block
    frees = [(e["action"], e["addr"], e["size"]) for e in trace if e["action"].startswith("free")][:2]
    assert frees == [("free_requested", 23 * MiB, 614400), ("free_completed", 23 * MiB, 614400)]
    # the conv workspace's block is the whole 3 MiB (its request 2 MiB)
    assert [e["size"] for e in trace if e["action"] == "alloc"][5] == 3 * MiB
    # at the end: A holds the parameter and the gradient, B is cached whole
    a, b = snap["segments"]
    assert [(x["address"], x["size"], x["state"]) for x in a["blocks"]] == [
        (MiB, 4 * MiB, "active_allocated"), (5 * MiB, 3 * MiB, "inactive"), (8 * MiB, 4 * MiB, "active_allocated"),
        (12 * MiB, 9 * MiB, "inactive")]
    assert (a["total_size"], a["allocated_size"], a["requested_size"], a["segment_type"]) == (
        20 * MiB, 8 * MiB, 8 * MiB, "large")
    assert (b["address"], b["total_size"], b["allocated_size"], b["segment_type"]) == (22 * MiB, 2 * MiB, 0, "small")
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_the_plot_skips_phase_labels_that_would_overlap_and_keeps_them_off_the_legend() -> None:
    from estimator.cli.plot import figure, keep_apart

    # labels 0-10 px, 5-15 px (overlaps the first: skipped), 12-20 px (2 px past the first: drawn), 21-30 px
    # (1 px past the third, less than the 2 px gap: skipped)
    assert keep_apart([(0, 10), (5, 15), (12, 20), (21, 30)]) == [True, False, True, False]
    # 60 phases 2 events apart on an axis of 600 events, about 1.7 px per event on a 12-inch plot: their labels
    # (each in the middle of its span, 7 points, some 12 px, wide) 3 px apart; most are left out, those drawn
    # are apart and left of the legend
    spans = [dataclasses.replace(p, start=2 * i) for i, p in
             enumerate(timeline_of(view_of(_trace(), 4, A100)).phases * 12)]
    t = dataclasses.replace(timeline_of(view_of(_trace(), 4, A100)), events=600, phases=spans)
    fig = figure(t)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    drawn = sorted((x.get_window_extent(renderer) for x in ax.texts), key=lambda b: b.x0)
    assert 1 < len(drawn) < len(spans)
    assert all(a.x1 <= b.x0 for a, b in zip(drawn, drawn[1:], strict=False))
    legend = ax.get_legend().get_window_extent(renderer)
    assert all(b.x1 <= legend.x0 for b in drawn)
    # 22 MiB reserved on an 80 GB card: the axis is the step's (10% over its reserved peak), the legend says
    # where the usable line is
    assert ax.get_ylim()[1] == pytest.approx(22 * MiB * 1.1 / 2**30)
    assert any(x.get_text().endswith("(above the plot)") for x in ax.get_legend().get_texts())
