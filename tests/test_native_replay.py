"""The allocator replay in C (estimator/replay/_allocator.c, estimator/replay/native.py) against the Python model it
follows: every field of every result the same, on random traces (every kind of allocation, streams, capacities,
max_split_size, timelines), on malformed ones (the same errors) and on simulated steps."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import A100_80 as A100

from estimator.errors import ReplayError
from estimator.plan.affine import fit
from estimator.replay import native
from estimator.replay.allocator import AllocatorConfig, ReplayResult, replay_sized
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO
from estimator.trace import Category

pytestmark = pytest.mark.unit

MiB = 2**20
SIZES = [0, 1, 511, 512, 600, 300_000, MiB, MiB + 1, 1_500_000, 6 * MiB, 10 * MiB, 13 * MiB, 20 * MiB, 40 * MiB,
         90 * MiB]
CATEGORIES = [Category.ACTIVATION, Category.PARAMETER, Category.WORKSPACE, Category.CONV_WORKSPACE,
              Category.EMPTY_CACHE, Category.PAGED_OPTIMIZER_STATE, "#7", Category.GRADIENT]


def both(events, sizes, categories, config, timelines=True, streams=None, encoded=None) -> ReplayResult:
    """The C replay's result, checked equal to the Python model's, field by field."""
    c = replay_sized(events, sizes, categories, config, timelines, streams, encoded=encoded)
    python = replay_sized(events, sizes, categories, config, timelines, streams, native=False)
    assert dataclasses.asdict(c) == dataclasses.asdict(python)
    return c


def test_the_c_replay_is_built() -> None:
    assert native.available(), ("estimator/replay/_allocator.c is not built: `pip install -e .` builds it (a C "
                                "compiler is needed); without it every replay runs in Python, ~100x slower")


@st.composite
def traces(draw):
    """Allocations of every kind and size, freed in any order, some left live; on one stream or several."""
    n = draw(st.integers(1, 80))
    live, events, sizes, categories = [], [], [], []
    many_streams = draw(st.booleans())
    streams = []
    for key in range(n):
        sizes.append(draw(st.sampled_from(SIZES)))
        categories.append(draw(st.sampled_from(CATEGORIES)))
        streams.append(draw(st.sampled_from([0, 0, 3, 7])) if many_streams else 0)
        events.append((True, key))
        live.append(key)
        while live and draw(st.integers(0, 2)) == 0:
            events.append((False, live.pop(draw(st.integers(0, len(live) - 1)))))
    return events, sizes, categories, streams if many_streams else None


@settings(max_examples=400, deadline=None)
@given(traces(), st.sampled_from([None, 0, 3 * MiB, 30 * MiB, 60 * MiB, 150 * MiB, 400 * MiB]),
       st.sampled_from([None, 20 * MiB, 23 * MiB, 40 * MiB]), st.booleans())
def test_random_traces_replay_alike(trace, capacity, max_split, timelines) -> None:
    events, sizes, categories, streams = trace
    config = AllocatorConfig(capacity=capacity, max_split_size=max_split)
    both(events, sizes, categories, config, timelines, streams)
    both(events, sizes, categories, config, timelines, streams, encoded=native.encode(events, categories, streams))


def test_the_cases_the_python_rules_name() -> None:
    """One replay per rule of estimator/replay/allocator.py's docstring, where the two could part."""
    act = Category.ACTIVATION
    cases = [
        # best fit, lowest address on ties; a split large block; merging on free
        ([(True, 0), (True, 1), (True, 2), (False, 1), (True, 3), (False, 0), (False, 3)], [4 * MiB, 2 * MiB,
                                                                                             3 * MiB, MiB], [act] * 4),
        # a failed cudaMalloc frees the cache and retries: OOM only when live memory is past the capacity
        ([(True, 0), (False, 0), (True, 1), (True, 2)], [30 * MiB, 50 * MiB, 40 * MiB], [act] * 3),
        # a cuDNN workspace that cannot be had is skipped; its free is no error
        ([(True, 0), (True, 1), (False, 1), (False, 0)], [50 * MiB, 40 * MiB], [act, Category.CONV_WORKSPACE]),
        # empty_cache between steps
        ([(True, 0), (False, 0), (True, 1), (False, 1), (True, 2)], [30 * MiB, 0, 30 * MiB],
         [act, Category.EMPTY_CACHE, act]),
        # paged optimizer state: counted apart, against the capacity
        ([(True, 0), (True, 1), (False, 1), (True, 2)], [30 * MiB, 25 * MiB, 20 * MiB],
         [act, Category.PAGED_OPTIMIZER_STATE, act]),
    ]
    for events, sizes, categories in cases:
        for capacity in (None, 60 * MiB, 80 * MiB):
            for max_split in (None, 20 * MiB):
                both(events, sizes, categories, AllocatorConfig(capacity=capacity, max_split_size=max_split))


@pytest.mark.parametrize(("events", "sizes", "message"), [
    ([(True, 0), (True, 0)], [10], "event 1: key 0 allocated twice without a free"),
    ([(True, 1), (False, 0)], [10, 10], "event 1: free of key 0 that is not allocated"),
    ([(True, 0)], [-5], "event 0: nbytes -5; expected >= 0"),
])
def test_malformed_traces_raise_the_same_errors(events, sizes, message) -> None:
    categories = [Category.ACTIVATION] * len(sizes)
    for use_c in (True, False):
        with pytest.raises(ReplayError) as raised:
            replay_sized(events, sizes, categories, AllocatorConfig(), native=use_c)
        assert str(raised.value) == message


def test_a_key_past_the_sizes_is_python_s_to_answer() -> None:
    """The C replay checks its bounds and leaves the answer to Python (an IndexError), never reading past."""
    for use_c in (True, False):
        with pytest.raises(IndexError):
            replay_sized([(True, 0), (True, 5)], [10], [Category.ACTIVATION], AllocatorConfig(), native=use_c)


def test_what_the_c_replay_does_not_model_runs_in_python() -> None:
    events, sizes, categories = [(True, 0), (True, 1), (False, 0)], [3 * MiB, 5 * MiB], [Category.ACTIVATION] * 2
    assert native.replay_native(events, sizes, categories, None) is not None
    expandable = replay_sized(events, sizes, categories, AllocatorConfig(expandable_segments=True))
    assert expandable.reserved_peak == 8 * MiB  # 2 MiB pages: the Python model's expandable segments
    recorded = replay_sized(events, sizes, categories, AllocatorConfig(), record=True)
    assert recorded.recording is not None
    assert dataclasses.replace(recorded, recording=None) == both(events, sizes, categories, AllocatorConfig())


@pytest.mark.parametrize("name", ["resnet18", "gpt2", "lstm"])
def test_simulated_steps_replay_alike(name: str) -> None:
    """Real steps: the traces at batches 2 and 3, and the affine trace through them at larger batches, on
    capacities from plenty to too little (the search's replays)."""
    traces = {b: record_training(*ZOO[name], b, Recipe(), A100) for b in (2, 3)}
    affine = fit([(2, traces[2]), (3, traces[3])])
    assert affine is not None and affine.encoded is not None
    for b, trace in traces.items():
        events, sizes, categories, streams = trace.sized(b, A100.cublas_workspace_bytes)
        both(events, sizes, categories, AllocatorConfig(), streams=streams)
    events, sizes, categories, streams = affine.sized(64, A100.cublas_workspace_bytes)
    needs = both(events, sizes, categories, AllocatorConfig(), streams=streams).reserved_peak
    for batch in (4, 64, 200):
        events, sizes, categories, streams = affine.sized(batch, A100.cublas_workspace_bytes)
        for capacity in (None, needs, needs // 2, needs // 8):
            for max_split in (None, 40 * MiB):
                both(events, sizes, categories, AllocatorConfig(capacity=capacity, max_split_size=max_split),
                     timelines=False, streams=streams, encoded=affine.encoded)


def test_what_python_holds_and_int64_does_not_is_python_s() -> None:
    """Sizes and limits past int64's safe sums, floats and numpy flags: the Python replay answers (no overflow, no
    wrapped capacity, no error the Python model would not raise)."""
    act = Category.ACTIVATION
    huge = [(True, 0), (True, 1), (False, 0)]
    both(huge, [2**62, 2**62], [act, act], AllocatorConfig())
    both(huge, [2**63 + 5, 10], [act, act], AllocatorConfig())
    both([(True, 0)], [MiB], [act], AllocatorConfig(capacity=2**64))
    assert native.replay_native([(True, 0)], [MiB], [act], None, capacity=2**64) is None
    both([(True, 0), (True, 1)], [1.5e6, 3], [act, act], AllocatorConfig())
    import numpy as np  # transformers' dependency, so always here

    both([(np.bool_(True), 0), (np.bool_(False), 0)], [MiB], [act], AllocatorConfig())


def test_managed_sizes_below_zero_add_up_as_in_python() -> None:
    paged, act = Category.PAGED_OPTIMIZER_STATE, Category.ACTIVATION
    result = both([(True, 0), (True, 1), (True, 2)], [-5, 10, 4096], [paged, paged, act], AllocatorConfig())
    assert result.breakdown_at_peak[paged] == 5
    assert both([(True, 0), (True, 2)], [-5, 10, 4096], [paged, paged, act],
                AllocatorConfig()).breakdown_at_peak[paged] == -5


def test_a_workspace_skipped_after_a_block_it_freed_is_not_in_the_breakdown() -> None:
    """A cuDNN workspace that had a block, freed it, then could not have one: nothing of it is live at the peak
    (the breakdown adds up to the allocated peak)."""
    ws, act = Category.CONV_WORKSPACE, Category.ACTIVATION
    result = both([(True, 0), (False, 0), (True, 1), (True, 0), (True, 2)], [40 * MiB, 50 * MiB, 30 * MiB],
                  [ws, act, act], AllocatorConfig(capacity=80 * MiB))
    assert ws not in result.breakdown_at_peak
    assert sum(result.breakdown_at_peak.values()) == result.allocated_peak


def test_an_encoding_of_other_lists_is_not_read() -> None:
    act = Category.ACTIVATION
    events, sizes = [(True, 0), (True, 1), (False, 0)], [MiB, 2 * MiB]
    other = native.encode([(True, 0)], [act], None)
    assert native.replay_native(events, sizes, [act, act], None, encoded=other) is None
    assert replay_sized(events, sizes, [act, act], AllocatorConfig(), encoded=other) == \
        replay_sized(events, sizes, [act, act], AllocatorConfig(), native=False)


def test_max_split_size_is_whole_mib() -> None:
    """PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb: whole MiB, which keeps an oversize block a whole segment (the
    release of oversize blocks frees segments)."""
    with pytest.raises(ReplayError, match="whole number of MiB"):
        AllocatorConfig(max_split_size=int(20.75 * MiB))
    AllocatorConfig(max_split_size=21 * MiB)
