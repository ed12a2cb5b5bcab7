"""A Python autograd engine with the C++ engine's memory semantics.

On a host without a GPU the C++ engine refuses fake CUDA tensors
("hasPrimaryContext expects a valid device index", docs/DESIGN.md fact 2), while
calling a node directly, ``node(*grads)``, works. ``Engine.run_backward`` is a
drop-in for ``torch.autograd.graph._engine_run_backward`` that follows
torch/csrc/autograd/engine.cpp step by step, because the order in which
gradients are created, accumulated and freed *is* the memory profile:

- ready queue: a binary heap with libstdc++'s ``std::priority_queue``
  algorithms and ``CompareNodeTaskTime`` (highest ``sequence_nr`` first;
  AccumulateGrad has UINT64_MAX), so ties break exactly as in C++;
- ``compute_dependencies`` counts every edge; ``init_to_execute`` prunes and
  captures for ``torch.autograd.grad`` and ``backward(inputs=...)``;
- ``call_function``: tensor pre-hooks, the node, ``validate_outputs``
  (``sum_to_size`` and dtype/device casts to ``node._input_metadata``); the
  inputs die when it returns, then the node's saved tensors are released;
- ``InputBuffer::accumulate``: in place when the engine holds the last
  reference to a dense buffer, out of place otherwise or when the tensors are
  subclass-like (``isTensorSubclassLike`` is true for fake tensors and under any
  dispatch mode, so the C++ engine measured on fake tensors never accumulates
  in place; a real GPU does);
- ``AccumulateGrad``: steals the incoming gradient when nothing else references
  it and it obeys the gradient layout contract, else clones it with the
  parameter's strides; later gradients are added in place.

Saved tensors are owned through ``saved_tensors_hooks`` (``SavedTensors``), so
the engine can release them right after the node that saved them ran, as
``Node::release_variables`` does. Non-reentrant checkpoint's frame saves its
block's inputs outside any node; those die with the frame, once every node
holding one of its holders has run.

Known limitations: hooks registered on nodes (``grad_fn.register_hook``,
``register_prehook``, module full backward hooks) and engine callbacks
(``queue_callback``) are not run. Module backward hooks are reported in the trace's
``unsupported`` list (``estimator.simulate.record._unsupported_hooks``); hooks on nodes and
engine callbacks are not detected.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, _get_grad_fn_or_grad_acc

from estimator.simulate.virtual_gpu.strides import non_overlapping_and_dense as is_non_overlapping_and_dense

UINT64_MAX = 2**64 - 1  # AccumulateGrad's sequence_nr (functions/accumulate_grad.cpp)


# --- libstdc++ heap algorithms (bits/stl_heap.h), comp(a, b) = a.seq < b.seq ---

def _push_heap(heap: list, hole: int, top: int, value: Any) -> None:
    parent = (hole - 1) // 2
    while hole > top and heap[parent].seq < value.seq:
        heap[hole] = heap[parent]
        hole = parent
        parent = (hole - 1) // 2
    heap[hole] = value


def heap_push(heap: list, value: Any) -> None:
    heap.append(value)
    _push_heap(heap, len(heap) - 1, 0, value)


def heap_pop(heap: list) -> Any:
    """``top()`` then ``pop()`` of a ``std::priority_queue``."""
    top = heap[0]
    value = heap.pop()
    n = len(heap)
    if n == 0:
        return top
    hole, child = 0, 0
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if heap[child].seq < heap[child - 1].seq:
            child -= 1
        heap[hole] = heap[child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        heap[hole] = heap[child - 1]
        hole = child - 1
    _push_heap(heap, hole, 0, value)
    return top


# --- saved tensors ---------------------------------------------------------

class _Packed:
    """What a SavedVariable holds while our hooks are active."""

    __slots__ = ("tensor", "seq", "__weakref__")

    def __init__(self, tensor: torch.Tensor, seq: int | None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.seq = seq  # None: owned by a checkpoint frame, not by a node


class SavedTensors:
    """Owns every tensor autograd saves, keyed by the node that saved it.

    A node saves right after it is constructed, so the saving node is the
    last sequence number handed out (``_get_sequence_nr() - 1``). Packs that
    do not follow that rule (the clone an in-place op on a view saves) are
    caught when the node unpacks them while it runs.
    """

    def __init__(self) -> None:
        self.by_seq: dict[int, list[weakref.ref]] = {}
        self.running: list[list[_Packed]] = []
        self.on_pack: Callable[[torch.Tensor], None] | None = None
        self._frame: Any = None
        self._frames: list[tuple[weakref.ref, list[weakref.ref]]] = []

    def pack(self, tensor: torch.Tensor) -> _Packed:
        if self._frame is not None:
            packed = _Packed(tensor, None)
            self._frames[-1][1].append(weakref.ref(packed))
        else:
            seq = torch._C._autograd._get_sequence_nr() - 1
            fn = tensor.grad_fn
            if fn is not None and tensor._is_view() and fn._sequence_nr() == seq:
                # An in-place op on a view saves its output after rebase_history
                # made CopySlices; reading the view's grad_fn to save it makes
                # a new view node. The saver is the CopySlices just before.
                seq -= 1
            packed = _Packed(tensor, seq)
            self.by_seq.setdefault(seq, []).append(weakref.ref(packed))
        if self.on_pack is not None:
            self.on_pack(tensor)
        return packed

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if packed.tensor is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Specify retain_graph=True if you "
                "need to backward through the graph a second time."
            )
        if self.running:
            self.running[-1].append(packed)
        return packed.tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def wrap_save_inputs(self, save_inputs: Callable) -> Callable:
        """Non-reentrant checkpoint's frame saves its block's inputs itself.

        In C++ they die with the frame, when the engine has released the
        SavedVariables of every node holding one of the frame's holders;
        a holder whose every handle is None has been unpacked by its node.
        """
        def wrapped(frame, *args):
            self._frame = frame
            self._frames.append((weakref.ref(frame), []))
            try:
                return save_inputs(frame, *args)
            finally:
                self._frame = None
        return wrapped

    def _release_dead_frames(self) -> None:
        alive = []
        for frame_ref, packs in self._frames:
            frame = frame_ref()
            if frame is None or not any((q := p()) is not None and q.tensor is not None for p in packs):
                continue
            if frame.is_recomputed and all(
                h() is None or all(v is None for v in h().handles.values()) for h in frame.weak_holders
            ):
                for p in packs:
                    if (q := p()) is not None:
                        q.tensor = None
                continue
            alive.append((frame_ref, packs))
        self._frames = alive

    def release(self, seq: int, unpacked: list[_Packed], graph_seqs: set[int]) -> None:
        """``Node::release_variables`` for the node with this sequence number.

        Tensors the node unpacked are its own unless they carry the sequence
        number of another node of the graph (checkpoint's saved inputs,
        unpacked while recomputing, belong to their own node).
        """
        for packed in unpacked:
            if packed.seq is not None and (packed.seq == seq or packed.seq not in graph_seqs):
                packed.tensor = None
        for ref in self.by_seq.pop(seq, ()):
            held = ref()
            if held is not None:
                held.tensor = None
        if self._frames:
            self._release_dead_frames()


# --- tensor hooks ----------------------------------------------------------

class TensorHooks:
    """Tensor hooks (``Tensor.register_hook``) indexed by the node they run on."""

    def __init__(self) -> None:
        self.by_node: dict[int, tuple[Any, list[tuple[int, dict[int, Any]]]]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        node = _get_grad_fn_or_grad_acc(tensor)
        nr = 0 if tensor.grad_fn is None else tensor.output_nr
        entry = self.by_node.setdefault(id(node), (node, []))
        hooks = tensor._backward_hooks
        if hooks is not None and all(h is not hooks for _, h in entry[1]):
            entry[1].append((nr, hooks))

    def run(self, node: Any, inputs: list) -> list:
        entry = self.by_node.get(id(node))
        if entry is None or entry[0] is not node:
            return inputs
        for nr, hooks in entry[1]:
            for hook in list(hooks.values()):
                out = hook(inputs[nr])
                if out is not None:
                    inputs[nr] = out
        return inputs


# --- the engine ------------------------------------------------------------

@dataclass(eq=False)
class _Task:
    node: Any
    buffer: list
    seq: int


@dataclass(eq=False)
class _ExecInfo:
    needed: bool = False
    captures: list[tuple[int, int]] = field(default_factory=list)


class _GraphRoot:
    """The dummy root the C++ engine adds when there are several roots."""

    def __init__(self, edges: list[tuple[Any, int]], grads: list) -> None:
        self.edges = edges
        self.grads = grads
        self.next_functions = tuple(edges)
        self._input_metadata = ()

    def _sequence_nr(self) -> int:
        return UINT64_MAX - 1


def _refcount_baseline() -> int:
    def probe(t: torch.Tensor) -> int:
        return sys.getrefcount(t)

    holder = [torch.empty(0)]
    t = holder.pop()
    return probe(t)


@dataclass
class _GraphTask:
    """engine.cpp's ``GraphTask``: one backward's state (keep_graph_, dependencies_, exec_info_, captured_vars_,
    not_ready_, and its ready queue)."""

    keep_graph: bool
    deps: dict[int, int]
    exec_info: dict[int, _ExecInfo]
    captured: list
    ready: list[_Task] = field(default_factory=list)
    not_ready: dict[int, list] = field(default_factory=dict)


class Engine:
    """Backward on the calling thread with the C++ engine's memory behaviour.

    ``subclass_like=True`` reproduces the C++ engine running on fake tensors
    or under a dispatch mode (out-of-place buffer accumulation); ``False``
    reproduces it on real CUDA tensors, which is what a prediction wants.
    """

    def __init__(self, saved: SavedTensors, hooks: TensorHooks, subclass_like: bool = False,
                 on_backward_end: Callable[[], None] | None = None) -> None:
        self.saved = saved
        self.hooks = hooks
        self.subclass_like = subclass_like
        self.node_stack: list[Any] = []
        self.on_backward_end = on_backward_end  # called when a top-level backward finishes
        self._ref_base = _refcount_baseline()
        self._graph_seqs: list[set[int]] = []
        # per running backward: what ``Variable._execution_engine.queue_callback`` queued (FSDP2, DDP)
        self._final_callbacks: list[list[Callable[[], None]]] = []

    def queue_callback(self, callback: Callable[[], None]) -> None:
        """``Variable._execution_engine.queue_callback``: run ``callback`` when the running backward ends,
        after every node (engine.cpp, ``GraphTask::exec_post_processing``)."""
        if not self._final_callbacks:
            raise RuntimeError("Final callbacks can only be installed during backward pass.")
        self._final_callbacks[-1].append(callback)

    # The signature of torch.autograd.graph._engine_run_backward.
    def run_backward(
        self,
        t_outputs: Sequence[torch.Tensor | GradientEdge],
        grad_tensors: Sequence[torch.Tensor | None],
        keep_graph: bool,
        create_graph: bool,
        inputs: Sequence[torch.Tensor | GradientEdge] = (),
        allow_unreachable: bool = False,
        accumulate_grad: bool = True,
    ) -> tuple[torch.Tensor | None, ...]:
        roots = [self._root_edge(i, t) for i, t in enumerate(t_outputs)]
        output_edges = [self._input_edge(i, t) for i, t in enumerate(inputs)]
        group = None
        if torch._C._get_graph_exec_group() is None:
            # Non-reentrant checkpoint keys recomputation by graph task; without
            # the C++ engine's task id it needs a group to recompute only once.
            group = torch.utils.checkpoint.GraphExecGroup()
            group.__enter__()
        callbacks: list[Callable[[], None]] = []
        self._final_callbacks.append(callbacks)
        try:
            with torch.set_grad_enabled(create_graph):
                captured = self._execute(roots, list(grad_tensors), keep_graph, output_edges, accumulate_grad)
            i = 0
            while i < len(callbacks):  # a callback may queue another
                callbacks[i]()
                i += 1
        finally:
            self._final_callbacks.pop()
            if group is not None:
                group.__exit__(None, None, None)
        if not accumulate_grad:
            if not allow_unreachable:
                for g in captured:
                    if g is None:
                        raise RuntimeError(
                            "One of the differentiated Tensors appears to not have been used in the "
                            "graph. Set allow_unused=True if this is the desired behavior."
                        )
            return tuple(captured)
        if self.on_backward_end is not None and not self.node_stack:
            self.on_backward_end()
        return ()

    @staticmethod
    def _root_edge(i: int, t: torch.Tensor | GradientEdge) -> tuple[Any, int]:
        if isinstance(t, GradientEdge):
            return (t.node, t.output_nr)
        if not t.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
        if t.grad_fn is not None:
            return (t.grad_fn, t.output_nr)
        return (_get_grad_fn_or_grad_acc(t), 0)

    @staticmethod
    def _input_edge(i: int, t: torch.Tensor | GradientEdge) -> tuple[Any, int]:
        if isinstance(t, GradientEdge):
            return (t.node, t.output_nr)
        if not t.requires_grad:
            raise RuntimeError(f"element {i} of the input tensors does not require grad")
        if t.grad_fn is not None:
            return (t.grad_fn, t.output_nr)
        return (_get_grad_fn_or_grad_acc(t), 0)

    # engine.cpp: Engine::execute
    def _execute(self, roots, grads, keep_graph, output_edges, accumulate_grad) -> list:
        self._validate(roots, grads)
        if len(roots) == 1:
            root = roots[0][0]
            buffer = [None] * len(root._input_metadata)
            self._buffer_add(buffer, roots[0][1], grads[0])
        else:
            root = _GraphRoot(roots, grads)
            buffer = []
        del grads
        deps, nodes = self._dependencies(root)
        self._graph_seqs.append({n._sequence_nr() for n in nodes.values()})
        exec_info: dict[int, _ExecInfo] = {}
        captured: list = []
        if output_edges:
            captured = [None] * len(output_edges)
            exec_info = self._init_to_execute(root, output_edges, accumulate_grad)
        graph = _GraphTask(keep_graph, deps, exec_info, captured)
        heap_push(graph.ready, _Task(root, buffer, root._sequence_nr()))
        del buffer
        while graph.ready:
            task = heap_pop(graph.ready)
            self._evaluate(task, graph)
            del task
        del nodes
        self._graph_seqs.pop()
        return graph.captured

    @staticmethod
    def _dependencies(root) -> tuple[dict[int, int], dict[int, Any]]:
        deps: dict[int, int] = {}
        nodes: dict[int, Any] = {id(root): root}
        queue = [root]
        while queue:
            fn = queue.pop()
            for nxt, _ in fn.next_functions:
                if nxt is None:
                    continue
                key = id(nxt)
                deps[key] = deps.get(key, 0) + 1
                if key not in nodes:
                    nodes[key] = nxt
                    queue.append(nxt)
        return deps, nodes

    @staticmethod
    def _init_to_execute(root, output_edges, accumulate_grad) -> dict[int, _ExecInfo]:
        info: dict[int, _ExecInfo] = {id(root): _ExecInfo(needed=True)}
        for idx, (node, nr) in enumerate(output_edges):
            entry = info.setdefault(id(node), _ExecInfo())
            if accumulate_grad:
                entry.needed = True
            else:
                entry.captures.append((nr, idx))
        # A node is needed when any node below it executes or captures.
        seen: dict[int, bool] = {}

        def visit(fn) -> bool:
            key = id(fn)
            if key in seen:
                return seen[key]
            seen[key] = False
            needed = False
            stack = [(fn, iter(fn.next_functions))]
            while stack:
                cur, it = stack[-1]
                advanced = False
                for nxt, _ in it:
                    if nxt is None:
                        continue
                    k = id(nxt)
                    if k not in seen:
                        seen[k] = False
                        stack.append((nxt, iter(nxt.next_functions)))
                        advanced = True
                        break
                if advanced:
                    continue
                stack.pop()
                ck = id(cur)
                e = info.get(ck)
                own = e is not None and (e.needed or bool(e.captures))
                child = any(nxt is not None and seen.get(id(nxt), False) for nxt, _ in cur.next_functions)
                if child and e is None:
                    e = info[ck] = _ExecInfo()
                if child:
                    assert e is not None
                    e.needed = True
                seen[ck] = own or child
            needed = seen[key]
            return needed

        visit(root)
        info[id(root)].needed = True
        return info

    # engine.cpp: Engine::evaluate_function
    def _evaluate(self, task, graph: _GraphTask) -> None:
        fn = task.node
        inputs = task.buffer
        task.buffer = None
        if graph.exec_info:
            info = graph.exec_info.get(id(fn))
            if info is None:
                return
            if not info.needed:
                inputs = self.hooks.run(fn, inputs)
            for input_idx, output_idx in info.captures:
                graph.captured[output_idx] = inputs[input_idx]
            if not info.needed:
                return
        outputs, unpacked = self._call_function(fn, inputs)
        del inputs  # engine.cpp: call_function's inputs die before release_variables
        if not graph.keep_graph and not isinstance(fn, _GraphRoot):
            self.saved.release(fn._sequence_nr(), unpacked, self._graph_seqs[-1])
        del unpacked
        if not outputs:
            return
        next_functions = fn.next_functions
        for i in range(len(outputs)):
            nxt, input_nr = next_functions[i]
            if nxt is None:
                continue
            key = id(nxt)
            remaining = graph.deps[key] - 1
            if remaining == 0:
                del graph.deps[key]
            else:
                graph.deps[key] = remaining
            if graph.exec_info:
                e = graph.exec_info.get(key)
                if e is None or not (e.needed or e.captures):
                    continue
            buffer = graph.not_ready.get(key)
            output = outputs[i]
            outputs[i] = None
            if buffer is None:
                buffer = [None] * len(nxt._input_metadata)
                self._buffer_add(buffer, input_nr, output)
                del output
                if remaining == 0:
                    heap_push(graph.ready, _Task(nxt, buffer, nxt._sequence_nr()))
                else:
                    graph.not_ready[key] = buffer
            else:
                self._buffer_add(buffer, input_nr, output)
                del output
                if remaining == 0:
                    del graph.not_ready[key]
                    heap_push(graph.ready, _Task(nxt, buffer, nxt._sequence_nr()))
            del buffer

    # engine.cpp: call_function
    def _call_function(self, fn, inputs: list) -> tuple[list, list]:
        inputs = self.hooks.run(fn, inputs)
        unpacked: list = []
        self.saved.running.append(unpacked)
        self.node_stack.append(fn)
        try:
            if isinstance(fn, _GraphRoot):
                outputs = fn.grads
                fn.grads = []
            elif fn.__class__.__name__ == "AccumulateGrad":
                outputs = self._accumulate_grad(fn, inputs)
            elif isinstance(fn, torch.autograd.function.BackwardCFunction):
                outputs = self._call_python_node(fn, inputs)
            else:
                result = fn(*inputs)
                outputs = list(result) if isinstance(result, (tuple, list)) else [result]
                del result
        finally:
            self.node_stack.pop()
            self.saved.running.pop()
        n_next = len(fn.next_functions)
        if len(outputs) != n_next:
            raise RuntimeError(
                f"Function {fn.name()} returned an incorrect number of gradients "
                f"(expected {n_next}, got {len(outputs)})"
            )
        self._validate(fn.next_functions, outputs)
        return outputs, unpacked

    @staticmethod
    def _validate(edges, grads: list) -> None:
        for i, (nxt, nr) in enumerate(edges):
            g = grads[i]
            if nxt is None or g is None:
                continue
            meta = nxt._input_metadata[nr]
            if tuple(g.shape) != tuple(meta.shape):
                try:
                    g = g.sum_to_size(meta.shape)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"Function returned an invalid gradient at index {i} - got {list(grads[i].shape)} "
                        f"but expected shape compatible with {list(meta.shape)}"
                    ) from exc
            if g.dtype != meta.dtype:
                g = g.to(meta.dtype)
            if g.device != meta.device:
                g = g.to(meta.device)
            grads[i] = g
            del g

    def _call_python_node(self, fn, inputs: list) -> list:
        """``PyNode::apply``: materialize undefined grads, call backward, keep tensor slots."""
        if getattr(fn, "materialize_grads", True):
            meta = fn._input_metadata
            for i, g in enumerate(inputs):
                if g is None:
                    m = meta[i]
                    inputs[i] = torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        result = fn.apply(*inputs)
        del inputs
        if not isinstance(result, tuple):
            result = (result,)
        is_tensor = getattr(fn, "_batchfit_is_tensor_input", None)
        if is_tensor is not None:
            outputs = [r for r, keep in zip(result, is_tensor, strict=False) if keep]  # extra outputs follow
            extra = result[len(is_tensor):]
            if any(r is not None for r in extra):
                raise RuntimeError(
                    f"function {fn.name()} returned an incorrect number of gradients "
                    f"(expected {len(is_tensor)}, got {len(result)})"
                )
        else:
            outputs = list(result[: len(fn.next_functions)])
        return outputs

    # functions/accumulate_grad.h: AccumulateGrad::accumulateGrad
    def _accumulate_grad(self, fn, inputs: list) -> list:
        new_grad = inputs[0]
        inputs[0] = None
        variable = fn.variable
        if new_grad is None or not variable.requires_grad:
            return []
        grad = variable.grad
        if grad is None:
            if (
                not torch.is_grad_enabled()
                and not new_grad.is_sparse
                and self._use_count(new_grad) <= 1
                and _obeys_layout_contract(new_grad, variable)
            ):
                variable.grad = new_grad.detach()
            else:
                variable.grad = _clone_obey_contract(new_grad, variable)
        elif not torch.is_grad_enabled():
            grad.add_(new_grad)
        else:
            variable.grad = grad + new_grad
        del grad, new_grad
        for hook in list((getattr(variable, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(variable)
        return []

    def _use_count(self, t: torch.Tensor) -> int:
        # Our references: the caller's local and getrefcount's argument
        # (``_refcount_baseline`` measures the same call shape).
        return sys.getrefcount(t) - self._ref_base + 1

    def _can_accumulate_inplace(self, t: torch.Tensor) -> bool:
        if self.subclass_like or not is_non_overlapping_and_dense(t):
            return False
        storage = t.untyped_storage()
        # One reference from ``storage`` itself, one per tensor using it.
        return torch._C._storage_Use_Count(storage._cdata) - 1 == 1 and self._use_count(t) <= 2

    # input_buffer.cpp: InputBuffer::add / accumulate
    def _buffer_add(self, buffer: list, pos: int, var: torch.Tensor | None) -> None:
        if var is None:
            return
        old = buffer[pos]
        if old is None:
            buffer[pos] = var
            return
        buffer[pos] = None
        if torch.is_grad_enabled() or var.is_sparse:
            buffer[pos] = old + var
        elif self._can_accumulate_inplace(old):
            buffer[pos] = old.add_(var)
        else:
            buffer[pos] = old + var


def _obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """utils/grad_layout_contract.h: obeys_layout_contract."""
    if variable.is_sparse:
        return False
    if is_non_overlapping_and_dense(variable):
        for size, gs, vs in zip(grad.shape, grad.stride(), variable.stride(), strict=True):
            if size != 1:
                if gs != vs:
                    return False
            elif gs == 0:
                return False
        return True
    return grad.is_contiguous()


def _clone_obey_contract(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    """utils/grad_layout_contract.h: clone_obey_contract."""
    if is_non_overlapping_and_dense(variable):
        return grad.new_empty_strided(variable.shape, variable.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)
