"""Real multi-process training steps (gloo, CPU), measured per rank: the truth for the multi-GPU strategies.

``world_size`` processes (forked from multiprocessing's fork server, which
imports torch and this module once and lives as long as the calling process;
joined through a FileStore in a temporary folder; gloo) each run the single-process truth's loop
(estimator/testing/cpu_truth.py): the zoo model built under seed 0, wrapped by
the strategy, trained by estimator/simulate/step.py's ``run_steps`` and
measured as cpu_truth measures, the peak of the running sum of the CPU
allocator's allocations and frees that torch.profiler records.

* ``ddp``: ``DistributedDataParallel(model, bucket_cap_mb, gradient_as_bucket_view)``
  (``bucket_cap_mb=None`` is DDP's own default: 25 MiB, the first bucket 1 MiB).
* ``fsdp``: FSDP2, ``fully_shard`` on each block of the largest
  ModuleList/Sequential (checkpointing's ``_block_container``), then on the
  root, over ``init_device_mesh("cpu", (world_size,))``.
* ``zero1``: DDP as above and ``ZeroRedundancyOptimizer`` over the recipe's
  optimizer class with ``build_optimizer``'s keyword arguments.

>>> real_distributed_peaks("mlp", Recipe(optimizer="adamw"), "ddp", 2)      # doctest: +SKIP
[3787012, 3787012]
>>> for row in cpu_rank_peaks_table(worlds=(2,)):                           # doctest: +SKIP
...     print(row["model"], row["strategy"], row["peaks"], row["bucket_sizes"])

(They start processes: a script calling them needs ``if __name__ == "__main__":``.)

What is measured, from where. As in cpu_truth, the profile starts before
the model is built: building it (in full, on every rank), wrapping it,
building the optimizer, the loop and the teardown all count. So DDP's bucket
buffers (made at construction) and its construction broadcast (a flat copy of
the parameters) count, and so does FSDP's full model before it is sharded;
``RankPeak.setup_peak`` is the peak up to the loop and ``steps_peak`` that of
the loop (the larger one here for every model). ``peak`` (what
``real_distributed_peaks`` returns) counts everything; ``peak_without_backend``
leaves out what gloo allocates inside its own ops (``c10d::*``, ``gloo:*``:
all-gather and reduce-scatter copies, about the size of the output or input),
which NCCL does not take from the caching allocator.

gloo frees some tensors on its own threads, where the profiler sees no free;
left alone that adds a race to the peaks. ``_settle_collectives`` makes the
program's frees happen on the profiled thread, ``_restore_gloo_frees`` puts
back gloo's frees of its own temporaries, and a run that still holds a block
never freed (``RankPeak.unfreed``) is run again (``RankPeak.attempts``).

What torch 2.14.1 does (measured here; models mlp, conv, gpt2, AdamW, batch 4):

* DDP with ``gradient_as_bucket_view=False`` costs exactly the single-process
  peak plus one bucket byte per gradient byte (mlp 3,240,156 + 546,856; gpt2
  12,460,472 + 2,131,968). The first iteration's buckets are one bucket of all
  parameters (``find_unused_parameters=False``); the second forward rebuilds
  them in gradient-ready order (the old one freed, then the new ones made) with
  limits [first cap, cap]: gpt2 (1,056,768, 1,075,200) with the default,
  (2,131,968,) with ``bucket_cap_mb=25`` given, seven buckets with 0.25.
  With ``gradient_as_bucket_view=True`` mlp's peak is the single-process one;
  gpt2's is unchanged, as it comes at the start of the second backward, before
  any gradient exists (buckets, Adam states and activations alive).
* ZeroRedundancyOptimizer partitions whole parameters (greedy by size), so its
  ranks differ: mlp's 512x256 weight makes rank 0 (3,741,864) near DDP
  (3,787,012) and rank 1 1,730,816.
* FSDP2 shards dim 0 unevenly when it does not divide (conv at world 4: rank
  3 lower).

What cannot run on CPU: nothing asked for. DDP, FSDP2 (``fully_shard``: gloo
has ``all_gather_single``/``reduce_scatter_single`` on CPU, through
``_allgather_base``/``_reduce_scatter_base``) and ZeroRedundancyOptimizer all
run with gloo at world 2 and 4, with fp32, bf16, amp-bf16, amp-fp16 and
gradient checkpointing, and FSDP with ``reshard_after_forward`` True, False
and an int. Caveats: amp-fp16's ``torch.amp.GradScaler("cpu")`` is the plain
scaler, not FSDP's ``ShardedGradScaler``, and with these batches (uninitialised
``torch.empty`` inputs) its steps make no optimizer state on any strategy;
gloo's collectives allocate temporaries NCCL does not (``peak_without_backend``).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from estimator.measure.cpu import BATCH
from estimator.simulate.recipe import Recipe
from estimator.simulate.step import StepHooks

STRATEGIES = ("ddp", "fsdp", "zero1")
_TIMEOUT_S = 300.0
_START_METHOD = "forkserver"
# A run whose profile holds a block never freed lost a free to a gloo thread (see _settle_collectives) and is
# run again, at most _ATTEMPTS times: DDP's C++ checks at construction lose small ones (8 to 600 B) now and
# then, and the first job of a process may make a small lasting one (the device mesh's 8 B).
_UNFREED_OK = 0
_ATTEMPTS = 5


@dataclass(frozen=True)
class Job:
    """One measured run: a zoo model, a recipe and a strategy with its options."""

    name: str
    recipe: Recipe
    strategy: str
    batch: int = BATCH
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    reshard_after_forward: bool | int = True


@dataclass(frozen=True)
class RankPeak:
    """What one rank measured, in bytes.

    ``peak``: over the whole profile (model built and wrapped, optimizer, loop,
    teardown), cpu_truth's measure; ``peak_without_backend``: the same without
    gloo's own allocations; ``setup_peak`` / ``setup_live``: the peak up to the
    loop and what is live when it starts; ``steps_peak``: the loop's peak;
    ``end_live``: live after the teardown; ``unfreed``/``unfreed_at``: blocks
    the profile never saw freed (0 in a clean run); ``bucket_sizes``: DDP's
    bucket buffers after the loop (rebuilt), ``initial_bucket_sizes`` at
    construction; ``attempts``: runs it took to get a clean one.
    """

    rank: int
    peak: int
    peak_without_backend: int
    setup_peak: int
    setup_live: int
    steps_peak: int
    end_live: int
    unfreed: int
    bucket_sizes: tuple[int, ...]
    initial_bucket_sizes: tuple[int, ...]
    unfreed_at: tuple[str, ...] = ()
    attempts: int = 1


def real_distributed_peaks(name: str, recipe: Recipe, strategy: str, world_size: int, *, batch: int = BATCH,
                           bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
                           reshard_after_forward: bool | int = True) -> list[int]:
    """Peak live bytes of the CPU allocator on each rank (rank order) of ``strategy`` run for real."""
    job = Job(name, recipe, strategy, batch, bucket_cap_mb, gradient_as_bucket_view, reshard_after_forward)
    return [r.peak for r in real_distributed_runs([job], world_size)[0]]


def cpu_rank_peaks_table(models: tuple[str, ...] = ("mlp", "conv", "gpt2"), strategies: tuple[str, ...] = STRATEGIES,
                         worlds: tuple[int, ...] = (2, 4), recipe: Recipe | None = None,
                         **options: Any) -> list[dict[str, Any]]:
    """Every model x strategy x world size measured, one row each, for comparison with predictions.

    A row: model, strategy, world, peaks (per rank), peaks_without_backend,
    setup_peaks, bucket_sizes (DDP's after the rebuild, rank 0's) and
    initial_bucket_sizes. ``options`` are ``Job``'s (bucket_cap_mb, ...).
    One set of processes per world size runs all its jobs.
    """
    recipe = recipe or Recipe(optimizer="adamw")
    rows = []
    for world in worlds:
        jobs = [Job(m, recipe, s, **options) for m in models for s in strategies]
        for job, ranks in zip(jobs, real_distributed_runs(jobs, world), strict=True):
            rows.append({
                "model": job.name, "strategy": job.strategy, "world": world,
                "peaks": [r.peak for r in ranks],
                "peaks_without_backend": [r.peak_without_backend for r in ranks],
                "setup_peaks": [r.setup_peak for r in ranks],
                "bucket_sizes": ranks[0].bucket_sizes,
                "initial_bucket_sizes": ranks[0].initial_bucket_sizes,
            })
    return rows


def real_distributed_runs(jobs: list[Job], world_size: int, timeout_s: float = _TIMEOUT_S) -> list[list[RankPeak]]:
    """Every job of ``jobs`` run in turn by the same ``world_size`` processes; per job, what each rank measured.

    One set of processes runs them all (each job measured on its own, from a
    fresh model), so that the start of the processes (importing torch) is paid once.
    """
    import torch.multiprocessing as mp

    for job in jobs:
        if job.strategy not in STRATEGIES:
            raise ValueError(f"strategy {job.strategy!r}: one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: at least 1")
    _preload_forkserver()
    with tempfile.TemporaryDirectory(prefix="batchfit-dist-") as tmp:
        context = mp.start_processes(_worker, args=(world_size, tmp, jobs), nprocs=world_size, join=False,
                                     start_method=_START_METHOD)
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):  # raises (and ends the others) if a rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish {len(jobs)} jobs in {timeout_s:g} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                rows = json.load(f)
            per_rank.append([RankPeak(**{k: tuple(v) if isinstance(v, list) else v  # type: ignore[arg-type]
                                         for k, v in r.items()}) for r in rows])
    return [[per_rank[rank][j] for rank in range(world_size)] for j in range(len(jobs))]


def _preload_forkserver() -> None:
    """The ranks are forked from multiprocessing's fork server (a clean single-threaded process, not this
    one, which may hold threads), with torch and this module imported there once rather than by each rank."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__])


def _worker(rank: int, world_size: int, tmp: str, jobs: list[Job]) -> None:
    """One rank: joins the gloo group (a FileStore in ``tmp``), measures each job, writes ``rank<N>.json``."""
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: no need for the hostname to resolve
    torch.set_num_threads(1)  # the ranks share the CPU; the peaks do not depend on it
    _settle_collectives()
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        if any(job.strategy == "fsdp" for job in jobs):
            _mesh(world_size)  # like the process group, made before any measurement
        results = []
        for job in jobs:
            for attempt in range(1, _ATTEMPTS + 1):
                dist.barrier()
                measured = _measure(job, rank, world_size)
                lost = torch.tensor([measured.unfreed])
                dist.all_reduce(lost, op=dist.ReduceOp.MAX)
                if int(lost) <= _UNFREED_OK or attempt == _ATTEMPTS:
                    break
            results.append({**asdict(measured), "attempts": attempt})
        with open(os.path.join(tmp, f"rank{rank}.json.part"), "w") as f:
            json.dump(results, f)
        os.replace(os.path.join(tmp, f"rank{rank}.json.part"), os.path.join(tmp, f"rank{rank}.json"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


_SETUP, _STEPS, _LOOK = "batchfit::setup", "batchfit::steps", "batchfit::look"
_SCOPED = "batchfit::c++ "  # a C++ call of DDP's whose temporaries (gathered shapes, bucket indices) die in it
_BACKEND_OPS = ("c10d::", "gloo:")  # a process group's own ops: what gloo allocates inside them is its own


@dataclass(frozen=True)
class _Event:
    time: int
    delta: int
    ptr: int
    backend: bool  # allocated inside a c10d::/gloo: op
    where: str  # the ops it was allocated in, innermost first


class _Settling(StepHooks):
    """The loop run for real (StepHooks' defaults), waiting after each optimizer step until gloo let go of
    the tensors of its asynchronous collectives (see _settle_collectives)."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        _settle_pending()


def _measure(job: Job, rank: int, world_size: int) -> RankPeak:
    """The single-process truth's measurement (cpu_truth.real_cpu_peak) around the wrapped model's loop."""
    import gc

    from estimator.simulate.step import cast_model, run_steps
    from estimator.testing.zoo import ZOO

    mf, bf, lf = ZOO[job.name]
    cpu = torch.device("cpu")
    gc.collect()  # the previous job's cycles go now, not in the middle of this one
    torch.manual_seed(0)
    buckets: tuple[int, ...] = ()
    initial: tuple[int, ...] = ()
    profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with torch.backends.mkldnn.flags(enabled=False), profiling as prof:
        with torch.profiler.record_function(_SETUP):
            training = _prepare(cast_model(mf(), job.recipe), job, world_size)
        if job.strategy in ("ddp", "zero1"):
            initial = _initial_bucket_sizes(training.model)
        with torch.profiler.record_function(_STEPS):
            run_steps(training, bf, lf, job.batch, job.recipe, cpu, hooks=_Settling(cpu))
        if job.strategy in ("ddp", "zero1"):
            with torch.profiler.record_function(_LOOK):  # not part of the run: left out of the timeline
                buckets = _bucket_sizes(training.model)
        del training
        gc.collect()  # fully_shard's hooks make cycles: without it the model outlives the profile
    events, windows, gloo_spans, scopes = _timeline(prof)
    look = windows.pop(_LOOK, (0, -1))
    events = [e for e in events if not look[0] <= e.time <= look[1]]
    return _peaks(rank, _restore_gloo_frees(events, gloo_spans, scopes, buckets), windows, buckets, initial)


def _peaks(rank: int, events: list[_Event], windows: dict[str, tuple[int, int]],
           buckets: tuple[int, ...], initial: tuple[int, ...]) -> RankPeak:
    """cpu_truth's running sum of live bytes over the time-sorted events, with its maxima per region."""
    setup_end = windows[_SETUP][1]
    steps_start, steps_end = windows[_STEPS]
    blocks: dict[int, _Event] = {}  # live blocks by address
    lost: list[_Event] = []
    live = own = peak = own_peak = setup_peak = steps_peak = 0
    setup_live: int | None = None
    for e in events:
        if setup_live is None and e.time >= steps_start:
            setup_live = live
        live += e.delta
        if e.delta > 0:
            if e.ptr in blocks:  # its free was not recorded
                lost.append(blocks[e.ptr])
            blocks[e.ptr] = e
            own += 0 if e.backend else e.delta
        else:
            block = blocks.pop(e.ptr, None)
            own += 0 if block is not None and block.backend else e.delta
        peak, own_peak = max(peak, live), max(own_peak, own)
        if e.time <= setup_end:
            setup_peak = max(setup_peak, live)
        if steps_start <= e.time <= steps_end:
            steps_peak = max(steps_peak, live)
    lost += blocks.values()
    return RankPeak(rank, peak, own_peak, setup_peak, setup_live or 0, steps_peak, live, sum(b.delta for b in lost),
                    buckets, initial, tuple(f"{b.delta} B in {b.where}" for b in lost[:8]))


def _restore_gloo_frees(events: list[_Event], gloo_spans: list[tuple[int, int]],
                        scopes: list[tuple[int, int]], buckets: tuple[int, ...] = ()) -> list[_Event]:
    """``events`` with the frees that happened on gloo's threads, which the profiler does not see, put back.

    * gloo's reduce-scatter clones its input (``aten::clone`` in
      ``c10d::_reduce_scatter_base_``) and hands the copy to its worker, which
      drops it when done: such a block (made inside a c10d::/gloo: op, never
      freed in the profile) is freed at the end of the first gloo work (the
      ``gloo:*`` span) that starts after it.
    * DDP's C++ checks (``_verify_params_across_processes`` at construction,
      ``_rebuild_buckets`` at the second forward) gather a few hundred bytes
      of shapes and indices that die when the call returns, unless gloo still
      holds them: a block made in one of those calls and never freed is freed
      at the end of the call (``scopes``), unless it has the size of one of
      DDP's buckets (``buckets``), which ``_rebuild_buckets`` makes to keep.
    """
    import bisect

    live: dict[int, _Event] = {}
    lost: list[_Event] = []
    for e in events:
        if e.delta > 0:
            if e.ptr in live:
                lost.append(live[e.ptr])
            live[e.ptr] = e
        else:
            live.pop(e.ptr, None)
    lost += live.values()
    starts = [start for start, _ in gloo_spans]
    frees = []
    for block in lost:
        scope = next((end for start, end in scopes if start <= block.time <= end), None)
        if block.delta in buckets:  # _rebuild_buckets' new buckets outlive it
            scope = None
        i = bisect.bisect_left(starts, block.time)
        if scope is not None:
            frees.append(_Event(scope, -block.delta, block.ptr, block.backend, "the end of a DDP C++ call"))
        elif block.backend and i < len(gloo_spans):
            frees.append(_Event(gloo_spans[i][1], -block.delta, block.ptr, True, "gloo's thread"))
    return sorted(events + frees, key=lambda e: (e.time, e.delta)) if frees else events


def _timeline(prof: Any) -> tuple[list[_Event], dict[str, tuple[int, int]], list[tuple[int, int]],
                                  list[tuple[int, int]]]:
    """The allocations and frees, sorted as cpu_truth sorts them; the time spans of our regions, of gloo's
    works (sorted) and of DDP's scoped C++ calls."""
    from torch._C._profiler import _EventType

    events = []
    windows = {}
    gloo_spans = []
    scopes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            names, up = [], node.parent
            while up is not None:
                names.append(up.name)
                up = up.parent
            backend = any(n.startswith(_BACKEND_OPS) for n in names)
            events.append(_Event(node.start_time_ns, fields.alloc_size, fields.ptr, backend, " < ".join(names[:4])))
        elif node.name in (_SETUP, _STEPS, _LOOK):
            windows[node.name] = (node.start_time_ns, node.end_time_ns)
        elif node.name.startswith("gloo:"):
            gloo_spans.append((node.start_time_ns, node.end_time_ns))
        elif node.name.startswith(_SCOPED):
            scopes.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    return sorted(events, key=lambda e: (e.time, e.delta)), windows, sorted(gloo_spans), scopes


def _prepare(model: torch.nn.Module, job: Job, world_size: int) -> Any:
    """step.prepare for a wrapped model: train mode and checkpointing on the bare model, then the strategy's
    wrapper, then the optimizer over the wrapper's parameters (ZeroRedundancyOptimizer for zero1)."""
    from torch.nn.parallel import DistributedDataParallel

    from estimator.simulate.checkpointing import enable_checkpointing
    from estimator.simulate.optimizers import build_optimizer, optimizer_class_and_kwargs
    from estimator.simulate.step import Training

    recipe = job.recipe
    model.train()
    notes = []
    if recipe.gradient_checkpointing:
        notes.append(enable_checkpointing(model, recipe.gradient_checkpointing))
    wrapped: torch.nn.Module
    if job.strategy == "fsdp":
        wrapped = _fully_shard(model, world_size, job.reshard_after_forward)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=job.bucket_cap_mb,
                                          gradient_as_bucket_view=job.gradient_as_bucket_view)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer
    if job.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = optimizer_class_and_kwargs(recipe)
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    else:
        optimizer = build_optimizer(recipe, params)
    scaler = torch.amp.GradScaler("cpu") if recipe.uses_grad_scaler else None
    return Training(wrapped, params, optimizer, scaler, notes)


def _fully_shard(model: torch.nn.Module, world_size: int, reshard_after_forward: bool | int) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` on each block of the largest ModuleList/Sequential (the blocks checkpointing
    finds), then on the root, over a 1-D CPU mesh of all ranks."""
    from torch.distributed.fsdp import fully_shard

    from estimator.simulate.checkpointing import _block_container

    mesh = _mesh(world_size)
    found = _block_container(model)
    if found is not None:
        for block in found[1].children():
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


@functools.cache
def _mesh(world_size: int) -> Any:
    """The 1-D CPU mesh of all ranks, made once per process (the first job's first run made it outside the
    profile, and its 8-byte mesh tensor lives on with the process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _bucket_sizes(ddp: Any) -> tuple[int, ...]:
    """The bytes of each of DDP's gradient buckets now, in the reducer's order (the first is reduced first).

    Read off the reducer (zero copies of its buckets, made and dropped here):
    its logger keeps only the assignment at construction.
    """
    return tuple(b.buffer().nbytes for b in ddp.reducer._get_zeros_like_grad_buckets())


def _initial_bucket_sizes(ddp: Any) -> tuple[int, ...]:
    """The buckets DDP built at construction (the first iteration's), as its logger recorded them."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return tuple(int(s) for s in str(sizes).split(", ") if s)


def _settle_collectives() -> None:
    """Make the frees of a collective's tensors happen on the profiled thread (in this process: a rank).

    gloo runs a collective on its own threads, and their work object holds the
    tensors it was given; it lets go of them some time after the caller's wait
    has returned (up to milliseconds, seen both for synchronous and
    asynchronous collectives). When the caller drops its own references first,
    the last reference is gloo's and the free happens on a thread the
    profiler's memory reporting does not cover: lost, the block stays live in
    the profile for good and the rank's peak grows, by a race (seen: DDP's
    broadcast buffer at construction, FSDP's all-gather outputs). So each
    synchronous collective here returns only once the reference counts of its
    tensors (and of their storages) are back to what they were before it, the
    caller's own: the caller's references are then the last, and the free is
    recorded where the program makes it. An asynchronous collective's
    tensors (ZeroRedundancyOptimizer's parameter broadcasts) are waited for
    the same way once the optimizer step is over. DDP's construction broadcast
    (``dist._broadcast_coalesced``, C++) is replaced by the same steps in
    Python, settled the same way. What is left (DDP's reducer, whose bucket
    buffers outlive its all-reduces, and the small tensors of its C++ checks)
    is caught by ``RankPeak.unfreed`` and the job is run again.
    """
    from collections.abc import Callable

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def settled(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = _tensors_in((args, kwargs))
            counts = [_use_counts(t) for t in tensors]
            result = fn(*args, **kwargs)
            if kwargs.get("async_op"):
                _PENDING.append((tensors, counts))  # waited for after the optimizer step (_Settling)
            else:
                _wait_released(tensors, counts)
            return result
        return call

    for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single"):
        setattr(dist, name, settled(getattr(c10d, name)))

    def broadcast_coalesced(group: Any, tensors: list[torch.Tensor], buffer_size: int, src: int = 0) -> None:
        # comm.cpp's broadcast_coalesced: buckets of at most buffer_size, flattened, at most 2 in flight
        from collections import deque

        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [buffer_size])
        in_flight: deque[tuple[list[torch.Tensor], torch.Tensor, tuple[int, int], Any]] = deque()

        def finish() -> None:
            bucket, flat, counts, work = in_flight.popleft()
            work.wait()
            del work
            _wait_released([flat], [counts])
            for tensor, out in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                tensor.copy_(out)

        for indices in buckets:
            if len(in_flight) >= 2:
                finish()
            bucket = [tensors[i] for i in indices]
            flat = torch._utils._flatten_dense_tensors(bucket)
            options = dist.BroadcastOptions()
            options.rootRank = src
            counts = _use_counts(flat)
            in_flight.append((bucket, flat, counts, group.broadcast([flat], options)))
        while in_flight:
            finish()

    dist._broadcast_coalesced = broadcast_coalesced  # type: ignore[assignment]

    def scoped(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(_SCOPED + name):
                return fn(*args, **kwargs)
        return call

    dist._verify_params_across_processes = scoped(dist._verify_params_across_processes, "verify_params")
    dist.Reducer._rebuild_buckets = scoped(dist.Reducer._rebuild_buckets, "rebuild_buckets")  # type: ignore[method-assign]


_PENDING: list[tuple[list[torch.Tensor], list[tuple[int, int]]]] = []


def _settle_pending() -> None:
    """Wait until gloo let go of the tensors of the asynchronous collectives issued since the last call."""
    while _PENDING:
        _wait_released(*_PENDING.pop())


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _use_counts(tensor: torch.Tensor) -> tuple[int, int]:
    """References to the tensor and to its storage (the block is freed when the storage's reach 0)."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)  # type: ignore[attr-defined]


def _wait_released(tensors: list[torch.Tensor], counts: list[tuple[int, int]], timeout_s: float = 30.0) -> None:
    """Until gloo's threads hold no more references to ``tensors`` than ``counts`` (taken before the collective)."""
    deadline = time.monotonic() + timeout_s
    while any(a > a0 or b > b0 for (a, b), (a0, b0) in zip(map(_use_counts, tensors), counts, strict=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo kept references to a collective's tensors for {timeout_s:.0f} s")
        time.sleep(0.0001)
