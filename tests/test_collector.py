"""Full collections held off inside an estimate, the collector's thresholds as they were after it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading

import pytest

from estimator.simulate.collector import HELD_OFF, rare_full_collections

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
    block; the same objects outside it do (in a new interpreter: a test process's own objects set how many new
    ones a full collection waits for)."""
    script = textwrap.dedent("""
        import gc, json
        from estimator.simulate.collector import rare_full_collections

        def full_collections():
            kept, start = [], gc.get_stats()[2]["collections"]
            for _ in range(300_000):
                kept.append([0])  # tracked, long-lived
            return gc.get_stats()[2]["collections"] - start

        gc.collect()
        outside = full_collections()
        gc.collect()
        with rare_full_collections():
            inside = full_collections()
        print(json.dumps([outside, inside]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    outside, inside = json.loads(out.stdout)
    assert outside > 0 and inside == 0


def test_the_estimates_hold_them_off(monkeypatch) -> None:
    """``estimate`` (and ``step_view``, through it) and ``make_profile`` plan inside the block."""
    from estimator import pipeline
    from estimator.request.parse import parse_request

    seen = []

    def smallest(*args, **kwargs):
        seen.append(gc.get_threshold()[2])
        raise RuntimeError("stop here")

    monkeypatch.setenv("BATCHFIT_PARALLEL", "0")  # no batch 2 begun in a child beside
    monkeypatch.setattr(pipeline, "answer", smallest)
    monkeypatch.setattr(pipeline, "smallest_batch", smallest)
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"}})
    for call in (pipeline.estimate, pipeline.make_profile):
        with pytest.raises(RuntimeError, match="stop here"):
            call(request)
    assert seen == [HELD_OFF, HELD_OFF] and gc.get_threshold()[2] != HELD_OFF
