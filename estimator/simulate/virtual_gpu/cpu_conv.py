"""The CPU target's convolutions: the im2col buffer of ATen's slow kernels, which a real CPU step allocates.

The CPU target exists for the CPU truth (estimator/testing/cpu_truth.py),
which runs with oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``),
so 2-D convolutions take ``_slow_conv2d_forward`` / ``_slow_conv2d_backward``
(aten/src/ATen/native/ConvolutionMM2d.cpp). Measured with torch.profiler
(Conv2d(3, 8, 3, padding=1), input 4 x 3 x 16 x 16): the forward allocates
``finput``, the whole batch's columns, B x (C_in x kH x kW) x (H_out x W_out)
(110,592 B), before its output and frees it on return; the backward
allocates a buffer of the same shape after its outputs, and a contiguous
copy of ``grad_output`` when that is not contiguous. "Contiguous" is in the
memory format the kernel works in: channels-last when the input or the weight
suggests it (``thnn_conv_use_channels_last``, aten/src/ATen/native/ConvUtils.h;
Keras's torch backend hands convolutions channels-last tensors), else the
default. A fake kernel makes
only the outputs, so the recorder adds these as transient allocations. Only
when the kernel needs columns (``requires_columns``: not a 1 x 1 kernel of
stride 1 without padding), for ungrouped, untransposed 2-D convolutions; the
others' buffers are not modelled.
"""

from __future__ import annotations

from typing import Any

import torch

from estimator.simulate.virtual_gpu.cudnn import COLUMNS, col_bytes


def _memory_format(inp: Any, weight: Any) -> torch.memory_format:
    """``thnn_conv_use_channels_last``: channels-last when either tensor suggests it (4-D, CPU)."""
    from torch._prims_common import suggest_memory_format

    cl = torch.channels_last
    if any(isinstance(t, torch.Tensor) and t.dim() == 4 and suggest_memory_format(t) == cl for t in (inp, weight)):
        return cl
    return torch.contiguous_format


class CpuConvColumns:
    """The recorder's ``convs`` on the CPU target (the interface of ``cudnn.ConvWorkspaces``)."""

    def __init__(self) -> None:
        self.thresholds: set[tuple[int, int]] = set()
        self.calls = 0

    def actions(self, name: str, args: tuple[Any, ...], out: Any, thread: str) -> list[tuple[str, int]]:
        if name == "convolution":
            inp, weight, geometry, transposed, groups, y = args[0], args[1], args[3:5], args[6], args[8], out
            extra = 0
        elif name == "convolution_backward":
            grad_out, inp, weight = args[0], args[1], args[2]
            geometry, transposed, groups, y = args[4:6], args[7], args[9], grad_out
            fmt = _memory_format(inp, weight)
            extra = 0 if grad_out.is_contiguous(memory_format=fmt) else grad_out.numel() * grad_out.element_size()
        else:
            return []
        if not isinstance(inp, torch.Tensor) or inp.dim() != 4 or transposed or int(groups) != 1:
            return []
        stride, padding = (tuple(g) for g in geometry)
        requires_columns = any(k != 1 for k in weight.shape[2:]) or any(s != 1 for s in stride) or any(
            p != 0 for p in padding)
        if not requires_columns:
            return []
        self.calls += 1
        return [(COLUMNS, col_bytes(inp, weight, y, False) + extra)]
