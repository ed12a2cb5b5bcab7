"""Upper bounds for data-dependent ops, for models whose shapes follow their data.

Detection models keep the boxes that pass thresholds and NMS: on a real GPU
how many survive depends on the weights and the image. Without data we take
the largest possible size: every mask element true, NMS keeps every box.
The memory this predicts is an upper bound, so a batch it calls safe is.
``.item()`` in the forward returns 0 (a random choice's first option, a
count of zero overflowed values) and ``bool()`` False, except in an
``assert``: the model's own check of its data or activations (ProphetNet's
"shifted_input_ids has only positive values", I-BERT's "no NaN in the
activation") holds, as it does in a real run that trains (one where it
failed would stop); and except a count of a mask's true elements (its
``sum``, the ``max`` of its sums), which reads its largest, the mask all
true as above (BLT's entropy patcher: every byte starts a patch, its most
patches). The report lists the policy.

``WorstCase`` sits in the virtual GPU's dispatch mode, above the fake
mode, so the tensors it makes are fake too.
"""

from __future__ import annotations

import dis
import os
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
_MASK_DTYPES = (torch.bool, torch.uint8)
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.zero_.default}
_COPIES = {aten._to_copy.default, aten.clone.default, aten.detach.default, aten.view.default, aten.alias.default,
           aten._unsafe_view.default, aten.reshape.default, aten.lift_fresh.default}
_UNIONS = {aten.bitwise_or.Tensor, aten.logical_or.default, aten.add.Tensor}
_INTERSECTIONS = {aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor}
_INDEX_PUTS = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_NOTS = {aten.bitwise_not.default, aten.logical_not.default}
_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.count_nonzero.default, aten.count_nonzero.dim_IntList}
_MAXES = {aten.max.default, aten.amax.default, aten.max.dim}


class WorstCase:
    """Largest sizes for data-dependent ops, tightened by counting nonzeros where they are known.

    A mask built as ``zeros_like(x)`` then ``mask[idx] = 1`` has at most
    ``len(idx)`` nonzeros (how torchvision's detection samplers pick 512
    proposals); ``a | b`` at most the sum, ``a & b`` at most the smaller;
    ``cat([m, ~m])`` exactly ``m.numel()`` (BLT's patcher pads each row's patch
    starts so). A bound holds until the tensor is written again (its version
    counter). Comparisons of the placeholder batch (zeros ids) say nothing:
    those are not the data. Every other mask may be all true.
    A mask's count (``m.sum(dim)``, its ``max``) holds at most its nonzeros,
    at most the reduced elements, which ``.item()`` reads.
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        self.bounds: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (most nonzeros it can hold, version)
        self._before_put = 0  # the bound of the tensor an index_put_ writes, read before the write
        self.complements: WeakIdKeyDictionary = WeakIdKeyDictionary()  # ~m -> m
        self.counts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a count of a mask's nonzeros -> its largest
        self._where = where  # the module running now (the Recorder's), for ``used``
        self.used: dict[str, list[str]] = {}  # the data-dependent ops met, each with the modules that ran them

    def note(self, op: str) -> None:
        """Remember that ``op`` met the policy in the module running now."""
        module = (self._where() if self._where is not None else "") or "<top>"
        modules = self.used.setdefault(op, [])
        if module not in modules:
            modules.append(module)

    def summary(self, most: int = 3) -> str:
        """``aten.nonzero in roi_heads, rpn; .item() in model.gate`` (at most ``most`` modules per op)."""
        parts = []
        for op, modules in self.used.items():
            more = f" and {len(modules) - most} more" if len(modules) > most else ""
            parts.append(f"{op} in {', '.join(modules[:most])}{more}")
        return "; ".join(parts)

    def read(self, t: torch.Tensor) -> Any:
        """The value ``.item()`` / ``bool()`` of ``t`` reads: True (1) in an ``assert``, else False (0)."""
        if _asserting():
            self.note("assert (holds)")
            return True if t.dtype == torch.bool else 1
        if t in self.counts and t.numel() == 1:
            self.note(".item() (a mask's count: all true)")
            return self.counts[t]
        self.note(".item()" if t.dtype != torch.bool else "bool()")
        return False if t.dtype == torch.bool else 0

    def _set(self, t: torch.Tensor, bound: int, written: bool = False) -> None:
        """Remember ``t``'s bound as of its version: any later write to it, through a view too (views share the
        version counter), makes the bound unknown again (``tasks``' ``mask[:, :n] = 1``). ``written``: ``t`` is
        what the op running now writes in place, whose version autograd's ADInplaceOrView kernel bumps once
        after the op returns (above this dispatch mode)."""
        self.bounds[t] = (bound, version(t) + (1 if written else 0))

    def _known(self, t: Any) -> int | None:
        """``t``'s bound if it is known and ``t`` was not written since, else None."""
        entry = self.bounds.get(t) if isinstance(t, torch.Tensor) and self.bounds else None
        return entry[0] if entry is not None and entry[1] == version(t) else None

    def bound(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 1
        known = self._known(t)
        return t.numel() if known is None else min(known, t.numel())

    def _rows(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.empty((self.bound(mask), mask.dim()), dtype=torch.long, device=mask.device)  # (N, ndim)

    def _longs(self, indices) -> list:
        out: list = []
        for idx in indices:
            if isinstance(idx, torch.Tensor) and idx.dtype in _MASK_DTYPES:
                out.extend(self._rows(idx).unbind(1))
            else:
                out.append(idx)
        return out

    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        """The op's result under the worst-case policy, or NotImplemented to run it as is."""
        if func in _INDEX_PUTS:  # the written tensor's bound before the write bumps its version
            self._before_put = self.bound(args[0])
        out = self._dispatch(func, args, kwargs)
        if out is not NotImplemented:
            self.note(f"{getattr(func, 'namespace', 'aten')}.{func.__name__.split('.')[0]}")
        return out

    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if func is aten.nonzero.default:
            return self._rows(args[0])
        if func is aten.masked_select.default:
            x, mask = args
            return torch.empty(self.bound(mask), dtype=x.dtype, device=x.device)
        if func is aten.index.Tensor and _has_mask(args[1]):
            return aten.index.Tensor(args[0], self._longs(args[1]))
        if func in _INDEX_PUTS and _has_mask(args[1]):
            return func(args[0], self._longs(args[1]), *args[2:], **kwargs)
        if getattr(func, "namespace", "") == "torchvision" and func.__name__.startswith("nms"):
            boxes = args[0]
            return torch.empty(boxes.shape[0], dtype=torch.long, device=boxes.device)  # keeps every box
        return NotImplemented

    def after(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Track nonzero bounds through the ops that build masks, and the counts taken of them."""
        if func in _MAXES and isinstance(out, tuple):
            out = out[0]  # max.dim: (values, indices)
        if not isinstance(out, torch.Tensor):
            return
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and func in _SUMS and source.dtype in _MASK_DTYPES:
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = range(source.dim()) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
            reduced = 1
            for d in dims:
                reduced *= source.shape[d]
            self.counts[out] = min(self.bound(source), reduced)
            return
        if source is not None and func in _MAXES and source in self.counts:
            self.counts[out] = self.counts[source]
            return
        if func in _NOTS and source is not None and source.dtype == torch.bool:
            self.complements[out] = source
        if func is aten.cat.default and out.dtype in _MASK_DTYPES:
            # each ~m paired with one occurrence of its m holds m.numel() trues between them; every part left
            # unpaired adds its own bound (cat([m, ~m, m]): numel + bound(m))
            parts = list(args[0])
            unpaired = list(range(len(parts)))
            total = 0
            for i, p in enumerate(parts):
                source = self.complements.get(p) if i in unpaired else None
                j = next((j for j in unpaired if j != i and parts[j] is source), None)
                if j is not None:
                    unpaired.remove(i)
                    unpaired.remove(j)
                    total += p.numel()
            total += sum(self.bound(parts[i]) for i in unpaired)
            if total < out.numel():
                self._set(out, total)
            return
        in_place = func._schema.is_mutable
        if func in _ZEROS:
            self._set(out, 0, in_place)
        elif func in (aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill_.Scalar):
            if args[-1] == 0 or kwargs.get("fill_value") == 0:
                self._set(out, 0, in_place)
            else:
                self.bounds.pop(out, None)
        elif func in _INDEX_PUTS:
            written = args[1][0].shape[0] if args[1] and isinstance(args[1][0], torch.Tensor) else out.numel()
            before = self._before_put if in_place else self.bound(args[0])
            self._set(out, min(out.numel(), before + written), in_place)
        elif func in _COPIES and self._known(args[0]) is not None:
            self._set(out, self.bound(args[0]))
        elif func in _UNIONS and len(args) >= 2 and all(self._known(a) is not None for a in args[:2]):
            self._set(out, min(out.numel(), self.bound(args[0]) + self.bound(args[1])))
        elif func in _INTERSECTIONS and len(args) >= 2:
            known = [k for k in (self._known(a) for a in args[:2]) if k is not None]
            if known:
                self._set(out, min(min(known), out.numel()))
        # a tensor written in place by an op not followed here: its version moved on, so its bound is unknown


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write to it or a view of it); -1 for an inference tensor,
    which has none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _has_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices)


# Frames that run between the model's code and the read: torch (dispatch, FakeTensor.tolist) and the virtual GPU.
_MACHINERY = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parent) + os.sep)


def _validation_codes() -> frozenset[CodeType]:
    from torch.distributions import Distribution

    return frozenset({Distribution.__init__.__code__, Distribution._validate_sample.__code__})


_DISTRIBUTION_VALIDATION = _validation_codes()


def validating_distribution() -> bool:
    """Whether the read is torch.distributions checking a distribution's arguments or a sample against its
    constraints (``Distribution.__init__``, ``_validate_sample``; on by default: ``validate_args`` None).

    On a real GPU that check reads the result (a sync) and raises when it fails; a run that trains passes it,
    so the simulation answers that it holds, under any policy, and the check's own ops (the constraint's mask of
    the argument's shape, its reduction) are recorded as on the card. Switching validation off instead
    (``Distribution.set_default_validate_args(False)``) would drop those allocations, which a real run makes.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_MACHINERY):
        if frame.f_code in _DISTRIBUTION_VALIDATION:
            return True
        frame = frame.f_back
    return False


def _asserting() -> bool:
    """Whether the innermost frame outside torch and the virtual GPU reads the value for an ``assert``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_MACHINERY):
        frame = frame.f_back
    return frame is not None and _asserts_at(frame.f_code, frame.f_lasti)


@lru_cache(maxsize=1024)
def _asserts_at(code: CodeType, offset: int) -> bool:
    """Whether the instruction at ``offset`` (``bool(t)``: a conditional jump; ``t.item()``: a call whose result
    a jump tests next) goes to ``LOAD_ASSERTION_ERROR`` when the value is false: ``assert cond, msg``."""
    ops = [i for i in dis.get_instructions(code) if i.opname != "TO_BOOL"]  # 3.13 tests truth in its own op
    at = next((n for n, i in enumerate(ops) if i.offset == offset), None)
    if at is not None and ops[at].opname.startswith("CALL") and at + 1 < len(ops):
        at += 1  # .item(): the value is what the next instruction tests
    if at is None or not ops[at].opname.startswith("POP_JUMP"):
        return False
    if ops[at].opname.endswith("IF_TRUE"):  # falls through when false
        on_false = ops[at + 1] if at + 1 < len(ops) else None
    elif ops[at].opname.endswith("IF_FALSE"):  # jumps when false
        on_false = next((i for i in ops if i.offset == ops[at].argval), None)
    else:
        return False
    return on_false is not None and on_false.opname == "LOAD_ASSERTION_ERROR"
