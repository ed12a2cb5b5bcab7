"""torch's stride helpers (``torch._prims_common``) for plain int sizes and strides, without their symbolic checks.

torch's own take symbolic sizes too, so each call goes through ``sym_max``, ``guard_or_false`` and a sort by a
comparison class written for unbacked symbols: 5-10 µs a call, several times for each op a fake-mode shortcut
makes (``fake_mode.py``) and each gradient the engine accumulates (``engine.py``); ``storage_length`` is
``compute_required_storage_length``'s. These give the same answers
for int sizes and strides (tests/test_fast_paths.py compares them over shapes, permutations, slices, expanded and
empty tensors); the callers give them nothing else (the shortcuts take no symbolic sizes), and
``non_overlapping_and_dense`` hands a tensor with a zero stride, symbolic sizes or another layout to torch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _torch_dense


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """``make_contiguous_strides_for(shape)``: each dimension's stride the product of the later sizes, a size 0
    counted as 1."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n if n > 1 else 1
    return tuple(reversed(strides))


def channels_last_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """``make_channels_last_strides_for`` of a 4-d ``shape``: channels fastest, then width, height and batch (a
    size 0 counted as 0, as torch's does)."""
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def storage_length(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """``compute_required_storage_length(shape, stride, offset)``: the elements a storage needs to hold a tensor
    of that geometry (0 for an empty one)."""
    if 0 in shape:
        return 0
    return offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense_or_false(t)``: some order of ``t``'s dimensions is contiguous. Worked out
    here for a strided tensor whose strides are all positive ints (torch's sort by stride is then a plain one, ties
    kept in order); torch's answer for anything else (a zero stride, symbolic sizes, a sparse layout)."""
    stride = t.stride()
    if t.layout != torch.strided or not all(type(s) is int and s > 0 for s in stride):
        return _torch_dense(t)
    shape = t.shape
    total = 1
    for n in shape:
        total *= n
    if total < 2:
        return True
    if len(shape) == 1:
        return stride[0] == 1
    expected = 1
    for st, n in sorted(zip(stride, shape, strict=True), key=lambda p: p[0]):
        if n == 1:
            continue
        if st != expected:
            return False
        expected *= n
    return True
