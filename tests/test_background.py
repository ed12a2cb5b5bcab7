"""A simulation in a forked child: the same trace, and nothing left running whatever happens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import A100_80 as A100
from support import build_request

from estimator.models import BuiltModel
from estimator.request.parse import parse_request
from estimator.simulate import background
from estimator.simulate.background import Background
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.simulate.source import Simulator

pytestmark = pytest.mark.sim



def _alive(pid: int) -> bool:
    """Running: exists and is not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is ours
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_value_comes_back() -> None:
    assert Background(lambda: {"sum": sum(range(10))}).result(timeout=30) == {"sum": 45}


def test_failure_and_timeout_give_none_and_leave_no_child() -> None:
    assert Background(lambda: 1 / 0).result(timeout=30) is None
    slow = Background(lambda: time.sleep(60))
    pid = slow.pid
    t0 = time.perf_counter()
    assert slow.result(timeout=0.5) is None
    assert time.perf_counter() - t0 < 10
    assert not _alive(pid)


def test_a_value_comes_back_before_its_child_has_exited_and_the_child_is_reaped() -> None:
    """``result`` does not wait while the child exits (unmapping a warm process's memory takes tens of ms); a later
    call reaps it, so no zombie piles up in a long-lived worker."""
    pids = []
    for i in range(5):
        job = Background(lambda i=i: i * i)
        pids.append(job.pid)
        assert job.result(timeout=30) == i * i
    deadline = time.monotonic() + 30
    while background._exiting and time.monotonic() < deadline:
        time.sleep(0.05)
        background._reap()
    assert not background._exiting
    for pid in pids:
        with pytest.raises(ChildProcessError):  # reaped already: no longer this process's child
            os.waitpid(pid, os.WNOHANG)
    assert Background(pickle_fails).result(timeout=30) is None  # nothing written: None, as before


def pickle_fails():
    return lambda: None  # a lambda does not pickle: the child writes nothing


def test_a_child_still_working_is_waited_for() -> None:
    """The timeout counts only while the child uses no CPU: one computing past it comes back (the caller would
    start the same work over); one asleep that long is stuck."""
    def busy() -> int:
        end, n = time.process_time() + 1.5, 0
        while time.process_time() < end:
            n += 1
        return n

    assert Background(busy).result(timeout=0.5) > 0


def test_child_dies_with_its_parent(tmp_path) -> None:
    """A service worker killed at its time limit takes its background simulation with it."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from estimator.simulate.background import Background
        job = Background(lambda: time.sleep(120))
        print(job.pid, flush=True)
        time.sleep(120)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


@pytest.fixture
def parallel(monkeypatch) -> tuple[BuiltModel, Simulator]:
    """A small model's simulator that runs simulations in the background."""
    monkeypatch.setenv("BATCHFIT_PARALLEL", "1")
    if not background.enabled():
        pytest.skip("one core: no background simulations")  # never on CI's machines (2 cores)
    built = build_request(parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                                         "input": {"image_size": [3, 64, 64]}}))
    return built, Simulator(built, Recipe())


def test_prefetched_trace_equals_one_simulated_here(parallel) -> None:
    built, sim = parallel
    sim.prefetch(2, A100)
    sim.simulate(1, A100)
    assert sim._pending  # not collected until asked for
    fetched, runs = sim.simulate(2, A100)
    assert not sim._pending and runs == 1 and sim.runs == 2
    here = record_training(built.factory, built.batch_factory, built.loss_fn, 2, Recipe(), A100)
    assert fetched.events == here.events
    assert [(a.nbytes, a.category, a.op, a.phase, a.module) for a in fetched.allocations] == \
        [(a.nbytes, a.category, a.op, a.phase, a.module) for a in here.allocations]
    assert fetched.flops == here.flops and fetched.sdpa_calls == here.sdpa_calls
    assert fetched == here  # every field, the allocations' streams and iterations included (Trace.__reduce__)


def test_a_trace_pickles_whole() -> None:
    """A trace pickled with its allocations as rows: the same trace back, each field and type as it was."""
    import pickle

    from estimator.trace import Allocation, Category, Phase, Trace

    trace = Trace([Allocation(512, Phase.FORWARD, "layers.0.fc", "mm", 0, Category.ACTIVATION),
                   Allocation(64, Phase.OPTIMIZER, "", "zeros_like", 1, Category.OPTIMIZER_STATE, 7)],
                  [(True, 0), (True, 1), (False, 0)], unsupported=["a hook"], assumptions=["a note"], flops=9,
                  sdpa_calls=[("call",)], card_queries=["get_device_properties"], capability_thresholds=[(8, 0)])
    back = pickle.loads(pickle.dumps(trace, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == trace and back is not trace
    assert [(type(a), type(a.phase), type(a.category)) for a in back.allocations] == \
        [(Allocation, Phase, Category)] * 2


def test_switched_off(monkeypatch) -> None:
    monkeypatch.setenv("BATCHFIT_PARALLEL", "0")
    assert not background.enabled()
    sim = Simulator(build_request(parse_request({"model": {"source": "torchvision", "name": "resnet18"}})), Recipe())
    sim.prefetch(2, A100)
    assert not sim._pending


def test_a_newer_guess_replaces_the_one_before_but_the_kept_one(parallel) -> None:
    """``speculate``: the search's guess at its next probe. A newer guess kills the child of the one before it,
    except the one at ``keep`` (the probe being asked for now); a guess never collected counts no simulation."""
    built, sim = parallel
    sim.speculate(3, A100)
    first = sim._pending[3, A100].pid
    sim.speculate(4, A100, keep=3)  # probing 3 now, guessing 4 next: both run
    assert set(sim._pending) == {(3, A100), (4, A100)} and _alive(first)
    fetched, runs = sim.simulate(3, A100)
    assert runs == 1 and (3, A100) not in sim._pending
    guessed = sim._pending[4, A100].pid
    sim.speculate(6, A100, keep=5)  # the search went elsewhere: the guess at 4 is dropped
    assert set(sim._pending) == {(6, A100)}
    deadline = time.time() + 10
    while _alive(guessed) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(guessed)
    assert sim.runs == 1  # the guesses not collected simulated nothing the answer counts
    here = record_training(built.factory, built.batch_factory, built.loss_fn, 3, Recipe(), A100)
    assert fetched.events == here.events and [a.nbytes for a in fetched.allocations] == \
        [a.nbytes for a in here.allocations]
