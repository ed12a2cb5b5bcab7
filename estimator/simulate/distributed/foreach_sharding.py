"""DTensor's sharding of a foreach op, worked out once per distinct element.

FSDP2's optimizer step runs foreach ops (Adam's ``_foreach_lerp_``,
``_foreach_mul_``, ...) over every parameter shard, each a DTensor. DTensor
(torch 2.14, ``single_dim_strategy.expanded_foreach_strategy``) expands each
element's single-dimension strategy over the mesh one by one, about 1 ms an
element on this host, and caches the answer for the whole list only
(``ShardingPropagator.propagate_op_sharding``): every shallow simulation of
another depth misses it, and the elements of a model whose blocks repeat are
the same few again and again. ``memoized`` runs the same expansion once per
distinct element, keyed by what torch's own per-element cache keys the
element's strategy function by (its per-element schema and output meta),
and the mesh. A strategy depends on nothing else.

As torch's whole-list cache does, an answer is kept for the process and
handed to later simulations (whose meshes are equal by value): strategies
are read, not changed, except where an input is a ``_StridedShard``
(``_propagate_use_strided_shard_flag`` sets a flag on the outputs), which is
not memoized. Any other schema goes to torch's own function unchanged.
tests/test_fast_paths.py compares the traces with and without it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

# imported where a distributed simulation starts (VirtualGPU): torch's DTensor is loaded by then
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _resolve_foreach_elementwise_overload
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_leaves, tree_map_only

# (foreach op, per-element schema, output meta, mesh) -> the element's strategy; cleared when it grows past the bound
_MEMO: dict[Hashable, Any] = {}
MAX_ENTRIES = 65536
_FOREACH = ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")


def memoized(expand: Callable[..., Any]) -> Callable[..., Any]:
    """``_expand_single_dim_strategy_to_mesh`` (torch's, passed as ``expand``) whose foreach strategies expand
    each distinct element once."""
    def expand_memoized(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> Any:
        lists = [arg for arg in op_schema.args_schema if isinstance(arg, TupleStrategy)]
        if not lists or not op_schema.op.name().startswith(_FOREACH) or len({len(t.children) for t in lists}) > 1:
            return expand(mesh, op_schema, strategy_info, output_tensor_meta)  # torch's own (and its errors)

        def foreach(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            children = []
            for index in range(len(lists[0].children)):
                schema, meta = _element(op_schema, output_tensor_meta, index)
                key = _key(op, schema, meta, mesh)
                child = _MEMO.get(key) if key is not None else None
                if child is None:
                    # torch's per-element path: the element's schema has no lists, so ``expand`` gives its strategy
                    child = expand(mesh, schema, strategy_info, meta)(op, schema.args_meta, schema.kwargs_meta)
                    if key is not None:
                        if len(_MEMO) >= MAX_ENTRIES:
                            _MEMO.clear()
                        _MEMO[key] = child
                children.append(child)
            return TupleStrategy(children=children)

        return foreach

    return expand_memoized


def _element(op_schema: Any, output_tensor_meta: Any, index: int) -> tuple[Any, Any]:
    """The schema and output meta of element ``index`` of a foreach op, as torch's ``_translate_list_op_schema``
    makes them (torch 2.14, single_dim_strategy.py)."""
    args, kwargs = tree_map_only(TupleStrategy, lambda x: x.children[index],
                                 (op_schema.args_schema, op_schema.kwargs_schema),
                                 is_leaf=lambda x: isinstance(x, TupleStrategy))
    meta = output_tensor_meta[index] if output_tensor_meta is not None else None
    op = _resolve_foreach_elementwise_overload(op_schema.op) or op_schema.op
    return OpSchema(op, args_schema=tuple(args), kwargs_schema=op_schema.kwargs_schema), meta


def _key(op: Any, schema: Any, meta: Any, mesh: Any) -> Hashable | None:
    """The memo's key of an element, None where it is not kept: an input placed as a ``_StridedShard`` (its
    strategy's outputs get a flag set after it is made) or a schema that does not hash (symbolic sizes)."""
    for arg in tree_leaves((schema.args_schema, schema.kwargs_schema)):
        if isinstance(arg, OpStrategy) and any(isinstance(p, _StridedShard) for s in arg.strategies
                                               for p in s.output_spec.placements):
            return None
    key = (op, schema, meta, mesh)
    try:
        hash(key)
    except TypeError:
        return None
    return key
