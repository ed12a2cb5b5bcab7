"""Full collections held off inside an estimate, the collector's thresholds as they were after it."""

from __future__ import annotations

import gc
import threading

import pytest

from estimator import collector
from estimator.collector import HELD_OFF, rare_full_collections

pytestmark = pytest.mark.unit


def test_the_oldest_threshold_is_raised_inside_and_restored_after() -> None:
    before = gc.get_threshold()
    with rare_full_collections():
        assert gc.get_threshold() == (before[0], before[1], HELD_OFF)
        with rare_full_collections():  # an estimate inside another (step_view answers first)
            assert gc.get_threshold()[2] == HELD_OFF
        assert gc.get_threshold()[2] == HELD_OFF  # the outer one still runs
    assert gc.get_threshold() == before


def test_an_error_restores_the_threshold() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), rare_full_collections():
        raise RuntimeError("the estimate failed")
    assert gc.get_threshold() == before


def test_threads_restore_it_once_the_last_ends() -> None:
    before = gc.get_threshold()
    inside, release = threading.Event(), threading.Event()

    def estimate() -> None:
        with rare_full_collections():
            inside.set()
            release.wait(5)

    other = threading.Thread(target=estimate)
    other.start()
    inside.wait(5)
    with rare_full_collections():
        pass
    assert gc.get_threshold()[2] == HELD_OFF  # the other thread's estimate still runs
    release.set()
    other.join(5)
    assert gc.get_threshold() == before


def test_no_full_collection_runs_inside() -> None:
    """Objects that survive young collections, as an estimate's traces do, trigger no full collection inside the
    block; the same objects outside it do."""
    def full_collections() -> int:
        kept: list[list[int]] = []
        start = gc.get_stats()[2]["collections"]
        for _ in range(200_000):
            kept.append([0])  # tracked, long-lived
        return gc.get_stats()[2]["collections"] - start

    gc.collect()
    assert full_collections() > 0
    gc.collect()
    with rare_full_collections():
        assert full_collections() == 0


def test_the_estimate_entry_points_hold_them_off() -> None:
    from estimator import pipeline

    wrapper = collector.holding_off_full_collections(lambda: None).__code__
    for fn in (pipeline.estimate, pipeline.make_profile, pipeline.step_view):
        assert fn.__code__ is wrapper
