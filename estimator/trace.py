"""Run a training step on the virtual GPU and record every allocation.

The event trace is the contract between the simulator and everything after
it (DESIGN): an ordered list of allocations and frees of storages, each
allocation with its bytes, category, owning module, phase and iteration.

>>> trace = record_training(factory, batches, loss_fn, 8, Recipe(), gpu)   # doctest: +SKIP
>>> trace.allocations[0].category
'parameter'
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry as _FLOPS

from estimator.allocator import CONV_WORKSPACE, EMPTY_CACHE, SOFT_CATEGORIES, Event
from estimator.checkpointing import enable_checkpointing
from estimator.errors import BatchTooSmallError, DataDependentError, SimulationError, SpecError
from estimator.gpus import GPU
from estimator.optimizers import build_optimizer
from estimator.recipe import Recipe
from estimator.virtual_gpu import VirtualGPU
from estimator.virtual_gpu.cudnn import ASSUMPTION as CUDNN_ASSUMPTION
from estimator.virtual_gpu.cudnn import BENCHMARK_ASSUMPTION, COLUMNS, WORKSPACE, ConvWorkspaces
from estimator.virtual_gpu.worst_case import WorstCase

CATEGORIES = (
    "parameter", "buffer", "gradient", "optimizer_state", "activation", "temporary", "input", "workspace",
    "conv_workspace", "empty_cache",
)
# Ops that run cuBLAS: the first one on a thread allocates the handle's workspace.
_CUBLAS_OPS = frozenset(
    name for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "_scaled_mm")
)

# what each convolution action is in the trace
_CONV_CATEGORY = {WORKSPACE: CONV_WORKSPACE, COLUMNS: "temporary", EMPTY_CACHE: EMPTY_CACHE}

ModelFactory = Callable[[], torch.nn.Module]
BatchFactory = Callable[[int, torch.device], tuple[Any, Any]]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Allocation:
    """One storage: ``nbytes`` as requested from the allocator."""

    nbytes: int
    phase: str
    module: str
    op: str
    iteration: int
    category: str = ""


@dataclass
class Trace:
    """Allocations and the ordered alloc/free events that reference them."""

    allocations: list[Allocation] = field(default_factory=list)
    events: list[tuple[bool, int]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    flops: int = 0
    sdpa_calls: list = field(default_factory=list)  # what the card-dependent attention choices read
    card_queries: list[str] = field(default_factory=list)  # torch.cuda queries the step made
    # compute capabilities at which the step's kernels change (cuDNN for bf16 convs from sm80, ...)
    capability_thresholds: list[tuple[int, int]] = field(default_factory=list)

    def sizes(self, workspace: int) -> list[int]:
        """Each allocation's bytes, the cuBLAS workspace as ``workspace`` (the card's own: a trace is shared)."""
        return [workspace if a.category == "workspace" else a.nbytes for a in self.allocations]

    def categories(self) -> list[str]:
        return [a.category for a in self.allocations]

    def where(self, k: int) -> tuple[str, str, int]:
        """(phase, module, iteration) of allocation ``k``, as a report names the peak."""
        a = self.allocations[k]
        return a.phase, a.module, a.iteration

    def allocator_events(self) -> list[Event]:
        allocs = self.allocations
        return [Event(a, k, allocs[k].nbytes, allocs[k].category) for a, k in self.events]

    def live_peak(self, hard_only: bool = False) -> tuple[int, int]:
        """(peak of live requested bytes, event index): what a profiler of the raw allocator sees.
        ``hard_only``: without the allocations a replay may skip (cuDNN workspaces), as the affine
        trace's ``live_at`` bounds them."""
        live = peak = idx = 0
        allocs = self.allocations
        for i, (is_alloc, k) in enumerate(self.events):
            if hard_only and allocs[k].category in SOFT_CATEGORIES:
                continue
            live += allocs[k].nbytes if is_alloc else -allocs[k].nbytes
            if live > peak:
                peak, idx = live, i
        return peak, idx


class Recorder:
    """Observes every op on the virtual GPU and records storage lifetimes."""

    def __init__(self, vgpu: VirtualGPU, workspace_bytes: int, convs: ConvWorkspaces | None = None) -> None:
        self.vgpu = vgpu
        self.device_type = vgpu.device.type
        self.trace = Trace()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = "setup"
        self.iteration = 0
        self.module_stack: list[str] = []
        self.node_modules: dict[int, str] = {}
        self.workspace_bytes = workspace_bytes
        self.workspaces: set[str] = set()
        self.convs = convs
        self.survivors: set[int] = set()
        self.iteration_flops: dict[int, int] = {}
        vgpu.observer = self.observe
        vgpu.memory_allocated = lambda: self.live_bytes
        vgpu.max_memory_allocated = lambda: self.peak_bytes
        vgpu.reset_peak = self._reset_peak
        vgpu.empty_cache = lambda: self._transient(0, "torch.cuda.empty_cache", EMPTY_CACHE)

    def _reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def module(self) -> str:
        engine = self.vgpu.engine
        if engine.node_stack:
            node = engine.node_stack[-1]
            seq = node._sequence_nr() if hasattr(node, "_sequence_nr") else -1
            return self.node_modules.get(seq, "")
        return self.module_stack[-1] if self.module_stack else ""

    def observe(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[-1]
        count = _FLOPS.get(func._overloadpacket)
        if count is not None and self.phase in ("forward", "loss", "backward"):
            # torch.utils.flop_counter's formulas (DESIGN fact 8), in this same fake pass
            self.iteration_flops[self.iteration] = (
                self.iteration_flops.get(self.iteration, 0) + count(*args, **kwargs, out_val=out))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self.track(t, name)
        cublas = self.workspace_bytes and name in _CUBLAS_OPS
        conv = self.convs is not None and name.startswith("convolution")
        if not (cublas or conv):
            return
        thread = "backward" if self.vgpu.engine.node_stack else "forward"  # handles and caches are per thread
        if cublas and thread not in self.workspaces:
            self.workspaces.add(thread)
            self._alloc(self.workspace_bytes, f"cublas_workspace[{thread}]", "workspace")
        if conv:
            for kind, nbytes in self.convs.actions(name, args, out, thread):
                # freed as the call returns: transient, but its block stays cached
                self._transient(nbytes, f"{kind}[{name}]", _CONV_CATEGORY[kind])

    def _transient(self, nbytes: int, op: str, category: str) -> None:
        """An allocation freed right away: a workspace, or an empty_cache call (0 bytes, its category)."""
        aid = self._alloc(nbytes, op, category)
        self.trace.events.append((False, aid))
        self.live_bytes -= nbytes

    def track(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return  # the caching allocator hands out no block for 0 bytes
        aid = self._alloc(nbytes, op, "")
        self.live[key] = aid
        fin = weakref.finalize(storage, self._free, key, aid)
        fin.atexit = False

    def _alloc(self, nbytes: int, op: str, category: str) -> int:
        aid = len(self.trace.allocations)
        self.trace.allocations.append(
            Allocation(nbytes, self.phase, self.module(), op, self.iteration, category)
        )
        self.trace.events.append((True, aid))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return aid

    def _free(self, key: int, aid: int) -> None:
        if self.live.get(key) == aid:
            del self.live[key]
        self.trace.events.append((False, aid))
        self.live_bytes -= self.trace.allocations[aid].nbytes

    def mark(self, tensors, category: str) -> None:
        """Give the storages of ``tensors`` a category (parameters, grads, states)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                aid = self.live.get(t.untyped_storage()._cdata)
                if aid is not None:
                    self.trace.allocations[aid].category = category

    def finish(self) -> Trace:
        """Categorize what is left: activations survive until backward, the rest is temporary.

        Runs of consecutive frees are put in allocation order: some bursts
        come out of hash maps (clearing autocast's cast cache frees in
        TensorImpl address order), and the allocator ends a burst of frees in
        the same state whatever their order.
        """
        events = self.trace.events
        i = 0
        while i < len(events):
            j = i
            while j < len(events) and not events[j][0]:
                j += 1
            if j - i > 1:
                events[i:j] = sorted(events[i:j], key=lambda e: e[1])
            i = j + 1 if j == i else j
        for k, a in enumerate(self.trace.allocations):
            if a.category:
                continue
            if a.phase == "input":
                a.category = "input"
            elif a.phase in ("forward", "loss") and k in self.survivors:
                a.category = "activation"
            else:
                a.category = "temporary"
        return self.trace

    def snapshot_survivors(self) -> None:
        """Called when a backward starts: live forward allocations are activations."""
        self.survivors.update(self.live.values())


class _ModuleTracker:
    """Global forward hooks that keep the module path stack of the recorder."""

    def __init__(self, recorder: Recorder, root: torch.nn.Module) -> None:
        self.recorder = recorder
        self.names = {id(m): (n or type(root).__name__) for n, m in root.named_modules()}
        self.handles: list[Any] = []

    def __enter__(self) -> "_ModuleTracker":
        stack = self.recorder.module_stack
        names = self.names

        def pre(module, args):
            stack.append(names.get(id(module), type(module).__name__))

        def post(module, args, output):
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


def build_on_meta(factory: ModelFactory) -> torch.nn.Module:
    """Call ``factory()`` so that every parameter and buffer is on the meta device (DESIGN fact 3).

    Under ``torch.device("meta")`` first. Constructors that compute with
    tensors (RegNet derives its widths with ``.tolist()``) cannot run there;
    those run on the CPU with each parameter and buffer moved to meta as it
    is registered, before any initializer touches it.
    """
    try:
        with torch.device("meta"):
            return factory()
    except Exception as first:
        try:
            with _register_on_meta():
                return factory()
        except Exception:
            raise first from None


@contextlib.contextmanager
def _register_on_meta():
    module = torch.nn.Module
    register_parameter, register_buffer = module.register_parameter, module.register_buffer

    def parameter_on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(self, name, param)

    def buffer_on_meta(self, name, tensor, persistent=True):
        if tensor is not None:
            tensor = tensor.to("meta")
        register_buffer(self, name, tensor, persistent)

    module.register_parameter, module.register_buffer = parameter_on_meta, buffer_on_meta
    try:
        yield
    finally:
        module.register_parameter, module.register_buffer = register_parameter, register_buffer


def record_training(
    model_factory: ModelFactory,
    batch_factory: BatchFactory,
    loss_fn: LossFn,
    batch_size: int,
    recipe: Recipe,
    gpu: GPU | None,
    *,
    subclass_like: bool = False,
    cpp_engine: bool = False,
    worst_case: bool = False,
) -> Trace:
    """Simulate ``recipe.iterations`` training steps and return the event trace.

    Per iteration: zero_grad -> (input -> forward -> loss -> backward) x
    accumulation steps -> optimizer step (GradScaler for amp-fp16). Model
    outputs are released once the loss is computed, and the loss once
    backward has run, as in the Hugging Face Trainer and Lightning loops.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SpecError("batch_size", batch_size, "an integer >= 1")
    try:
        meta_model = build_on_meta(model_factory)
    except Exception as exc:
        raise SimulationError(f"the model factory failed: {type(exc).__name__}: {exc}", "build") from exc
    if not isinstance(meta_model, torch.nn.Module):
        raise SpecError("model", type(meta_model).__name__, "a factory returning a torch.nn.Module")
    if recipe.precision == "bf16":
        meta_model = meta_model.to(torch.bfloat16)
    workspace = gpu.cublas_workspace_bytes if gpu is not None else 0
    vgpu = VirtualGPU(gpu, subclass_like=subclass_like, cpp_engine=cpp_engine)
    vgpu.worst_case = WorstCase() if worst_case else None
    convs = ConvWorkspaces(gpu.capability, recipe.cudnn_benchmark) if gpu is not None else None
    recorder = Recorder(vgpu, workspace, convs)
    if worst_case:
        recorder.trace.assumptions.append(
            "data-dependent sizes at their maximum (every mask element true, NMS keeps every box, "
            ".item() in the forward reads 0): an upper bound")
    with vgpu:
        with torch.autograd.graph.node_creation_hook(
            lambda node: recorder.node_modules.__setitem__(node._sequence_nr(), recorder.module())
        ):
            _run(vgpu, recorder, meta_model, batch_factory, loss_fn, batch_size, recipe)
    trace = recorder.finish()
    if convs is not None:
        trace.capability_thresholds = sorted(convs.thresholds)
        if convs.calls:
            trace.assumptions.append(CUDNN_ASSUMPTION)
            if recipe.cudnn_benchmark:
                trace.assumptions.append(BENCHMARK_ASSUMPTION)
    trace.unsupported.extend(vgpu.unsupported)
    trace.sdpa_calls = sorted(vgpu.sdpa_calls, key=repr)
    # FLOPs of one optimizer step's forward and backward passes (all accumulation micro-batches), steady state
    trace.flops = recorder.iteration_flops.get(recipe.iterations - 1, 0)
    trace.card_queries = sorted(set(vgpu.card_queries))
    return trace


def _run(vgpu, recorder, meta_model, batch_factory, loss_fn, batch_size, recipe) -> None:
    recorder.phase = "setup"
    model = vgpu.materialize(meta_model)
    model.train()
    recorder.mark(model.parameters(), "parameter")
    recorder.mark(model.buffers(), "buffer")
    recorder.trace.unsupported.extend(_unsupported_hooks(model))
    if recipe.gradient_checkpointing:
        recorder.trace.assumptions.append(enable_checkpointing(model, recipe.gradient_checkpointing))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(recipe, params)
    scaler = torch.amp.GradScaler(vgpu.device.type) if recipe.uses_grad_scaler else None
    vgpu.engine.on_backward_end = lambda: recorder.mark((p.grad for p in params), "gradient")
    batch = None
    with _ModuleTracker(recorder, model):
        for it in range(recipe.iterations):
            recorder.iteration = it
            if recipe.zero_grad_at == "step-start":
                recorder.phase = "zero_grad"
                optimizer.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
            for micro in range(recipe.grad_accumulation_steps):
                recorder.phase = "input"
                batch = _call("input", lambda: batch_factory(batch_size, vgpu.device), recorder)
                inputs, targets = batch
                loss = _forward(vgpu, recorder, model, inputs, targets, loss_fn, recipe,
                                getattr(batch_factory, "keep_dtype", ()))
                if micro == 0 and recipe.zero_grad_at == "after-forward":
                    recorder.phase = "zero_grad"
                    optimizer.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
                recorder.phase = "backward"
                recorder.snapshot_survivors()
                if recipe.grad_accumulation_steps > 1:
                    loss = loss / recipe.grad_accumulation_steps
                if scaler is not None:
                    loss = scaler.scale(loss)
                _call("backward", loss.backward, recorder)
                recorder.mark((p.grad for p in params), "gradient")
                del loss, inputs, targets
            recorder.phase = "optimizer"
            vgpu.allow_item = True
            try:
                if scaler is not None:
                    _call("optimizer", lambda: scaler.step(optimizer), recorder)
                    scaler.update()
                else:
                    _call("optimizer", optimizer.step, recorder)
            finally:
                vgpu.allow_item = False
            recorder.mark(tree_leaves(list(optimizer.state.values())), "optimizer_state")
        recorder.phase = "teardown"
        del batch


def apply_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(inputs)``: a dict as keyword arguments, a tuple or list as positional ones."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _forward(vgpu, recorder, model, inputs, targets, loss_fn, recipe, keep=()) -> torch.Tensor:
    vgpu.autocast(recipe.autocast_dtype)
    try:
        recorder.phase = "forward"
        # pure bf16: the copy lives as long as the forward (and what autograd saves of it), as in Fabric
        out = _call("forward", lambda: apply_model(model, recipe.forward_inputs(inputs, keep)), recorder)
        recorder.phase = "loss"
        loss = _call("loss", lambda: loss_fn(out, targets), recorder)
        del out
    finally:
        vgpu.autocast(None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SimulationError("the loss must be a tensor with one element", "loss")
    return loss


# torch.nn.functional's checks behind "Expected more than 1 value per channel when training".
_BATCH_SIZE_CHECKS = frozenset({"_verify_batch_size", "_verify_spatial_size"})


def _raised_in(exc: BaseException, functions: frozenset[str]) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in functions:
            return True
        tb = tb.tb_next
    return False


def _call(phase: str, fn, recorder: Recorder):
    try:
        return fn()
    except (SimulationError, SpecError):
        raise
    except torch._subclasses.fake_tensor.DataDependentOutputException as exc:
        raise DataDependentError(
            f"the model reads a tensor's value ({exc.func}), which a simulation without data cannot know",
            where=f"{phase}, module {recorder.module() or '<top>'}",
        ) from exc
    except ValueError as exc:
        where = f"{phase}, module {recorder.module() or '<top>'}"
        if _raised_in(exc, _BATCH_SIZE_CHECKS):
            raise BatchTooSmallError(f"{exc}; the smallest batch that trains is larger", where) from exc
        raise SimulationError(f"ValueError: {exc}", where) from exc
    except Exception as exc:
        cause = exc
        while cause.__cause__ is not None and not isinstance(cause, DataDependentError):
            cause = cause.__cause__
        if isinstance(cause, DataDependentError):
            raise DataDependentError(cause.message, f"{phase}, module {recorder.module() or '<top>'}") from exc
        raise SimulationError(
            f"{type(exc).__name__}: {exc}", f"{phase}, module {recorder.module() or '<top>'}"
        ) from exc
