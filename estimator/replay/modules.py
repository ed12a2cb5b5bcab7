"""The bytes live at a step's allocated peak, per module (``batchfit estimate --by-module``).

>>> mb = breakdown_by_module(trace, get_gpu("A100-80GB"), meta_model)      # doctest: +SKIP
>>> mb.tree()["layer1"][Category.ACTIVATION]    # layer1 and all its submodules
>>> print(format_table(mb, top=5))

What a row holds, and where it comes from:

- **Bytes are allocator block sizes**, the same as the report's ``Breakdown``:
  the trace is replayed through the caching-allocator model exactly as
  ``report_from_trace`` replays it (capped at the card's usable memory, or
  without a cap when the step does not fit there), and each allocation live
  at the replay's allocated peak counts with the block it got. A block is
  the request rounded up to 512 B, or larger when the allocator hands out a
  cached or fresh block it does not split (a large-pool remainder of 1 MiB or
  less stays with the block). So the model row is the report's breakdown to
  the byte; in requested bytes it would not be (``module_bytes`` without
  ``sizes`` counts those).
- **Activations, gradients, temporaries** are attributed by the trace: the
  recorder names the module running when an allocation was made (in the
  backward, the module whose forward created the autograd node). What runs
  outside every module (the loss, the optimizer step, setup), what the
  model's root module computes itself, and what the backward engine does
  between nodes (summing a broadcast bias's gradient to the bias's shape)
  count in the model row only.
- **Parameters and buffers** are allocated when the model is materialized,
  outside any forward, so the trace names no module for them (their
  ``module`` is ``""``). Given the model, ``parameter_owners`` names each
  parameter and buffer allocation by its owner: the virtual GPU materializes
  with ``Module._apply`` (children first, then a module's own parameters, then
  its buffers), and the trace's parameter allocations are matched, size by
  size, to the model's parameters in that order, under the names
  ``named_parameters()`` gives them (tied weights once, under their first
  name, as ``fvcore.nn.parameter_count`` counts them). The bytes are then the
  blocks the replay gave those very allocations, not ``numel * element_size``
  from ``fvcore.nn.parameter_count``: the count times the dtype size misses
  the allocator's rounding (for gpt2, 0.8 MB of unsplit blocks), and the
  trace's allocations carry the dtype the recipe cast to. fvcore's counts go
  in the ``#parameters`` column, as its own tables show them.
- **Optimizer state** is created in the optimizer step, outside any module,
  and inputs before the forward: they count in the model row only. The table
  has no column for them, nor for buffers and workspaces (the trace names the
  module whose op first needed a cuBLAS handle or ran a convolution): their
  totals go under it (``not_in_columns``).

A row counts its submodules, as fvcore's tables do: ``layer1`` includes
``layer1.0.conv1``. The model row (path ``""``) is every byte live at the peak.

The trace side needs no torch; ``parameter_counts`` and ``format_table`` import fvcore.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from estimator.gpus import GPU
from estimator.replay.allocator import AllocatorConfig, replay_sized
from estimator.trace import SOFT_CATEGORIES, Category, Trace

# The table's byte columns, in order.
COLUMNS: tuple[tuple[str, Category], ...] = (
    ("parameters", Category.PARAMETER),
    ("gradients", Category.GRADIENT),
    ("activations", Category.ACTIVATION),
    ("temporaries", Category.TEMPORARY),
)
# Categories the table has no column for: their totals go under it.
_ELSEWHERE: tuple[tuple[str, Category], ...] = (
    ("optimizer state", Category.OPTIMIZER_STATE),
    ("inputs", Category.INPUT),
    ("buffers", Category.BUFFER),
    ("workspace", Category.WORKSPACE),
    ("cuDNN workspace", Category.CONV_WORKSPACE),
)


@dataclass(frozen=True)
class ModuleBreakdown:
    """The bytes live at one allocated peak, per module path and category.

    ``own``: what each module holds itself, not counting its submodules
    (path ``""``: outside every module, or in the root module's own code);
    ``total``: every byte live at the peak, by category (the report's
    ``Breakdown`` before it folds the workspaces together); ``counts``:
    ``fvcore.nn.parameter_count`` per module path, ``""`` the model;
    ``order``: module paths in the model's order (rows follow it).
    """

    own: dict[str, dict[str, int]]
    total: dict[str, int]
    peak_event: int
    counts: dict[str, int] = field(default_factory=dict)
    order: tuple[str, ...] = ()
    unattributed_parameters: int = 0  # bytes of live parameter allocations no model parameter matched (model row)

    def tree(self) -> dict[str, dict[str, int]]:
        """Per module path, its bytes and its submodules' by category (fvcore's rows); ``""`` is ``total``."""
        rows: dict[str, dict[str, int]] = {"": dict(self.total)}
        for path in self._paths():
            cats = self.own.get(path)
            if not path or not cats:
                continue
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                row = rows.setdefault(".".join(parts[:i]), {})
                for cat, n in cats.items():
                    row[cat] = row.get(cat, 0) + n
        rank = {p: i for i, p in enumerate(self.order)}
        return dict(sorted(rows.items(), key=lambda kv: (kv[0] != "", rank.get(kv[0], len(rank)))))

    def top(self, category: str, n: int = 5) -> list[tuple[str, int]]:
        """The ``n`` modules that hold the most bytes of ``category`` themselves (not their submodules')."""
        held = [(p, cats.get(category, 0)) for p, cats in self.own.items() if p and cats.get(category, 0)]
        rank = {p: i for i, p in enumerate(self.order)}
        held.sort(key=lambda pn: (-pn[1], rank.get(pn[0], len(rank))))
        return held[:n]

    def _paths(self) -> list[str]:
        known = set(self.order)
        return list(self.order) + [p for p in self.own if p not in known]

    def as_json(self, top: int = 5) -> dict[str, Any]:
        """JSON data: the rows (every module with bytes at the peak; ``""`` the model, as fvcore keys it),
        fvcore's counts and the top modules."""
        return {
            "modules": {p: {str(c): n for c, n in cats.items() if n} for p, cats in self.tree().items()},
            "parameter_count": dict(self.counts),
            "top": {str(c): [[p, n] for p, n in self.top(c, top)] for c in (Category.ACTIVATION, Category.PARAMETER)},
        }


def live_at(trace: Trace, event: int) -> set[int]:
    """The allocations live just after ``trace.events[event]``."""
    live: set[int] = set()
    for is_alloc, k in trace.events[: event + 1]:
        if is_alloc:
            live.add(k)
        else:
            live.discard(k)
    return live


def peak_blocks(trace: Trace, gpu: GPU | None, allocator: AllocatorConfig | None = None,
                reserve_bytes: int = 0) -> tuple[int, dict[int, int]]:
    """(event index of the allocated peak, block bytes of each allocation live there), replayed as
    ``report_from_trace`` replays the trace for ``gpu`` (requested bytes for the CPU, ``gpu=None``).

    One replay: each allocation is its own "category" to ``replay_sized``, so its
    ``breakdown_at_peak`` is per allocation. cuDNN workspaces (which a replay may
    skip) and empty_cache calls keep their category, so the replay runs as the
    report's does; at most one of them is live at a time (each is freed as its
    call returns), so their block is the one allocation of that category live at the peak.
    """
    if gpu is None:
        _, idx = trace.live_peak()
        return idx, {k: trace.allocations[k].nbytes for k in live_at(trace, idx)}
    allocator = allocator or AllocatorConfig()
    special = SOFT_CATEGORIES | {Category.EMPTY_CACHE}
    labels = [a.category if a.category in special else f"#{k}" for k, a in enumerate(trace.allocations)]
    sized = trace.events, trace.sizes(gpu.cublas_workspace_bytes), labels
    streams = trace.streams()
    result = replay_sized(*sized, replace(allocator, capacity=gpu.usable_bytes(reserve_bytes)), timelines=False,
                          streams=streams)
    if not result.fits:
        result = replay_sized(*sized, replace(allocator, capacity=None), timelines=False, streams=streams)
    blocks = {int(label[1:]): n for label, n in result.breakdown_at_peak.items() if label.startswith("#")}
    soft = {label: n for label, n in result.breakdown_at_peak.items() if not label.startswith("#")}
    if soft:
        for k in sorted(live_at(trace, result.peak_event)):
            cat = trace.allocations[k].category
            if cat in soft:
                blocks[k] = soft.pop(cat)
    return result.peak_event, blocks


def module_bytes(trace: Trace, peak_event: int, sizes: Mapping[int, int] | None = None, *,
                 names: Mapping[int, str] | None = None, root: str = "") -> ModuleBreakdown:
    """The allocations live at ``peak_event``, per module and category.

    ``sizes``: each live allocation's bytes (``peak_blocks``' blocks; an allocation
    missing from it was skipped by the replay); requested bytes without it.
    ``names``: module paths that replace the trace's for some allocations
    (``parameter_owners``). ``root``: the name the recorder gave the model itself
    (its class name), counted as ``""``.
    """
    own: dict[str, dict[str, int]] = {}
    total: dict[str, int] = {}
    names = names or {}
    for k in sorted(live_at(trace, peak_event)):
        a = trace.allocations[k]
        if sizes is None:
            n = a.nbytes
        elif k in sizes:
            n = sizes[k]
        else:
            continue
        path = names.get(k, a.module)
        if path == root:
            path = ""
        cats = own.setdefault(path, {})
        cats[a.category] = cats.get(a.category, 0) + n
        total[a.category] = total.get(a.category, 0) + n
    return ModuleBreakdown(own=own, total=total, peak_event=peak_event)


def _storage_bytes(t: Any) -> int:
    """What ``torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)`` allocates (the virtual GPU's materialize)."""
    if t.numel() == 0:
        return 0
    return int((1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride(), strict=True))) * t.element_size())


def parameter_owners(trace: Trace, model: Any) -> dict[int, str]:
    """The owning module path of each parameter and buffer allocation of ``trace``, from ``model``
    (the meta model the trace was recorded from, in the recipe's dtype).

    The trace's parameter (buffer) allocations, in the order they were made, are
    matched to the model's parameters (buffers) of the same size in the order
    ``Module._apply`` materializes them; a parameter is named as
    ``named_parameters()`` names it (tied weights once, by their first owner).
    Allocations nothing matches are left out.
    """
    param_names = {id(p): name for name, p in model.named_parameters()}
    buffer_names = {id(b): name for name, b in model.named_buffers()}
    queues: dict[tuple[str, int], deque[str]] = {}

    def visit(module: Any, prefix: str) -> None:  # Module._apply: children, own parameters, own buffers
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.")
        for cat, tensors, known in ((Category.PARAMETER, module._parameters, param_names),
                                    (Category.BUFFER, module._buffers, buffer_names)):
            for name, t in tensors.items():
                if t is not None and known.get(id(t)) == prefix + name:
                    queues.setdefault((cat, _storage_bytes(t)), deque()).append(prefix[:-1])

    visit(model, "")
    owners: dict[int, str] = {}
    for k, a in enumerate(trace.allocations):
        if a.category in (Category.PARAMETER, Category.BUFFER):
            queue = queues.get((a.category, a.nbytes))
            if queue:
                owners[k] = queue.popleft()
    return owners


def _fvcore() -> tuple[Any, Any]:
    """``fvcore.nn.parameter_count`` and ``fvcore.nn.print_model_statistics`` (its table helpers).
    Importing fvcore.nn jit-scripts its losses, and torch warns that torch.jit.script is deprecated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import parameter_count, print_model_statistics
    return parameter_count, print_model_statistics


def parameter_counts(model: Any) -> dict[str, int]:
    """``fvcore.nn.parameter_count`` per module path (``""`` the model), without its per-parameter keys;
    it runs on meta modules (it only reads shapes)."""
    counts = _fvcore()[0](model)
    modules = {name for name, _ in model.named_modules()}
    return {path: n for path, n in counts.items() if path in modules}


def breakdown_by_module(trace: Trace, gpu: GPU | None, model: Any = None, *,
                        allocator: AllocatorConfig | None = None, reserve_bytes: int = 0) -> ModuleBreakdown:
    """``module_bytes`` at the peak ``report_from_trace`` reports, in block bytes; with the meta ``model``
    the trace was recorded from (cast to the recipe's dtype), parameters and buffers by owner,
    fvcore's parameter counts, and the model's module order."""
    peak, blocks = peak_blocks(trace, gpu, allocator, reserve_bytes)
    if model is None:
        return module_bytes(trace, peak, blocks)
    owners = parameter_owners(trace, model)
    mb = module_bytes(trace, peak, blocks, names=owners, root=type(model).__name__)
    missing = sum(n for k, n in blocks.items()
                  if trace.allocations[k].category == Category.PARAMETER and k not in owners)
    order = tuple(name for name, _ in model.named_modules())
    return replace(mb, counts=parameter_counts(model), order=order, unattributed_parameters=missing)


def format_bytes(n: int) -> str:
    """Bytes in binary units, as fvcore's sizes (at most 2 decimals, zeros stripped): '44.66 MiB', '512 B'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def table_rows(mb: ModuleBreakdown, top: int = 5) -> list[str]:
    """The module paths the table shows: the ``top`` modules by activation bytes and by parameter bytes,
    and the modules they are in (so the tree reads from the model down); ``""`` first."""
    chosen = {p for p, _ in mb.top(Category.ACTIVATION, top)} | {p for p, _ in mb.top(Category.PARAMETER, top)}
    shown = {""}
    for path in chosen:
        parts = path.split(".")
        shown.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return [p for p in mb.tree() if p in shown]


def format_table(mb: ModuleBreakdown, top: int = 5) -> str:
    """fvcore's model-statistics table (``fvcore.nn.flop_count_table``'s layout, its ``#parameters``
    sizes) of the ``table_rows``, with the bytes live at the peak per category in binary units."""
    fv = _fvcore()[1]
    tree = mb.tree()
    columns = (["#parameters"] if mb.counts else []) + [name for name, _ in COLUMNS]
    stats: dict[str, dict[str, str]] = {}
    for path in table_rows(mb, top):
        row = tree[path]
        cells = {"#parameters": fv._format_size(mb.counts[path]) if mb.counts.get(path) else ""} if mb.counts else {}
        for name, cat in COLUMNS:
            cells[name] = format_bytes(row[cat]) if row.get(cat) else ""
        stats[path] = cells
    depth = max(p.count(".") for p in stats) + 2
    return str(fv._model_stats_table(stats, max_depth=depth, stat_columns=columns))


def not_in_columns(mb: ModuleBreakdown) -> str:
    """The categories no module holds (optimizer state, inputs, ...), as one line; '' when there are none."""
    parts = [f"{name} {format_bytes(mb.total[cat])}" for name, cat in _ELSEWHERE if mb.total.get(cat)]
    return ", ".join(parts)
