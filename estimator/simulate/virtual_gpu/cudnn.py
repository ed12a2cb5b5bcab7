"""cuDNN convolution workspaces: what a real card allocates around each convolution.

PyTorch runs a CUDA convolution through cuDNN's v8 API (aten/src/ATen/native/
cudnn/Conv_v8.cpp). Per call, forward, backward-data and backward-weight alike:

- ``run_conv_plan`` allocates the plan's workspace through the caching
  allocator (``CUDACachingAllocator::get()->allocate(plan.getWorkspaceSize())``),
  after the output, and frees it when the call returns: a transient block
  that stays cached;
- ``try_configs`` / ``try_plans`` catch ``c10::OutOfMemoryError`` and go on
  with the next engine config: a workspace that cannot be had never fails
  the step, cuDNN takes a plan that needs less (allocator.SOFT_CATEGORIES);
- with ``torch.backends.cudnn.benchmark = True``, the first call of each
  shape (cache key: shapes, strides, dtype, layout, per thread) times the
  candidate plans in one shared buffer as large as the largest candidate's
  workspace (``get_plans_from_find``), then calls
  ``CUDACachingAllocator::emptyCache()`` (``conv_benchmark_empty_cache``,
  default true: "clear cached blocks as benchmark incurs significant memory
  consumption"), then runs the fastest plan with its own workspace. Later
  calls run the cached plan.

The plan cuDNN's heuristics or its timing pick cannot be known without a
card, so every workspace is the upper bound of the GEMM-family algorithms:
the explicit GEMM's im2col matrix (cuDNN's ``CUDNN_CONVOLUTION_FWD_ALGO_GEMM``
"needs significant memory workspace to store the matrix that holds the
input tensor data"): (C_in x prod(kernel)) x (N x prod(output spatial))
elements of the input dtype, the same for the backward-data (col2im) and
backward-weight passes. FFT algorithms can ask more; they are not modelled.

Convolutions that do not reach cuDNN allocate no workspace: depthwise ones
in contiguous layout outside fp16 (``_conv_depthwise2d``, ConvUtils.h
``use_cudnn_depthwise``), empty inputs, and bf16 before sm80
(``supportsBFloat16ConvolutionWithCuDNNv8``: those take the slow im2col
kernels, whose one-sample ``columns`` buffer is an ordinary allocation).

>>> x = torch.empty(8, 64, 32, 32, device="meta"); w = torch.empty(128, 64, 3, 3, device="meta")
>>> col_bytes(x, w, torch.empty(8, 128, 32, 32, device="meta"), transposed=False)  # 64*9 x 8*32*32 fp32
18874368
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from estimator.replay.allocator import EMPTY_CACHE

WORKSPACE = "workspace"
COLUMNS = "columns"  # the slow kernels' im2col buffer: a plain temporary, not one cuDNN can do without

ASSUMPTION = (
    "cuDNN convolution workspaces: one per convolution call (forward, backward-data, backward-weight), "
    "allocated after its output and freed when it returns (Conv_v8.cpp run_conv_plan); sized at the upper "
    "bound of the GEMM-family algorithms, the im2col matrix (C_in x kernel x N x output pixels), since the plan "
    "cuDNN picks is known only on the card; one it cannot allocate is skipped, as cuDNN falls back to a plan "
    "that needs less (try_configs)")
BENCHMARK_ASSUMPTION = (
    "cudnn.benchmark: the first call of each convolution shape times the candidate plans in one shared "
    "workspace (sized like the others), then empties the allocator's cache (conv_benchmark_empty_cache), "
    "then runs the chosen plan with its own workspace")


def col_bytes(inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, transposed: bool) -> int:
    """The im2col matrix of a convolution from ``inp`` to ``out``: the explicit GEMM's workspace."""
    kernel = math.prod(weight.shape[2:])
    n = inp.shape[0]
    if transposed:  # runs as the backward-data of the conv from out to inp
        cols = out.shape[1] * kernel * n * math.prod(inp.shape[2:])
    else:
        cols = inp.shape[1] * kernel * n * math.prod(out.shape[2:])
    return cols * inp.element_size()


CUDNN, SLOW, NATIVE = "cudnn", "slow", "native"


def conv_backend(inp: torch.Tensor, weight: torch.Tensor, groups: int, transposed: bool,
                 capability: tuple[int, int], thresholds: set[tuple[int, int]] | None = None) -> str:
    """Which kernels torch's backend choice (Convolution.cpp ``_select_conv_backend``) gives: cuDNN, the
    slow im2col kernels (bf16 before sm80) or a native one without a buffer (depthwise); the compute
    capabilities the answer turned on are added to ``thresholds``."""
    seen = thresholds if thresholds is not None else set()
    if inp.numel() == 0:
        return NATIVE
    channels = inp.shape[1]
    depthwise = not transposed and groups > 1 and groups == channels and weight.shape[0] % channels == 0
    if inp.dtype == torch.bfloat16:
        seen.add((8, 0))
        if capability < (8, 0):
            return NATIVE if depthwise else SLOW
    if depthwise:
        channels_last = inp.dim() == 4 and inp.is_contiguous(memory_format=torch.channels_last) \
            and not inp.is_contiguous()
        # use_cudnn_depthwise: always in channels_last; else fp16 4-D with >= 32 channels on sm70+ (its
        # workload table can still refuse: counting a workspace there is the upper bound)
        if channels_last:
            return CUDNN
        if inp.dtype == torch.float16 and inp.dim() == 4 and channels >= 32:
            seen.add((7, 0))
            return CUDNN if capability >= (7, 0) else NATIVE
        return NATIVE
    return CUDNN


@dataclass
class ConvWorkspaces:
    """What each convolution call allocates besides its outputs, as (kind, bytes) actions in order."""

    capability: tuple[int, int]
    benchmark: bool = False
    searched: set[tuple] = field(default_factory=set)  # benchmark cache keys already timed
    thresholds: set[tuple[int, int]] = field(default_factory=set)  # capabilities the choices turned on
    calls: int = 0

    def actions(self, name: str, args: tuple[Any, ...], out: Any, thread: str) -> list[tuple[str, int]]:
        if name == "convolution":
            inp, weight, transposed, groups = args[0], args[1], bool(args[6]), int(args[8])
            geometry = tuple(tuple(a) for a in args[3:6])  # stride, padding, dilation
            passes = [("forward", inp, out)]
        elif name == "convolution_backward":
            grad_out, inp, weight, transposed, groups, mask = args[0], args[1], args[2], bool(args[7]), \
                int(args[9]), args[10]
            geometry = tuple(tuple(a) for a in args[4:7])
            passes = [(d, inp, grad_out) for d, wanted in (("data", mask[0]), ("weight", mask[1])) if wanted]
        else:
            return []
        if not isinstance(inp, torch.Tensor):
            return []
        backend = conv_backend(inp, weight, groups, transposed, self.capability, self.thresholds)
        if backend == SLOW:
            # ConvolutionMM2d.cu: one sample's columns, (C_in x kernel) x output pixels, reused over the
            # batch; the backward shares one buffer between its data and weight passes
            pointwise = all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in geometry[0]) \
                and all(p == 0 for p in geometry[1])
            if not passes or (name == "convolution" and pointwise):  # the forward's requires_columns
                return []
            return [(COLUMNS, col_bytes(inp, weight, passes[0][2], transposed) // inp.shape[0])]
        if backend != CUDNN:
            return []
        done: list[tuple[str, int]] = []
        for direction, x, y in passes:
            nbytes = col_bytes(x, weight, y, transposed)
            self.calls += 1
            key = (thread, direction, tuple(x.shape), tuple(weight.shape), tuple(y.shape), geometry, x.dtype,
                   groups, transposed, x.is_contiguous())
            if self.benchmark and key not in self.searched:
                self.searched.add(key)
                done += [(WORKSPACE, nbytes), (EMPTY_CACHE, 0)]
            done.append((WORKSPACE, nbytes))
        return done
