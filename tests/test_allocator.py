"""The caching-allocator replay, one rule per test; sizes derived in comments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.errors import ReplayError, SpecError
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


# --- recording (record=True): the allocator's actions and final segments, what a memory snapshot shows

def test_recording_names_each_action_with_its_block() -> None:
    # 4 MiB: a 20 MiB segment (1-10 MiB requests get kLargeBuffer) at the first address, 1 MiB; its block is the
    # segment's first 4 MiB. 3 MiB then: the 16 MiB remainder, split at 1 MiB + 4 MiB. A free gives the block back.
    r = replay([Event(True, 1, 4 * MiB), Event(True, 2, 3 * MiB), Event(False, 1, 0)], AllocatorConfig(), record=True)
    assert r.recording is not None
    got = [(str(a.action), a.addr, a.size, a.event, a.key) for a in r.recording.actions]
    assert got == [("segment_alloc", MiB, 20 * MiB, 0, -1), ("alloc", MiB, 4 * MiB, 0, 0),
                   ("alloc", 5 * MiB, 3 * MiB, 1, 1), ("free", MiB, 4 * MiB, 2, 0)]
    # at the end the segment holds: the freed 4 MiB, the live 3 MiB, the 13 MiB never handed out
    (seg,) = r.recording.segments
    assert (seg.addr, seg.size, seg.stream, seg.small) == (MiB, 20 * MiB, 0, False)
    assert [(b.addr, b.size, b.key) for b in seg.blocks] == [(MiB, 4 * MiB, None), (5 * MiB, 3 * MiB, 1),
                                                            (8 * MiB, 13 * MiB, None)]


def test_recording_logs_the_segments_a_failed_cudamalloc_frees() -> None:
    # capacity 30 MiB: the cached 20 MiB segment is freed (cudaFree) so the 24 MiB one fits: segment_free first
    r = replay([Event(True, 1, 20 * MiB), Event(False, 1, 0), Event(True, 2, 24 * MiB)],
               AllocatorConfig(capacity=30 * MiB), record=True)
    assert r.recording is not None
    got = [(str(a.action), a.size, a.event) for a in r.recording.actions]
    assert got == [("segment_alloc", 20 * MiB, 0), ("alloc", 20 * MiB, 0), ("free", 20 * MiB, 1),
                   ("segment_free", 20 * MiB, 2), ("segment_alloc", 24 * MiB, 2), ("alloc", 24 * MiB, 2)]


def test_recording_marks_a_skipped_workspace_as_an_oom() -> None:
    # capacity 22 MiB holds one 20 MiB segment; a 4 MiB cuDNN workspace next needs another 20 MiB: refused and
    # skipped (no error), recorded as torch records a failed malloc, with the 2 MiB cudaMalloc still had
    events = [Event(True, 1, 20 * MiB), Event(True, 2, 4 * MiB, "conv_workspace"), Event(False, 2, 0)]
    r = replay(events, AllocatorConfig(capacity=22 * MiB), record=True)
    assert r.fits and r.recording is not None
    assert [(str(a.action), a.addr, a.size) for a in r.recording.actions][-1] == ("oom", 2 * MiB, 4 * MiB)


def test_recording_is_off_by_default_and_changes_nothing() -> None:
    events = [Event(True, 1, 4 * MiB), Event(True, 2, 600), Event(False, 1, 0)]
    off, on = replay(events, AllocatorConfig()), replay(events, AllocatorConfig(), record=True)
    assert off.recording is None and on.recording is not None
    assert (off.allocated, off.reserved, off.peak_event) == (on.allocated, on.reserved, on.peak_event)


def test_recording_refuses_expandable_segments() -> None:
    with pytest.raises(SpecError) as info:
        replay([Event(True, 1, 4 * MiB)], AllocatorConfig(expandable_segments=True), record=True)
    assert info.value.field == "allocator.expandable_segments"


@settings(max_examples=150, deadline=None)
@given(traces(), st.sampled_from([None, 60 * MiB, 150 * MiB]), st.sampled_from([None, 40 * MiB]))
def test_recording_properties(trace, capacity, max_split) -> None:
    """The actions add up to the replay's timelines at every event; live blocks never overlap and lie in live
    segments; the final segments are tiled by their blocks and hold the live allocations."""
    events, _live = trace
    cfg = AllocatorConfig(capacity=capacity, max_split_size=max_split)
    r = replay([Event(*e) for e in events], cfg, record=True)
    assert r.recording is not None
    allocated = reserved = 0
    segments: dict[int, int] = {}
    blocks: dict[int, tuple[int, int]] = {}  # allocation -> (addr, size)
    by_event: dict[int, tuple[int, int]] = {}
    for a in r.recording.actions:
        if a.action == "segment_alloc":
            reserved += a.size
            segments[a.addr] = a.size
        elif a.action == "segment_free":
            reserved -= a.size
            assert segments.pop(a.addr) == a.size
        elif a.action == "alloc":
            allocated += a.size
            inside = [s for s, n in segments.items() if s <= a.addr and a.addr + a.size <= s + n]
            assert len(inside) == 1
            assert all(a.addr + a.size <= b or b + n <= a.addr for b, n in blocks.values())
            blocks[a.key] = (a.addr, a.size)
        elif a.action == "free":
            allocated -= a.size
            assert blocks.pop(a.key) == (a.addr, a.size)
        by_event[a.event] = (allocated, reserved)
    replayed = len(r.allocated)
    for i in range(replayed):  # events without an action (a free of nothing) keep the last totals
        if i in by_event:
            assert by_event[i] == (r.allocated[i], r.reserved[i])
    assert sum(s.size for s in r.recording.segments) == reserved
    assert {s.addr: s.size for s in r.recording.segments} == segments
    for s in r.recording.segments:
        assert s.blocks[0].addr == s.addr and sum(b.size for b in s.blocks) == s.size
        assert all(b.addr + b.size == c.addr for b, c in zip(s.blocks, s.blocks[1:], strict=False))
    held = {b.key: (b.addr, b.size) for s in r.recording.segments for b in s.blocks if b.key is not None}
    assert held == blocks
