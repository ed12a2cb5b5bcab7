"""CPU-target predictions vs real CPU training steps measured by torch.profiler."""

from __future__ import annotations

import pytest
import torch

from estimator.pipeline import estimate_memory
from estimator.request.recipe import Recipe
from estimator.testing.zoo import ZOO

# Reentrant checkpoint also snapshots the CPU RNG state (a 5,056 B host tensor made
# outside the dispatcher) per call; that is host memory a GPU prediction never counts.
CASES = ["mlp", "conv", "tied", "inplace", "inplace_view", "checkpoint", "gpt2", "bert"]
BATCH = 4


def _real_peak(name: str, recipe: Recipe) -> int:
    """Peak live bytes of the CPU allocator over the loop the simulator runs, run for real.

    oneDNN stays off: its bf16 convolutions allocate a scratchpad of their own
    through the CPU allocator (80 KB forward, 110 KB backward for ``conv`` at
    batch 4), CPU-only memory with no GPU counterpart (the GPU's convolution
    workspace is cuDNN's, modelled on its own); fp32 takes the same native path
    here either way.
    """
    from estimator.simulate.step import cast_model, prepare, run_steps

    mf, bf, lf = ZOO[name]
    torch.manual_seed(0)
    profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with torch.backends.mkldnn.flags(enabled=False), profiling as prof:
        # the loop the simulation runs (estimator/simulate/step.py), for real on the CPU
        training = prepare(cast_model(mf(), recipe), recipe)
        run_steps(training, bf, lf, BATCH, recipe, torch.device("cpu"))
        del training
    from torch._C._profiler import _EventType

    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, delta in sorted(allocations):
        live += delta
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", CASES)
def test_cpu_prediction_matches_profiler(name: str) -> None:
    recipe = Recipe(optimizer="adamw")
    mf, bf, lf = ZOO[name]
    predicted = estimate_memory(mf, bf, lf, BATCH, recipe=recipe, gpu=None).allocated_peak_bytes
    measured = _real_peak(name, recipe)
    assert measured > 0
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


@pytest.mark.parametrize("name", ["conv", "mlp"])
def test_cpu_prediction_matches_profiler_pure_bf16(name: str) -> None:
    """Pure bf16: weights, gradients and Adam states in bf16, the input cast at the forward."""
    recipe = Recipe(precision="bf16", optimizer="adamw")
    mf, bf, lf = ZOO[name]
    report = estimate_memory(mf, bf, lf, BATCH, recipe=recipe, gpu=None)
    measured = _real_peak(name, recipe)
    assert abs(report.allocated_peak_bytes - measured) <= 0.01 * measured, (report.allocated_peak_bytes, measured)
    params = sum(p.numel() for p in mf().parameters())
    # bf16 weights: 2 bytes a parameter (not 4)
    assert sum(a.nbytes for a in report.trace.allocations if a.category == "parameter") == 2 * params
