"""Make a CPU-only host behave, for PyTorch, like a named target GPU.

>>> from estimator.gpus import get_gpu
>>> with VirtualGPU(get_gpu("A100-80GB")) as vgpu:          # doctest: +SKIP
...     model = vgpu.materialize(meta_model)
...     loss = model(torch.empty(8, 3, 224, 224, device="cuda")).sum()
...     loss.backward()                                       # our engine

Inside: tensors are fake (no memory, no data); ``torch.autograd.backward``,
``torch.autograd.grad`` and ``Tensor.backward`` run ``Engine``; autocast,
SDPA backend, cuDNN RNNs, optimizer defaults and ``torch.cuda`` queries
answer as on the target card. Everything patched is put back on exit (docs/DESIGN.md, fact 10).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.optim.optimizer as _optim
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor, _device_handler
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from estimator.errors import DataDependentError
from estimator.gpus import GPU
from estimator.simulate.virtual_gpu import bnb
from estimator.simulate.virtual_gpu.attention import make_sdpa
from estimator.simulate.virtual_gpu.cudnn_rnn import CudnnRnns
from estimator.simulate.virtual_gpu.device import DeviceProperties, Patches, patch_cuda_queries
from estimator.simulate.virtual_gpu.engine import Engine, SavedTensors, TensorHooks
from estimator.simulate.virtual_gpu.fake_mode import FakeMode, Shortcuts, deepcopy_fake
from estimator.simulate.virtual_gpu.module_apply import module_apply
from estimator.simulate.virtual_gpu.moe import GroupedMM, Routing
from estimator.simulate.virtual_gpu.streams import Streams
from estimator.simulate.virtual_gpu.worst_case import WorstCase, validating_distribution

__all__ = ["NullObserver", "Observer", "Shortcuts", "VirtualGPU"]

_IS_ALL_TRUE = torch.ops.aten._is_all_true.default  # torch._check_tensor_all's verdict (VirtualGPU._checks)
# ``Tensor.device`` asked from C++ (a fake tensor dispatches it): half the ops a step dispatches, none allocating
_PRIM_DEVICE = torch.ops.prim.device.default


class Observer(Protocol):
    """What watches the virtual GPU: every op's outputs, and the memory questions torch.cuda answers.

    Handed to ``VirtualGPU`` at construction (as flop_counter hands its
    counter to its mode); ``estimator.simulate.record.Recorder`` is the one
    that records traces.
    """

    def attach(self, engine: Engine) -> None:
        """The GPU's backward engine, whose node stack says whether an op runs in a backward."""

    def on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """``func(*args, **kwargs)`` returned ``out`` on the GPU."""

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def empty_cache(self) -> None:
        """The model called ``torch.cuda.empty_cache()``."""

    def backward_end(self) -> None:
        """A top-level backward finished."""

    def on_resize(self, storage: Any, old_nbytes: int, new_nbytes: int) -> None:
        """A storage on the GPU was resized in place (FSDP2 frees and refills its gathered parameters so)."""


class NullObserver:
    """Watches nothing: memory queries answer 0."""

    def attach(self, engine: Engine) -> None:
        pass

    def on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def backward_end(self) -> None:
        pass

    def on_resize(self, storage: Any, old_nbytes: int, new_nbytes: int) -> None:
        pass


_PLAIN = (torch.Tensor, FakeTensor, torch.nn.Parameter)


class _DispatchMode(TorchDispatchMode):
    """Sits above FakeTensorMode: ``.item()`` policy, observer."""

    def __init__(self, vgpu: VirtualGPU) -> None:
        super().__init__()
        self.vgpu = vgpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:  # FakeTensor's own answer, without the observers
            return _device_handler(args)
        kwargs = kwargs or {}
        if self.vgpu.distributed and any(issubclass(t, torch.Tensor) and t not in _PLAIN for t in types) and any(
                is_traceable_wrapper_subclass(x) for x in tree_leaves((args, kwargs))):
            # a DTensor's op: DTensor runs it on its local tensors, which come back here one by one
            return NotImplemented
        vgpu = self.vgpu
        if vgpu._muted:
            return func(*args, **kwargs)  # DTensor working out an op's global shape: nothing a GPU allocates
        if func is torch.ops.aten._local_scalar_dense.default:
            return vgpu._scalar(args[0])
        policy = vgpu.worst_case
        out = vgpu.grouped_mm.dispatch(func, args, kwargs)  # docs/DESIGN.md, fact 21
        if out is NotImplemented and getattr(func, "namespace", "") == "bitsandbytes":
            out = bnb.dispatch(func, args, kwargs)  # LLM.int8()'s outlier columns
        if out is NotImplemented:  # MoE routing first: its policy is the request's, the worst case a fallback
            out = vgpu.routing.dispatch(func, args, kwargs)
        if out is NotImplemented and policy is not None:
            out = policy.dispatch(func, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        if policy is not None:
            policy.after(func, args, kwargs, out)
        vgpu.routing.after(func, args, kwargs, out)
        if func is _IS_ALL_TRUE:
            vgpu._checks[out] = True
        vgpu.observer.on_op(func, args, kwargs, out)
        return out


def _outside_modes(original):
    """``original`` with the virtual GPU's tensor modes off: FSDP2 builds a device mesh for an int
    reshard_after_forward from the world's (CPU) rank tensor, and the mesh reads it (``tolist``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def outside(*args, **kwargs):
        with _disable_current_modes():
            return original(*args, **kwargs)

    return outside


class _EngineFacade:
    """``Variable._execution_engine`` while simulating: final callbacks go to our engine (FSDP2 and DDP
    queue theirs there); anything else is the C++ engine's."""

    def __init__(self, real: Any, engine: Engine) -> None:
        self._real = real
        self.queue_callback = engine.queue_callback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _format_as_cuda(original, known: Callable[[torch.Tensor], bool]):
    """``Tensor.__format__`` formats a 0-d plain tensor by its value (``.item()``) and any subclass by its
    repr: on the card ``f"expert_{idx}"`` (switch_transformers' experts loop) reads "expert_3", on a fake
    tensor it would read "expert_FakeTensor(...)". A fake 0-d tensor whose value the simulation knows without
    reading data (``known``: a constant, an expert index the MoE routing answers) is formatted as the card's;
    any other keeps torch's format, so that a message built eagerly (``f"tokens: {n}"`` in a check that passes)
    reads no value and changes no answer."""

    def __format__(self, format_spec):
        if isinstance(self, FakeTensor) and self.dim() == 0 and known(self):
            return self.item().__format__(format_spec)
        return original(self, format_spec)

    return __format__


def _post_order(module: torch.nn.Module, seen: set[int] | None = None) -> Iterator[torch.nn.Module]:
    """Every module under ``module`` once (the first time Module._apply's recursion reaches it), children first."""
    seen = seen if seen is not None else set()
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module


class VirtualGPU:
    """Context manager: the host looks like ``gpu`` to PyTorch while inside.

    ``gpu=None`` targets the CPU itself (fake CPU tensors), which lets tests
    compare predictions with real CPU runs. ``subclass_like=True`` makes the
    engine reproduce the C++ engine's behaviour on fake tensors (used by the
    engine parity tests).
    """

    def __init__(
        self, gpu: GPU | None, *, observer: Observer | None = None, worst_case: WorstCase | None = None,
        shortcuts: Shortcuts | None = None, subclass_like: bool = False, cpp_engine: bool = False,
        distributed: bool = False, routing: str = "balanced", streams: Streams | None = None,
    ) -> None:
        self.gpu = gpu
        self.is_cuda = gpu is not None
        self.device = torch.device("cuda", 0) if self.is_cuda else torch.device("cpu")
        self.capability = gpu.capability if gpu is not None else (0, 0)
        self.observer: Observer = observer if observer is not None else NullObserver()
        self.saved = SavedTensors()
        self.hooks = TensorHooks()
        self.engine = Engine(self.saved, self.hooks, subclass_like=subclass_like,
                             on_backward_end=self.observer.backward_end)
        self.observer.attach(self.engine)
        self.shortcuts = shortcuts or Shortcuts()
        self._allow_item = False
        self._muted = 0  # > 0: ops run without the observer (DTensor's shape propagation)
        self.distributed = distributed  # DTensor may run: its shape propagation is muted
        self.sdpa_calls: set = set()  # SdpaCall: what the attention backend choices read
        self.card_queries: list[str] = []  # torch.cuda questions whose answer depends on the card
        self.worst_case = worst_case  # data-dependent ops at their largest size, or None
        self.grouped_mm = GroupedMM(self.capability if self.is_cuda else None)  # MoE experts' kernel
        self.routing = Routing(routing)  # tokens per expert in the eager experts loop (model.moe_routing)
        # torch._check_tensor_all's verdicts (aten._is_all_true), read with .item(): see _scalar
        self._checks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Tests only: leave torch's C++ engine in charge (works for fake CPU tensors).
        self.cpp_engine = cpp_engine and gpu is None
        self.unsupported: list[str] = []
        self.quantized = False  # bitsandbytes' quantized layers were materialized
        self.streams = streams or Streams()  # which stream allocates: one allocator pool per stream
        self.rnns = CudnnRnns()  # cuDNN's RNN path (docs/DESIGN.md, fact 20)
        self._patches = Patches()
        self._fake: FakeMode | None = None
        self._mode: _DispatchMode | None = None
        self._hooks_ctx: contextlib.AbstractContextManager[Any] | None = None
        self._autocast_state: tuple | None = None

    # --- lifecycle
    def __enter__(self) -> VirtualGPU:
        p = self._patches
        try:
            if not self.cpp_engine:
                frame_cls = torch.utils.checkpoint._CheckpointFrame
                p.set(frame_cls, "save_inputs", self.saved.wrap_save_inputs(frame_cls.save_inputs))
                engine_run = self.engine.run_backward
                p.set(torch.autograd.graph, "_engine_run_backward", engine_run)
                p.set(torch.autograd, "_engine_run_backward", engine_run)
                p.set(torch.autograd.Variable, "_execution_engine",
                      _EngineFacade(torch.autograd.Variable._execution_engine, self.engine))
            p.set(torch.Tensor, "register_hook", self._wrap_register_hook(torch.Tensor.register_hook))
            p.set(torch.Tensor, "__format__", _format_as_cuda(torch.Tensor.__format__, self._value_known))
            p.set(torch.UntypedStorage, "resize_", self._wrap_resize(torch.UntypedStorage.resize_))
            if self.distributed:
                from torch.distributed.tensor._sharding_prop import ShardingPropagator

                name = "_propagate_tensor_meta_non_cached"
                p.set(ShardingPropagator, name, self._muting(getattr(ShardingPropagator, name)))
                if self.shortcuts.foreach_sharding:
                    import torch.distributed.tensor._sharding_prop as sharding

                    from estimator.simulate.distributed.foreach_sharding import memoized

                    name = "_expand_single_dim_strategy_to_mesh"
                    p.set(sharding, name, memoized(getattr(sharding, name)))
                import torch.distributed.fsdp._fully_shard._fully_shard as fsdp

                name = "_get_post_forward_mesh_info"
                p.set(fsdp, name, _outside_modes(getattr(fsdp, name)))
            p.set(torch.autograd.function.Function, "apply", self._wrap_function_apply())
            if bnb.loaded():  # MatMul8bitLt logs its fp16 cast on every call: once per layer and step here
                import logging

                p.set(logging.getLogger("bitsandbytes.autograd._functions"), "disabled", True)
                bnb.patch_peft(p)
            p.set(torch.nn.Module, "_apply", module_apply(torch.nn.Module._apply))
            # copy.deepcopy of a fake tensor: one of this mode, its copy recorded (fake_mode.deepcopy_fake)
            p.set(FakeTensor, "__deepcopy__", deepcopy_fake)
            if self.gpu is not None:
                props = DeviceProperties(
                    name=self.gpu.name, major=self.capability[0], minor=self.capability[1],
                    total_memory=self.gpu.memory_bytes,
                )
                patch_cuda_queries(p, props, self.observer, self.card_queries.append)
                self.streams.patch(p)
                # docs/DESIGN.md, fact 5: the attention backend the card would pick.
                p.set(torch.nn.functional, "scaled_dot_product_attention",
                      make_sdpa(torch.nn.functional.scaled_dot_product_attention, self.capability,
                                self.sdpa_calls.add))
                # docs/DESIGN.md, fact 20: nn.LSTM/GRU/RNN take cuDNN's path as on the card.
                self.rnns.patch(p)
                # docs/DESIGN.md, fact 6: FakeTensor is not a foreach type, so optimizers
                # would take the single-tensor path a real GPU never takes.
                p.set(_optim, "_foreach_supported_types", list(_optim._foreach_supported_types) + [FakeTensor])
            self._fake = FakeMode(self.shortcuts, allow_non_fake_inputs=True)
            self._fake.__enter__()
            self._mode = _DispatchMode(self)
            self._mode.__enter__()
            if not self.cpp_engine:
                self._hooks_ctx = self.saved.hooks()
                self._hooks_ctx.__enter__()
        except BaseException:
            self._exit()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit()

    def _exit(self) -> None:
        self.autocast(None)
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._fake is not None:
            self._fake.__exit__(None, None, None)
            self._fake = None
        self._patches.restore()

    # --- helpers used by the simulator
    def materialize(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move a meta-device module onto the virtual device (docs/DESIGN.md, fact 3)."""
        # to_empty swaps meta parameters for new ones per module, which unties
        # shared weights (tied embeddings); tie them again as they were.
        shared: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    shared.setdefault(id(p), []).append((mod, name))
        groups = [owners for owners in shared.values() if len(owners) > 1]
        # torch.empty_strided, not to_empty's empty_like: a meta tensor handed to
        # the fake mode is first converted to a fake one, which costs more than the op.
        device = self.device
        # Each module once, children first as Module._apply goes: its recursion visits a module shared by two
        # parents (CoaT's shared_cpe / shared_crpe) twice, and the second visit finds fake parameters, which it
        # can only swap (torch.utils.swap_tensors), and a fake tensor has a weakref (the fake mode's memo).
        for mod in _post_order(module):
            mod._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device),
                       recurse=False)
        for (first_mod, first_name), *rest in groups:
            keep = first_mod._parameters[first_name]
            for mod, name in rest:
                mod._parameters[name] = keep
        return module

    def materialize_quantized(self, module: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.Tensor]]:
        """``materialize``, with bitsandbytes' quantized layers quantized on the device (virtual_gpu/bnb.py); the
        quantized weights' state tensors besides their parameters."""
        state = bnb.materialize(module, self.materialize, self.device)
        self.quantized = self.quantized or bool(state)
        return module, state

    def materialize_sharded(self, module: torch.nn.Module) -> torch.nn.Module:
        """A meta module whose parameters are DTensors (FSDP2's shards) onto the virtual device, as
        ``module.to_empty(device="cuda")`` does (torchtitan): each rank allocates its padded shards."""
        return module.to_empty(device=self.device)

    def autocast(self, dtype: torch.dtype | None) -> None:
        """Switch CUDA's (or CPU's) real autocast policy on for ``dtype``, or off with None.

        ``torch.autocast("cuda")`` turns itself off without a GPU (docs/DESIGN.md,
        fact 4); the low-level switches give the real policy on fake tensors.
        """
        dev = self.device.type
        if dtype is None:
            if self._autocast_state is not None:
                enabled, old_dtype = self._autocast_state
                torch.set_autocast_enabled(dev, enabled)
                torch.set_autocast_dtype(dev, old_dtype)
                self._autocast_state = None
                if torch.autocast_decrement_nesting() == 0:
                    torch.clear_autocast_cache()  # frees the cached low-precision weight copies
            return
        if self._autocast_state is None:
            self._autocast_state = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            torch.autocast_increment_nesting()
        torch.set_autocast_enabled(dev, True)
        torch.set_autocast_dtype(dev, dtype)

    @contextlib.contextmanager
    def autocasting(self, dtype: torch.dtype | None) -> Iterator[None]:
        """``autocast(dtype)`` for the block (nothing when ``dtype`` is None), then off again."""
        if dtype is None:
            yield
            return
        self.autocast(dtype)
        try:
            yield
        finally:
            self.autocast(None)

    @contextlib.contextmanager
    def allowing_item(self) -> Iterator[None]:
        """``.item()`` answers the steady state inside the block: the optimizer step and GradScaler read
        step counters and found_inf, which batchfit drives itself."""
        self._allow_item = True
        try:
            yield
        finally:
            self._allow_item = False

    def _value_known(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s value is known without reading data: a real constant, one the MoE routing answers, or
        one batchfit drives (``allowing_item``: the optimizer's step counters)."""
        return self._allow_item or getattr(t, "constant", None) is not None or self.routing.owns(t)

    def _scalar(self, t: torch.Tensor):
        """``.item()`` on a fake tensor: allowed only where batchfit drives it."""
        const = getattr(t, "constant", None)
        if const is not None:
            with no_dispatch():  # a real tensor: read it without converting it to a fake one
                return const.item()
        if self.routing.owns(t):
            return self.routing.scalar(t)
        if t in self._checks:
            # torch._check_tensor_all(cond) (transformers' torch_compilable_check: Siglip2's "spatial_shapes
            # > 0"): an assertion on the batch's values, which the valid batch a real run feeds passes; it
            # decides no shape and no allocation.
            return True
        if validating_distribution():  # torch.distributions' argument check: it holds in a run that trains
            if self.worst_case is not None:
                self.worst_case.note("torch.distributions validation (holds)")
            return True
        if self._allow_item:
            # GradScaler's found_inf (0: no overflow, the steady state) and
            # optimizer step counters (>= 1 once a step has run).
            return 0 if t.is_floating_point() and t.device.type != "cpu" else 1
        if self.worst_case is not None:
            return self.worst_case.read(t)
        raise DataDependentError(
            "the model reads a tensor's value (.item(), bool(), a data-dependent shape), "
            "which a simulation without data cannot know",
            where="forward",
        )

    def _muting(self, original):
        """``original`` run with the observer muted: DTensor's sharding propagation runs each op once on
        global-shape fake tensors in the fake mode it finds (ours) to learn the output's shape."""
        vgpu = self

        def muted(*args, **kwargs):
            vgpu._muted += 1
            try:
                return original(*args, **kwargs)
            finally:
                vgpu._muted -= 1

        return muted

    def _wrap_resize(self, original):
        """``UntypedStorage.resize_``, seen by the observer: an in-place free (to 0) or allocation of a
        storage that outlives it (FSDP2's ``free_storage``/``alloc_storage``); not a dispatcher op."""
        observer, device_type = self.observer, self.device.type

        def resize_(storage, size):
            old = storage.nbytes()
            out = original(storage, size)
            # a fake tensor's storage is a meta storage
            if storage.device.type in (device_type, "meta") and old != storage.nbytes():
                observer.on_resize(storage, old, storage.nbytes())
            return out

        return resize_

    def _wrap_register_hook(self, original):
        hooks = self.hooks

        def register_hook(tensor, hook):
            handle = original(tensor, hook)
            hooks.add(tensor)
            return handle

        return register_hook

    def _wrap_function_apply(self):
        fn_cls = torch.autograd.function.Function
        original = next(k.__dict__["apply"] for k in fn_cls.__mro__ if "apply" in k.__dict__)

        def apply(cls, *args, **kwargs):
            out = original.__get__(None, cls)(*args, **kwargs)
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            node = getattr(first, "grad_fn", None)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                node._batchfit_is_tensor_input = [isinstance(a, torch.Tensor) for a in args]
            return out

        return classmethod(apply)
