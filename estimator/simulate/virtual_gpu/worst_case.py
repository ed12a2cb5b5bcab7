"""Upper bounds for data-dependent ops, for models whose shapes follow their data.

Detection models keep the boxes that pass thresholds and NMS: on a real GPU
how many survive depends on the weights and the image. Without data we take
the largest possible size: every mask element true, NMS keeps every box.
The memory this predicts is an upper bound, so a batch it calls safe is.
``.item()`` in the forward returns 0 (a random choice's first option, a
count of zero overflowed values); the report lists the policy.

``WorstCase`` sits in the virtual GPU's dispatch mode, above the fake
mode, so the tensors it makes are fake too.
"""

from __future__ import annotations

from collections.abc import Callable
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


class WorstCase:
    """Largest sizes for data-dependent ops, tightened by counting nonzeros where they are known.

    A mask built as ``zeros_like(x)`` then ``mask[idx] = 1`` has at most
    ``len(idx)`` nonzeros (how torchvision's detection samplers pick 512
    proposals); ``a | b`` at most the sum, ``a & b`` at most the smaller.
    Every other mask may be all true.
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        self.bounds: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> most nonzeros it can hold
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

    def bound(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 1
        return min(self.bounds.get(t, t.numel()), t.numel())

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
        """Track nonzero bounds through the ops that build masks."""
        if not isinstance(out, torch.Tensor):
            return
        if func in _ZEROS:
            self.bounds[out] = 0
        elif func in (aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill_.Scalar):
            if args[-1] == 0 or kwargs.get("fill_value") == 0:
                self.bounds[out] = 0
            else:
                self.bounds.pop(out, None)
        elif func in _INDEX_PUTS:
            written = args[1][0].shape[0] if args[1] and isinstance(args[1][0], torch.Tensor) else out.numel()
            self.bounds[out] = min(out.numel(), self.bound(args[0]) + written)
        elif func in _COPIES and isinstance(args[0], torch.Tensor) and args[0] in self.bounds:
            self.bounds[out] = self.bound(args[0])
        elif func in _UNIONS and len(args) >= 2 and all(isinstance(a, torch.Tensor) and a in self.bounds
                                                        for a in args[:2]):
            self.bounds[out] = min(out.numel(), self.bound(args[0]) + self.bound(args[1]))
        elif func in _INTERSECTIONS and len(args) >= 2:
            known = [self.bound(a) for a in args[:2] if isinstance(a, torch.Tensor) and a in self.bounds]
            if known:
                self.bounds[out] = min(min(known), out.numel())
        elif out in self.bounds and func._schema.is_mutable:
            del self.bounds[out]  # written in place by something we do not follow


def _has_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices)
