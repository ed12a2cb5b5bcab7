"""CPU-target predictions vs real CPU training steps measured by torch.profiler."""

from __future__ import annotations

import pytest
import torch

from estimator.measure.cpu import BATCH, cpu_peak_of, real_cpu_peak
from estimator.pipeline import estimate_memory
from estimator.simulate.recipe import Recipe
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim

# Reentrant checkpoint also snapshots the CPU RNG state (a 5,056 B host tensor made
# outside the dispatcher) per call; that is host memory a GPU prediction never counts.
CASES = ["mlp", "conv", "tied", "inplace", "inplace_view", "checkpoint", "gpt2", "bert"]


@pytest.mark.parametrize("name", CASES)
def test_cpu_prediction_matches_profiler(name: str) -> None:
    recipe = Recipe(optimizer="adamw")
    mf, bf, lf = ZOO[name]
    predicted = estimate_memory(mf, bf, lf, BATCH, recipe=recipe, gpu=None).allocated_peak_bytes
    measured = real_cpu_peak(name, recipe)
    assert measured > 0
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


@pytest.mark.parametrize("name", ["conv", "mlp"])
def test_cpu_prediction_matches_profiler_pure_bf16(name: str) -> None:
    """Pure bf16: weights, gradients and Adam states in bf16, the input cast at the forward."""
    recipe = Recipe(precision="bf16", optimizer="adamw")
    mf, bf, lf = ZOO[name]
    report = estimate_memory(mf, bf, lf, BATCH, recipe=recipe, gpu=None)
    measured = real_cpu_peak(name, recipe)
    assert abs(report.allocated_peak_bytes - measured) <= 0.01 * measured, (report.allocated_peak_bytes, measured)
    params = sum(p.numel() for p in mf().parameters())
    # bf16 weights: 2 bytes a parameter (not 4)
    assert sum(a.nbytes for a in report.trace.allocations if a.category == "parameter") == 2 * params


def test_memory_from_before_the_run_freed_during_it_does_not_lower_its_peak() -> None:
    """An earlier measurement's tensor that dies in the middle of this one (as a test's model does when Python's
    collector reaches it) is not this run's memory, though the profiler knows its size and reports its free:
    the run's peak is its own two blocks."""
    mib = 1 << 20
    held: list[torch.Tensor] = []
    cpu_peak_of(lambda: held.append(torch.empty(4 * mib, dtype=torch.uint8)))

    def run() -> None:
        first = torch.empty(mib, dtype=torch.uint8)
        held.clear()
        second = torch.empty(mib, dtype=torch.uint8)
        del first, second

    assert cpu_peak_of(run) == 2 * mib
