"""CPU-target predictions vs real CPU training steps measured by torch.profiler."""

from __future__ import annotations

import pytest

from estimator.measure.cpu import BATCH, real_cpu_peak
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
