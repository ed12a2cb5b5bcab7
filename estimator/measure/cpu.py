"""Real CPU training steps, measured: the truth the CPU-target predictions are checked against.

The loop is the simulation's own (estimator/simulate/step.py), run for real
on the CPU under torch.profiler; the peak is that of live bytes of the CPU
allocator (tests/test_cpu_truth.py, bench/gpu_accuracy.py --cpu-selfcheck).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from estimator.models import OptimizerFn, StepFn
from estimator.simulate.recipe import Recipe
from estimator.testing.zoo import ZOO

BATCH = 4


def real_cpu_peak(name: str, recipe: Recipe, batch: int = BATCH,
                  factories: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None] | None = None,
                  *, step_fn: StepFn | None = None, optimizer_fn: OptimizerFn | None = None) -> int:
    """Peak live bytes of the CPU allocator over the loop the simulator runs, run for real.

    oneDNN stays off: its bf16 convolutions allocate a scratchpad of their own
    through the CPU allocator (80 KB forward, 110 KB backward for ``conv`` at
    batch 4), CPU-only memory with no GPU counterpart (the GPU's convolution
    workspace is cuDNN's, modelled on its own); fp32 takes the same native path
    here either way.

    ``factories`` (model, batch, loss), when given, replace ``ZOO[name]``: a test's own model; with
    ``step_fn`` (the loss None) and ``optimizer_fn``, a step the user wrote (``estimator.models.user``).
    """
    from estimator.simulate.step import cast_model, prepare, run_steps

    mf, bf, lf = factories or ZOO[name]
    torch.manual_seed(0)

    def loop() -> None:
        # the loop the simulation runs (estimator/simulate/step.py), for real on the CPU
        training = prepare(cast_model(mf(), recipe), recipe, torch.device("cpu"), optimizer_fn=optimizer_fn)
        run_steps(training, bf, lf, batch, recipe, torch.device("cpu"), step_fn=step_fn)

    return cpu_peak_of(loop)


def cpu_peak_of(run: Callable[[], None]) -> int:
    """Peak live bytes of the CPU allocator while ``run()`` runs, under torch.profiler (oneDNN off, as in
    ``real_cpu_peak``): what a framework's own training step (Keras's ``train_step``) allocates."""
    gc.collect()  # an earlier caller's garbage in reference cycles, freed now rather than during the run
    profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with torch.backends.mkldnn.flags(enabled=False), profiling as prof:
        run()
    from torch._C._profiler import _EventType

    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        stack.extend(node.children)
    return _peak_of(allocations)


def _peak_of(allocations: list[tuple[int, int, int]]) -> int:
    """The peak of live bytes over (time, size, address) events, a free's size negative. A free counts only
    where its block was allocated during the run. The profiler reports the free of any block allocated while
    some profiler ran, so an earlier measurement's memory (a test's model that Python's collector frees in
    the middle of this run) would otherwise lower this run's peak."""
    live = peak = 0
    blocks: set[int] = set()  # the addresses of the run's own live blocks
    for _, delta, ptr in sorted(allocations):
        if delta > 0:
            blocks.add(ptr)
        elif ptr in blocks:
            blocks.remove(ptr)
        else:
            continue
        live += delta
        peak = max(peak, live)
    return peak
