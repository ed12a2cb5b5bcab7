"""Run training steps on the virtual GPU and record every allocation as a ``Trace``.

>>> trace = record_training(factory, batches, loss_fn, 8, Recipe(), gpu)   # doctest: +SKIP
>>> trace.allocations[0].category
<Category.PARAMETER: 'parameter'>

The ``Recorder`` is the virtual GPU's observer, handed to it at
construction; the loop itself is ``estimator.simulate.step``'s, the one a
real CUDA or CPU step runs, watched here through ``SimulationHooks``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry as _FLOPS

from estimator.errors import BatchTooSmallError, DataDependentError, SimulationError, SpecError
from estimator.gpus import GPU
from estimator.models import BatchFactory, BuiltModel, LossFn, ModelFactory, OnDevice, OptimizerFn, StepFn
from estimator.models.meta import build_on_meta
from estimator.simulate.accumulation import Cut, expand, micro_steps_in_trace, repeats
from estimator.simulate.bnb_optimizers import ASSUMPTION as PAGED_ASSUMPTION
from estimator.simulate.bnb_optimizers import is_paged
from estimator.simulate.distributed import (
    NCCL_ASSUMPTION,
    gathered_parameters,
    gradient_buckets,
    mesh_for,
    process_group,
    shard,
)
from estimator.simulate.iterations import Kept, Repeat, tried
from estimator.simulate.recipe import Recipe
from estimator.simulate.step import StepHooks, Training, cast_model, prepare, run_steps
from estimator.simulate.virtual_gpu import Shortcuts, VirtualGPU
from estimator.simulate.virtual_gpu.bnb import ASSUMPTION as BNB_ASSUMPTION
from estimator.simulate.virtual_gpu.bnb import flops as bnb_flops
from estimator.simulate.virtual_gpu.bnb import internals as bnb_internals
from estimator.simulate.virtual_gpu.cpu_conv import CpuConvColumns
from estimator.simulate.virtual_gpu.cudnn import ASSUMPTION as CUDNN_ASSUMPTION
from estimator.simulate.virtual_gpu.cudnn import BENCHMARK_ASSUMPTION, COLUMNS, WORKSPACE, ConvWorkspaces
from estimator.simulate.virtual_gpu.cudnn_rnn import ASSUMPTION as RNN_ASSUMPTION
from estimator.simulate.virtual_gpu.cudnn_rnn import flops as rnn_flops
from estimator.simulate.virtual_gpu.cudnn_rnn import internals as rnn_internals
from estimator.simulate.virtual_gpu.engine import Engine
from estimator.simulate.virtual_gpu.streams import Streams
from estimator.simulate.virtual_gpu.worst_case import WorstCase
from estimator.trace import Allocation, Category, Phase, Trace

T = TypeVar("T")
# Ops that run cuBLAS: the first one on a thread allocates the handle's workspace.
_CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "_scaled_mm"})

# what each convolution action is in the trace
_CONV_CATEGORY = {WORKSPACE: Category.CONV_WORKSPACE, COLUMNS: Category.TEMPORARY,
                  Category.EMPTY_CACHE: Category.EMPTY_CACHE}
_COUNTED_PHASES = frozenset({Phase.FORWARD, Phase.LOSS, Phase.BACKWARD})
_CUDNN_RNN_OPS = frozenset({"_cudnn_rnn", "_cudnn_rnn_backward"})


_FACTS: dict[Any, tuple[str, bool]] = {}


def _op_facts(func: Any) -> tuple[str, bool]:
    """An op's name and whether ``Recorder.on_op`` does more than track its outputs (and count its FLOPs) for
    it: a bitsandbytes kernel, a cuDNN RNN call, cuBLAS or a convolution (workspaces); worked out once per op."""
    facts = _FACTS.get(func)
    if facts is None:
        name = func._schema.name.split("::")[-1]
        special = (getattr(func, "namespace", "") == "bitsandbytes" or name in _CUDNN_RNN_OPS
                   or name == "_cudnn_init_dropout_state" or name in _CUBLAS_OPS or name.startswith("convolution"))
        facts = _FACTS[func] = (name, special)
    return facts


class Recorder:
    """Observes every op on the virtual GPU and records storage lifetimes (the GPU's ``Observer``)."""

    def __init__(self, device_type: str, workspace_bytes: int, convs: ConvWorkspaces | CpuConvColumns | None = None,
                 *, streams: Streams, every_micro_step: bool = False,
                 capability: tuple[int, int] | None = None, repeat: bool = False) -> None:
        self.device_type = device_type
        self.capability = capability  # the card's: which path bitsandbytes' CUDA kernels take (None: the CPU)
        self.rnn_calls = 0  # cuDNN RNN calls (_cudnn_rnn and its backward): what they allocate inside is recorded
        self.every_micro_step = every_micro_step
        self.trace = Trace()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = Phase.SETUP
        self.iteration = 0
        self.micro = 0  # the accumulation micro-step running
        self.micro_starts: dict[int, list[int]] = {}  # per iteration: the event each micro-step starts at
        self.cuts: list[Cut] = []  # where the simulation stood for the rest of an accumulation
        self.module_stack: list[str] = []
        self.node_modules: dict[int, str] = {}
        self.workspace_bytes = workspace_bytes
        self.workspaces: set[str] = set()
        self.convs = convs
        self.survivors: set[int] = set()
        self.micro_flops: dict[tuple[int, int], int] = {}  # (iteration, micro-step) -> FLOPs
        self.params: list[torch.nn.Parameter] = []  # whose .grad is a gradient when a backward ends
        self.closed = False  # finished: the trace is complete
        self.engine: Engine | None = None
        self.streams = streams  # the virtual GPU's: which stream each allocation is made on
        self.key_category: dict[int, str] = {}  # storages whose every allocation has a category (mark_storages)
        self.last_aid: dict[int, int] = {}  # a resized storage's latest allocation
        # later iterations' micro-steps written from the first's (estimator/simulate/iterations.py), where allowed
        self.repeat = Repeat() if repeat else None
        self.moved: dict[int, int] = {}  # a storage's first allocation -> its allocation in the latest iteration
        self.refilled: dict[int, int] = {}  # a storage's first allocation -> the storage, once resized in place

    # --- the Observer protocol (estimator.simulate.virtual_gpu)
    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def memory_allocated(self) -> int:
        return self.live_bytes

    def max_memory_allocated(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def empty_cache(self) -> None:
        self._transient(0, "torch.cuda.empty_cache", Category.EMPTY_CACHE)

    def backward_end(self) -> None:
        self.mark((p.grad for p in self.params), Category.GRADIENT)

    def on_resize(self, storage: Any, old_nbytes: int, new_nbytes: int) -> None:
        """A storage resized in place: its old bytes freed, its new ones allocated (one allocation each way;
        the caching allocator frees and mallocs for ``resize_`` too)."""
        key = storage._cdata
        aid = self.live.pop(key, None)
        if aid is not None and key not in self.last_aid:
            self.refilled[aid] = key  # made by its op, refilled by ``resize_`` from now on
        if aid is not None:
            self.trace.events.append((False, aid))
            self.live_bytes -= self.trace.allocations[aid].nbytes
        elif key not in self.last_aid:
            if old_nbytes:
                return  # a storage this recorder never saw (made outside the step)
            # made empty, filled now: it lives from here on
            weakref.finalize(storage, self._free, key, -1)  # after the step (closed) it records nothing
        if new_nbytes:
            category = self.key_category.get(key, Category.UNKNOWN)
            self.live[key] = aid = self._alloc(new_nbytes, "resize_", category)
        self.last_aid[key] = aid if aid is not None else -1

    def on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name, special = _op_facts(func)
        count = _FLOPS.get(func._overloadpacket)
        if count is not None and self.phase in _COUNTED_PHASES:
            # torch.utils.flop_counter's formulas (docs/DESIGN.md, fact 8), in this same fake pass
            key = (self.iteration, self.micro)
            self.micro_flops[key] = self.micro_flops.get(key, 0) + count(*args, **kwargs, out_val=out)
        if type(out) is FakeTensor:  # most ops: one plain fake tensor
            if out.device.type == self.device_type:
                self.track(out, name)
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    self.track(t, name)
        if not special:
            return
        if getattr(func, "namespace", "") == "bitsandbytes":
            if self.phase in _COUNTED_PHASES:  # the flop counter has no formula for bitsandbytes' matmuls
                key = (self.iteration, self.micro)
                self.micro_flops[key] = self.micro_flops.get(key, 0) + bnb_flops(name, args)
            if self.capability is not None:
                self._internals(name, bnb_internals(name, args, kwargs, self.capability))
            return
        if name in _CUDNN_RNN_OPS and self.device_type == "cuda":
            self._cudnn_rnn(name, args, out)
            return
        if name == "_cudnn_init_dropout_state":
            self.mark([out], Category.BUFFER)  # cached by RNN.cpp for the rest of the process
            return
        cublas = self.workspace_bytes and name in _CUBLAS_OPS
        conv = self.convs is not None and name.startswith("convolution")
        if not (cublas or conv):
            return
        thread = "backward" if self._in_backward() else "forward"  # handles and caches are per thread
        if cublas and thread not in self.workspaces:
            self.workspaces.add(thread)
            self._alloc(self.workspace_bytes, f"cublas_workspace[{thread}]", Category.WORKSPACE)
        if conv and self.convs is not None:
            for kind, nbytes in self.convs.actions(name, args, out, thread):
                # freed as the call returns: transient, but its block stays cached
                self._transient(nbytes, f"{kind}[{name}]", _CONV_CATEGORY[kind])

    def _internals(self, name: str, events: list[tuple[bool, str, int]]) -> None:
        """What a kernel allocates and frees inside, after its outputs (bitsandbytes' CUDA kernels)."""
        held: dict[str, list[int]] = {}
        for allocate, label, nbytes in events:
            if allocate:
                held.setdefault(label, []).append(self._alloc(nbytes, f"{label}[{name}]", Category.TEMPORARY))
            else:
                aid = held[label].pop()
                self.trace.events.append((False, aid))
                self.live_bytes -= self.trace.allocations[aid].nbytes

    def _cudnn_rnn(self, name: str, args: Any, out: Any) -> None:
        """A cuDNN RNN call: its FLOPs, and what it allocates and frees inside (workspaces, contiguous copies,
        zeros for undefined grads; ``cudnn_rnn.internals``), after its outputs."""
        self.rnn_calls += 1
        if self.phase in _COUNTED_PHASES:
            key = (self.iteration, self.micro)
            self.micro_flops[key] = self.micro_flops.get(key, 0) + rnn_flops(name, args)
        held: dict[str, list[int]] = {}
        for allocate, label, nbytes in rnn_internals(name, args, out):
            if allocate:
                held.setdefault(label, []).append(self._alloc(nbytes, f"{label}[{name}]", Category.TEMPORARY))
            else:
                aid = held[label].pop()
                self.trace.events.append((False, aid))
                self.live_bytes -= self.trace.allocations[aid].nbytes

    # --- recording
    def stream(self) -> int:
        """The stream current on the virtual GPU."""
        return self.streams.current_id()

    def enter(self, phase: Phase, iteration: int) -> None:
        """The loop enters ``phase`` of ``iteration``: what the next allocations are made in."""
        self.phase = phase
        self.iteration = iteration
        if iteration == 0 and self.repeat is not None:
            self.repeat.mark(phase, len(self.trace.events), len(self.trace.allocations))

    def track_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """From now on, the ``.grad`` of ``params`` is a gradient whenever a backward ends."""
        self.params = list(params)

    def _in_backward(self) -> bool:
        return self.engine is not None and bool(self.engine.node_stack)

    def module(self) -> str:
        if self.engine is not None and self.engine.node_stack:
            node = self.engine.node_stack[-1]
            seq = node._sequence_nr() if hasattr(node, "_sequence_nr") else -1
            return self.node_modules.get(seq, "")
        return self.module_stack[-1] if self.module_stack else ""

    def _transient(self, nbytes: int, op: str, category: Category) -> None:
        """An allocation freed right away: a workspace, or an empty_cache call (0 bytes, its category)."""
        aid = self._alloc(nbytes, op, category)
        self.trace.events.append((False, aid))
        self.live_bytes -= nbytes

    def track(self, t: torch.Tensor, op: str) -> None:
        if is_traceable_wrapper_subclass(t):
            return  # a DTensor holds no memory of its own: its local tensor does (recorded by its own op)
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return  # the caching allocator hands out no block for 0 bytes
        aid = self._alloc(nbytes, op, Category.UNKNOWN)
        self.live[key] = aid
        weakref.finalize(storage, self._free, key, aid)  # after the step (closed) it records nothing

    def _alloc(self, nbytes: int, op: str, category: str) -> int:
        aid = len(self.trace.allocations)
        self.trace.allocations.append(Allocation(nbytes, self.phase, self.module(), op, self.iteration, category,
                                                 self.stream()))
        self.trace.events.append((True, aid))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return aid

    def _free(self, key: int, aid: int) -> None:
        if self.closed:
            return  # storages that outlive the step (the model's, freed when the caller drops it): not part of it
        self.refilled.pop(aid, None)  # gone: a later storage at its address is another
        aid = self.moved.get(aid, aid)  # a storage the loop kept across iterations (iterations.py)
        if key in self.last_aid:  # resized in place since: its latest allocation, if not resized to 0
            aid = self.live.pop(key, -1)
            del self.last_aid[key]
            self.key_category.pop(key, None)
            if aid < 0:
                return
        elif self.live.get(key) == aid:
            del self.live[key]
        self.trace.events.append((False, aid))
        self.live_bytes -= self.trace.allocations[aid].nbytes

    def mark_storages(self, tensors: Any, category: Category) -> None:
        """``mark``, and every later allocation of these tensors' storages (resized in place) too."""
        for t in tensors:
            key = t.untyped_storage()._cdata
            self.key_category[key] = category
            aid = self.live.get(key, self.last_aid.get(key, -1))
            if aid >= 0:
                self.trace.allocations[aid].category = category

    def mark(self, tensors: Any, category: Category) -> None:
        """Give the storages of ``tensors`` a category (parameters, grads, states)."""
        for t in tensors:
            if is_traceable_wrapper_subclass(t):
                self.mark((getattr(t, name) for name in t.__tensor_flatten__()[0]), category)  # DTensor's shard
            elif isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                aid = self.live.get(t.untyped_storage()._cdata)
                if aid is not None:
                    self.trace.allocations[aid].category = category

    def repeats_first(self, iteration: int, kept: Kept) -> bool:
        """Whether ``iteration``'s zero_grad..backward were written from the first iteration's (``Repeat``)."""
        return self.repeat is not None and self.repeat.copy(self, iteration, kept)

    def micro_step(self, iteration: int, micro: int) -> bool:
        """Micro-step ``micro`` starts: False once the last two repeat (it and the rest would too)."""
        starts = self.micro_starts.setdefault(iteration, [])
        now = len(self.trace.events)
        if micro >= 2 and not self.every_micro_step and repeats(
                self.trace.allocations, self.trace.events, starts[-2], starts[-1], now, self.survivors):
            self.cuts.append(Cut(starts[-2], starts[-1], now, micro))
            return False
        starts.append(now)
        self.micro = micro
        return True

    def step_flops(self, iteration: int, accumulation: int) -> int:
        """FLOPs of ``iteration``'s forward and backward passes over all ``accumulation`` micro-steps: those
        not simulated repeat the last one that was."""
        ran = len(self.micro_starts.get(iteration, ())) or 1
        flops = sum(self.micro_flops.get((iteration, m), 0) for m in range(ran))
        return flops + (accumulation - ran) * self.micro_flops.get((iteration, ran - 1), 0)

    def finish(self, accumulation: int, notes: StepNotes) -> Trace:
        """The complete trace: categorize what is left (activations survive until backward, the rest is
        temporary), repeat the micro-steps the simulation stood for (of ``accumulation`` in all), and
        take what the step said (``notes``) and what the recorder counted (FLOPs, cuDNN RNN calls).

        Runs of consecutive frees are put in allocation order: some bursts
        come out of hash maps (clearing autocast's cast cache frees in
        TensorImpl address order), and the allocator ends a burst of frees in
        the same state whatever their order.
        """
        self.closed = True
        for k, a in enumerate(self.trace.allocations):
            if a.category:
                continue
            if a.phase == Phase.INPUT:
                self.trace.allocations[k].category = Category.INPUT
            elif a.stream:
                self.trace.allocations[k].category = Category.COMMUNICATION  # made on a collective's stream (FSDP2's)
            elif a.phase in (Phase.FORWARD, Phase.LOSS) and k in self.survivors:
                self.trace.allocations[k].category = Category.ACTIVATION
            else:
                self.trace.allocations[k].category = Category.TEMPORARY
        if self.cuts:
            expand(self.trace, self.cuts, accumulation)
        events = self.trace.events
        i = 0
        while i < len(events):
            j = i
            while j < len(events) and not events[j][0]:
                j += 1
            if j - i > 1:
                events[i:j] = sorted(events[i:j], key=lambda e: e[1])
            i = j + 1 if j == i else j
        trace = self.trace  # complete from here on: what the step said, what the recorder counted
        trace.assumptions.extend(notes.setup)
        if self.cuts:
            ran = max(c.simulated for c in self.cuts)
            trace.assumptions.append(
                f"grad accumulation: {ran} of {accumulation} micro-steps simulated (the last repeated the one "
                f"before); memory from {micro_steps_in_trace(accumulation, ran)} of them, FLOPs from all "
                f"{accumulation}")
        if self.rnn_calls:
            trace.assumptions.append(RNN_ASSUMPTION)
        if any(a.category == Category.PAGED_OPTIMIZER_STATE for a in trace.allocations):
            trace.assumptions.append(PAGED_ASSUMPTION)
        trace.assumptions.extend(notes.kernels)
        trace.unsupported.extend(notes.unsupported)
        self.trace.sdpa_calls = list(notes.sdpa_calls)
        self.trace.card_queries = list(notes.card_queries)
        self.trace.capability_thresholds = list(notes.capability_thresholds)
        # FLOPs of one optimizer step's forward and backward passes (all accumulation micro-batches), steady state
        self.trace.flops = self.step_flops(notes.iterations - 1, accumulation)
        return trace

    def snapshot_survivors(self) -> None:
        """Called when a backward starts: live forward allocations are activations."""
        self.survivors.update(self.live.values())


class SimulationHooks(StepHooks):
    """The training loop as the recorder sees it: phases, categories, the virtual GPU's autocast and
    ``.item()`` policy, and foreign exceptions translated at this one seam."""

    def __init__(self, vgpu: VirtualGPU, recorder: Recorder, model: torch.nn.Module | None = None) -> None:
        super().__init__(vgpu.device)
        self.vgpu = vgpu
        self.recorder = recorder
        self.model = model  # a distributed step's (wrapped) model, whose own buffers get their categories

    def phase(self, phase: Phase, iteration: int) -> None:
        self.recorder.enter(phase, iteration)

    def micro_step(self, iteration: int, micro: int) -> bool:
        return self.recorder.micro_step(iteration, micro)

    def repeats_first(self, iteration: int, training: Training, batch: Any) -> bool:
        if self.recorder.repeat is None:
            return False  # not tried for this loop: nothing to gather
        grads = [p.grad for p in training.params if p.grad is not None]
        scaler = training.scaler
        once = [] if scaler is None else [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]
        held = [v for m in training.model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        return self.recorder.repeats_first(iteration, Kept(grads, tree_leaves(batch), once, held))

    def call(self, phase: Phase, fn: Callable[[], T]) -> T:
        return _call(phase, fn, self.recorder)

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
        return self.vgpu.autocasting(dtype)

    def optimizer_step(self) -> contextlib.AbstractContextManager[Any]:
        return self.vgpu.allowing_item()

    def backward_starts(self) -> None:
        self.recorder.snapshot_survivors()
        if self.model is not None:
            # what the forward made of distributed training's own memory: gathered parameters, buckets
            self.recorder.mark_storages(gathered_parameters(self.model), Category.PARAMETER)
            self.recorder.mark(gradient_buckets(self.model), Category.COMMUNICATION)

    def after_backward(self, params: list[torch.nn.Parameter]) -> None:
        self.recorder.mark((p.grad for p in params), Category.GRADIENT)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's optimizer
        state = tree_leaves(list(local.state.values()))
        self.recorder.mark((t for t in state if not is_paged(t)), Category.OPTIMIZER_STATE)
        self.recorder.mark(filter(is_paged, state), Category.PAGED_OPTIMIZER_STATE)  # bitsandbytes' paged buffers


class _ModuleTracker:
    """Global forward hooks that keep the module path stack of the recorder."""

    def __init__(self, recorder: Recorder, root: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> None:
        self.recorder = recorder
        self.names = {id(m): (n or type(root).__name__) for n, m in root.named_modules()}
        if wrapper is not None and wrapper is not root:
            self.names[id(wrapper)] = type(root).__name__  # DDP's wrapper: the model's own name
        self.handles: list[Any] = []

    def __enter__(self) -> _ModuleTracker:
        stack = self.recorder.module_stack
        names = self.names

        def pre(module: torch.nn.Module, args: Any) -> None:
            stack.append(names.get(id(module), type(module).__name__))

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop()

        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def _unsupported_hooks(model: torch.nn.Module) -> list[str]:
    notes = []
    for name, m in model.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            notes.append(f"module backward hooks on {name or 'model'} are not run by the simulated engine")
    if torch.nn.modules.module._global_backward_hooks or torch.nn.modules.module._global_backward_pre_hooks:
        notes.append("global module backward hooks are not run by the simulated engine")
    return notes


WORST_CASE_ASSUMPTION = ("data-dependent sizes at their maximum (every mask element true, NMS keeps every box, "
                         ".item() in the forward reads 0, the model's asserts hold): an upper bound")


@dataclass
class StepNotes:
    """What a simulated step says besides its allocations, for ``Recorder.finish``: the assumption lines of its
    set-up and of the kernels it ran, what it could not model, its SDPA calls, the torch.cuda questions it asked
    and the capability thresholds of its kernels."""

    iterations: int
    setup: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    sdpa_calls: list[Any] = field(default_factory=list)
    card_queries: list[str] = field(default_factory=list)
    capability_thresholds: list[tuple[int, int]] = field(default_factory=list)


def record_training(
    model_factory: ModelFactory,
    batch_factory: BatchFactory,
    loss_fn: LossFn | None,
    batch_size: int,
    recipe: Recipe,
    gpu: GPU | None,
    *,
    subclass_like: bool = False,
    cpp_engine: bool = False,
    worst_case: bool = False,
    shortcuts: Shortcuts | None = None,
    every_micro_step: bool = False,
    every_iteration: bool = False,
    routing: str = "balanced",
    notes: Sequence[str] = (),
    step_fn: StepFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    on_device: OnDevice | None = None,
) -> Trace:
    """Simulate ``recipe.iterations`` training steps (``estimator.simulate.step``) and return the event trace.

    Accumulation micro-steps stop being simulated once they repeat (``estimator.simulate.accumulation``);
    ``every_micro_step`` simulates them all, the trace that repetition stands for (slow: for tests). Later
    iterations' forward and backward are written from the first's where it shows they would record the same
    (``estimator.simulate.iterations``); ``every_iteration`` simulates them (for tests).
    ``routing``: tokens per expert in an eager experts loop (``model.moe_routing``); ``notes``: assumption
    lines the caller adds to the trace's own. ``step_fn``, ``optimizer_fn``, ``on_device``: a step the user
    wrote (``estimator.models.user``).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SpecError("batch_size", batch_size, "an integer >= 1")
    try:
        meta_model = build_on_meta(model_factory)
    except Exception as exc:
        raise SimulationError(f"the model factory failed: {type(exc).__name__}: {exc}", "build") from exc
    if not isinstance(meta_model, torch.nn.Module):
        raise SpecError("model", type(meta_model).__name__, "a factory returning a torch.nn.Module")
    meta_model = cast_model(meta_model, recipe)  # on meta: no allocation
    convs = ConvWorkspaces(gpu.capability, recipe.cudnn_benchmark) if gpu is not None else None
    columns = CpuConvColumns() if gpu is None else None  # the CPU target's slow kernels' im2col buffers
    streams = Streams()  # the virtual GPU's streams, which the recorder reads
    d = recipe.distributed
    # a user's own step, optimizer or set-up code may hold what the loop does not: every iteration simulated
    repeat = not every_iteration and step_fn is None and optimizer_fn is None and on_device is None and tried(recipe)
    recorder = Recorder("cuda" if gpu is not None else "cpu", gpu.cublas_workspace_bytes if gpu is not None else 0,
                        convs or columns, streams=streams, every_micro_step=every_micro_step,
                        capability=gpu.capability if gpu is not None else None, repeat=repeat)
    vgpu = VirtualGPU(gpu, observer=recorder, worst_case=WorstCase(recorder.module) if worst_case else None,
                      subclass_like=subclass_like, cpp_engine=cpp_engine, shortcuts=shortcuts,
                      distributed=recipe.distributed.active, routing=routing, streams=streams)
    setup = [WORST_CASE_ASSUMPTION] if worst_case else []  # what the set-up says of the step
    unsupported: list[str] = []
    with contextlib.ExitStack() as stack:
        mesh = None
        if d.active:
            stack.enter_context(process_group(d))
            setup.append(NCCL_ASSUMPTION)
            if d.shards:
                mesh = mesh_for(d, vgpu.device.type)
        stack.enter_context(vgpu)
        stack.enter_context(torch.autograd.graph.node_creation_hook(
            lambda node: recorder.node_modules.__setitem__(node._sequence_nr(), recorder.module())))
        if mesh is not None:
            setup.append(_call(Phase.SETUP, functools.partial(shard, meta_model, d, mesh), recorder))
            model = vgpu.materialize_sharded(meta_model)
        else:
            model, quant_state = vgpu.materialize_quantized(meta_model)
            recorder.mark(quant_state, Category.PARAMETER)  # a quantized weight's absmax and code tables
        if on_device is not None:
            _call(Phase.SETUP, functools.partial(on_device, model), recorder)
        recorder.mark(model.parameters(), Category.PARAMETER)
        recorder.mark(model.buffers(), Category.BUFFER)
        unsupported.extend(_unsupported_hooks(model))
        training = _call(Phase.SETUP, functools.partial(prepare, model, recipe, vgpu.device, simulated=True,
                                                        optimizer_fn=optimizer_fn), recorder)
        setup.extend(training.notes)
        recorder.track_gradients(training.params)
        with _ModuleTracker(recorder, model, training.model):
            run_steps(training, batch_factory, loss_fn, batch_size, recipe, vgpu.device,
                      hooks=SimulationHooks(vgpu, recorder, training.model if d.active else None), step_fn=step_fn)
        recorder.track_gradients([])
        del model, training
    return recorder.finish(recipe.grad_accumulation_steps, StepNotes(
        recipe.iterations, setup=setup, kernels=[*_kernel_lines(vgpu, convs, recipe), *notes],
        unsupported=[*unsupported, *vgpu.unsupported], sdpa_calls=sorted(vgpu.sdpa_calls, key=repr),
        card_queries=sorted(set(vgpu.card_queries)),
        capability_thresholds=sorted(convs.thresholds) if convs is not None else []))


def _kernel_lines(vgpu: VirtualGPU, convs: ConvWorkspaces | None, recipe: Recipe) -> list[str]:
    """What the virtual GPU's kernels said during the step: the worst case, cuDNN, MoE kernels."""
    lines = []
    if vgpu.worst_case is not None and vgpu.worst_case.used:
        lines.append(f"data-dependent ops at their worst case: {vgpu.worst_case.summary()}")
    if convs is not None and convs.calls:
        lines.append(CUDNN_ASSUMPTION)
        if recipe.cudnn_benchmark:
            lines.append(BENCHMARK_ASSUMPTION)
    if vgpu.gpu is not None:
        lines.extend(vgpu.grouped_mm.assumptions(vgpu.gpu.name))
    if vgpu.quantized:
        lines.append(BNB_ASSUMPTION)
    return lines


def record_built(built: BuiltModel, batch_size: int, recipe: Recipe, gpu: GPU | None, *,
                 notes: Sequence[str] = ()) -> Trace:
    """``record_training`` of a built model (its routing, its worst-case policy; ``notes`` added to the trace's
    assumptions). A model whose step turns out to read a tensor's value or to make a data-dependent shape
    (``DataDependentError``) is simulated again under the worst-case policy (virtual_gpu/worst_case.py: every
    mask element true, ``.item()`` reads 0), and ``built`` is marked so that its later simulations use the
    policy from the start; the trace's assumptions name each such op and the modules that ran it. A model that
    fails even under the policy raises the first error."""
    def run(worst_case: bool) -> Trace:
        return record_training(built.factory, built.batch_factory, built.loss_fn, batch_size, recipe, gpu,
                               worst_case=worst_case, routing=built.moe_routing, notes=notes, step_fn=built.step_fn,
                               optimizer_fn=built.optimizer_fn, on_device=built.on_device)

    try:
        return run(built.worst_case)
    except DataDependentError as first:
        if built.worst_case:
            raise
        try:
            trace = run(True)
        except DataDependentError:
            raise first from None
        built.mark_worst_case()
        return trace


# torch.nn.functional's checks behind "Expected more than 1 value per channel when training".
_BATCH_SIZE_CHECKS = frozenset({"_verify_batch_size", "_verify_spatial_size"})


def _raised_in(exc: BaseException, functions: frozenset[str]) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in functions:
            return True
        tb = tb.tb_next
    return False


def _call(phase: Phase, fn: Callable[[], T], recorder: Recorder) -> T:
    """``fn()``, with foreign exceptions translated into batchfit's (the one seam, estimator/errors.py)."""
    try:
        return fn()
    except (SimulationError, SpecError):
        raise
    except torch._subclasses.fake_tensor.DataDependentOutputException as exc:
        raise DataDependentError(
            f"the model reads a tensor's value ({exc.func}), which a simulation without data cannot know",
            where=f"{phase}, module {recorder.module() or '<top>'}",
        ) from exc
    except torch._subclasses.fake_tensor.DynamicOutputShapeException as exc:
        raise DataDependentError(
            f"an op's output shape depends on the data ({exc.func}), which a simulation without data cannot know",
            where=f"{phase}, module {recorder.module() or '<top>'}",
        ) from exc
    except ValueError as exc:
        where = f"{phase}, module {recorder.module() or '<top>'}"
        if _raised_in(exc, _BATCH_SIZE_CHECKS):
            raise BatchTooSmallError(f"{exc}; the smallest batch that trains is larger", where) from exc
        raise SimulationError(f"ValueError: {exc}", where) from exc
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None and not isinstance(cause, DataDependentError):
            cause = cause.__cause__
        where = f"{phase}, module {recorder.module() or '<top>'}"
        if isinstance(cause, DataDependentError):
            raise DataDependentError(cause.message, where) from exc
        raise SimulationError(f"{type(exc).__name__}: {exc}", where) from exc
