"""The caching-allocator replay, one rule per test; sizes derived in comments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.errors import ReplayError
from estimator.replay.allocator import AllocatorConfig, Event, allocation_size, replay, round_size

pytestmark = pytest.mark.unit

MiB = 1024 * 1024


def run(*events, **cfg):
    return replay([Event(*e) for e in events], AllocatorConfig(**cfg))


@pytest.mark.parametrize("request_bytes, rounded", [
    (1, 512),            # below kMinBlockSize: 512
    (512, 512),
    (513, 1024),         # next multiple of 512
    (4 * MiB + 1, 4 * MiB + 512),
])
def test_round_size(request_bytes: int, rounded: int) -> None:
    assert round_size(request_bytes) == rounded


@pytest.mark.parametrize("request_bytes, segment", [
    (1 * MiB, 2 * MiB),          # <= 1 MiB: small pool, 2 MiB segment
    (1 * MiB + 512, 20 * MiB),   # 1-10 MiB: kLargeBuffer
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),        # >= 10 MiB: rounded to 2 MiB
    (11 * MiB, 12 * MiB),
])
def test_allocation_size(request_bytes: int, segment: int) -> None:
    assert allocation_size(request_bytes) == segment


def test_small_requests_share_a_2mib_segment() -> None:
    # 4 x 512 KiB fit one 2 MiB small segment: reserved stays 2 MiB
    r = run(*[(True, i, 512 * 1024) for i in range(4)])
    assert r.reserved_peak == 2 * MiB and r.allocated_peak == 2 * MiB


def test_freed_block_is_reused_best_fit() -> None:
    # 12 MiB then 14 MiB segments; freeing the 12 MiB one lets a 12 MiB request reuse it
    r = run((True, 1, 12 * MiB), (True, 2, 14 * MiB), (False, 1, 0), (True, 3, 12 * MiB))
    assert r.reserved_peak == 26 * MiB  # 12 + 14, no third segment


def test_large_pool_split_needs_more_than_1mib_remainder() -> None:
    # a 3 MiB request takes a 20 MiB segment and splits (17 MiB > 1 MiB left):
    # a second 3 MiB request reuses the remainder
    r = run((True, 1, 3 * MiB), (True, 2, 3 * MiB))
    assert r.reserved_peak == 20 * MiB and r.allocated_peak == 6 * MiB


def test_unsplit_block_counts_whole_in_allocated() -> None:
    # 19.5 MiB rounds to a 20 MiB segment (2 MiB multiple); remainder 0.5 MiB <= 1 MiB:
    # no split, so allocated counts the whole 20 MiB block
    r = run((True, 1, 19 * MiB + 512 * 1024))
    assert r.allocated_peak == 20 * MiB


def test_free_coalesces_neighbours() -> None:
    # two 4 MiB blocks from one 20 MiB segment; freeing both merges them back to 20 MiB,
    # so a 16 MiB request fits the same segment
    r = run((True, 1, 4 * MiB), (True, 2, 4 * MiB), (False, 1, 0), (False, 2, 0), (True, 3, 16 * MiB))
    assert r.reserved_peak == 20 * MiB


def test_oom_frees_cached_segments_and_retries() -> None:
    # capacity 30 MiB: a cached free 20 MiB segment is released so a 24 MiB segment fits
    r = run((True, 1, 20 * MiB), (False, 1, 0), (True, 2, 24 * MiB), capacity=30 * MiB)
    assert r.fits and r.cache_flushes == 1 and r.reserved[-1] == 24 * MiB


def test_oom_when_live_memory_exceeds_capacity() -> None:
    r = run((True, 1, 20 * MiB), (True, 2, 20 * MiB), capacity=30 * MiB)
    assert not r.fits and r.oom_event == 1


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    # max_split_size 40 MiB: a cached 100 MiB block does not serve a 30 MiB request
    # (small request, oversize block), so a new 30 MiB segment is made
    r = run((True, 1, 100 * MiB), (False, 1, 0), (True, 2, 30 * MiB), max_split_size=40 * MiB)
    assert r.reserved_peak == 130 * MiB


def test_max_split_size_releases_oversize_block_on_oom() -> None:
    # same with capacity 120 MiB: release_available_cached_blocks frees the 100 MiB block
    r = run((True, 1, 100 * MiB), (False, 1, 0), (True, 2, 30 * MiB), max_split_size=40 * MiB, capacity=120 * MiB)
    assert r.fits and r.reserved[-1] == 30 * MiB


def test_expandable_segments_grow_in_2mib_pages() -> None:
    # 3 MiB then 5 MiB: one segment mapped to 4 then 8 MiB (2 MiB pages), not 20 MiB
    r = run((True, 1, 3 * MiB), (True, 2, 5 * MiB), expandable_segments=True)
    assert r.reserved_peak == 8 * MiB


@pytest.mark.parametrize("events, message", [
    ([(True, 1, 10), (True, 1, 10)], "allocated twice"),
    ([(False, 7, 10)], "not allocated"),
])
def test_malformed_trace(events, message) -> None:
    with pytest.raises(ReplayError, match=message):
        run(*events)


def test_config_validation() -> None:
    with pytest.raises(ReplayError, match="max_split_size"):
        AllocatorConfig(max_split_size=MiB)


@st.composite
def traces(draw):
    n = draw(st.integers(1, 60))
    live, events = [], []
    for key in range(n):
        events.append((True, key, draw(st.sampled_from([1, 600, 300_000, 1_500_000, 6 * MiB, 13 * MiB, 40 * MiB]))))
        live.append(key)
        if draw(st.booleans()) and live:
            events.append((False, live.pop(draw(st.integers(0, len(live) - 1))), 0))
    return events, live


@settings(max_examples=150, deadline=None)
@given(traces(), st.booleans())
def test_properties(trace, expandable) -> None:
    events, live = trace
    cfg = AllocatorConfig(expandable_segments=expandable)
    r1 = replay([Event(*e) for e in events], cfg)
    r2 = replay([Event(*e) for e in events], cfg)
    assert (r1.allocated, r1.reserved) == (r2.allocated, r2.reserved)  # deterministic
    assert all(res >= al for al, res in zip(r1.allocated, r1.reserved, strict=True))  # reserved >= allocated
    closing = [Event(False, k, 0) for k in live]
    r3 = replay([Event(*e) for e in events] + closing, cfg)
    assert r3.allocated[-1] == 0  # freeing everything returns allocated to zero
    assert r3.reserved[-1] == r1.reserved[-1]  # memory stays cached
