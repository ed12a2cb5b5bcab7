"""The fake-tensor mode of the virtual GPU: torch's FakeTensorMode with its shortcuts.

FakeTensorMode never initializes a device here (``torch.cuda.is_available()``
answers True inside the virtual GPU), bypasses its dispatch cache where a
cache hit would allocate differently, runs cuDNN's RNN ops with kernels of
their own (``cudnn_rnn.py``: torch has none that know their sizes), and
takes shortcuts past torch's Python fake kernels and its dispatch cache that
make a simulation several times faster: the outputs of the most frequent ops
(views, elementwise and in-place ops, casts, factories, convolutions, batch
norm, cross entropy, the optimizers' ``_foreach_*`` ops, lifted scalars) made
directly, cheaper cache keys, and a cache hit's outputs made without
``FakeTensor.__new__``'s argument checks. Each shortcut either gives exactly
torch's output or hands the call back to torch's path; each has a switch
(``Shortcuts``), and tests/test_fast_paths.py compares both paths op by op
and allocation by allocation.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _BypassDispatchCache,
    _is_plain_tensor,
)
from torch.utils._mode_utils import no_dispatch

from estimator.simulate.virtual_gpu.cudnn_rnn import FAKE_KERNELS as _CUDNN_RNN_KERNELS
from estimator.simulate.virtual_gpu.strides import channels_last_strides, contiguous_strides, storage_length
from estimator.simulate.virtual_gpu.strides import non_overlapping_and_dense as is_non_overlapping_and_dense

aten = torch.ops.aten

# torch._foreach_* ops whose i-th output has the i-th input's shape, dtype and layout.
_FOREACH_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "neg", "abs", "reciprocal", "exp",
    "sign", "maximum", "minimum", "clamp_min", "clamp_max", "zero", "copy",
})


@dataclass(frozen=True)
class Shortcuts:
    """Which shortcuts past torch's Python fake kernels ``FakeMode`` takes (all, unless a test compares).

    ``foreach``: the optimizers' elementwise ``_foreach_*`` ops; ``batch_norm``: cuDNN batch norm's
    outputs; ``cache_keys``: cheaper dispatch-cache keys; ``cache_hits``: a cache hit's outputs made without
    ``FakeTensor.__new__``'s argument checks; ``views``: ``_unsafe_view`` of a tensor with contiguous strides
    (the reshape after every batched matmul) and ``split`` into parts of its storage (fused projections, FSDP's
    parameters), which the dispatch cache does not hold (torch bypasses it for ``_unsafe_view``; a split's parts
    share a storage, which ``_make_cache_entry`` refuses). ``foreach_sharding``: DTensor's sharding of a foreach
    op worked out once per distinct element (estimator/simulate/distributed/foreach_sharding.py). ``lift``:
    ``torch.tensor``'s lift of a real CPU scalar (Adam's step counters, one per parameter) made a fake tensor
    with its constant directly, not converted through ``meta_utils``. ``pointwise``: the elementwise ops of
    ``_POINTWISE`` on tensors of one shape, dtype and contiguous strides (activations and their gradients, the
    products of a norm), made like their inputs without torch's Python references, and ``_to_copy`` to another
    dtype on the same device (autocast's casts) of a dense tensor. ``convolution``: a 2-d convolution and its
    backward whose tensors have no dimension of size 1, their outputs in the memory format torch's own
    functions choose for them. ``factories``: ``empty_strided`` on the device, and ``zeros_like``, ``empty_like``
    and ``ones_like`` of a tensor with contiguous or channels-last strides (the parameters' and the optimizer
    states' tensors, a few per parameter each step), made without torch's constructor path. ``views`` also
    covers ``detach`` (the parameters', each gradient accumulated); ``pointwise`` the in-place elementwise ops
    of ``_IN_PLACE`` (a residual's ``add_``, ``relu_``) on tensors of one shape and dtype.
    """

    foreach: bool = True
    batch_norm: bool = True
    cache_keys: bool = True
    cache_hits: bool = True
    views: bool = True
    foreach_sharding: bool = True
    lift: bool = True
    pointwise: bool = True
    convolution: bool = True
    factories: bool = True


# what FakeTensor.__new__ sets on a new fake tensor of an op's output besides its device and mode (torch 2.14): no
# constant, Python type, dispatch keys or real tensor, and each of its memos (nonzero's, item's, ...) empty
_MEMOS = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
_FRESH_STATE: dict[str, Any] = {
    "constant": None, "pytype": None, "dispatch_keys": None, "real_tensor": None,
    **{f"_{memo}{suffix}": None for memo in _MEMOS for suffix in ("", "_vc", "_epoch")}}


def _normal(device: torch.device) -> bool:
    """Whether a fake tensor keeps ``device`` as it is and may be on it: the CPU, or a device with an index
    (``FakeTensor._normalize_fake_device`` gives a GPU one, and torch's path another device type's, or its error),
    not the meta device."""
    return device.type != "meta" and (device.index is not None or device.type == "cpu")


_CUDNN_BN_BACKWARD = torch.ops.aten.cudnn_batch_norm_backward.default
# view and _unsafe_view of a contiguous tensor: torch's fake kernel for both is ``_reshape_view_helper``
_VIEWS = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default})
_SPLITS = frozenset({torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default})
_BATCH_NORM_OPS = frozenset({torch.ops.aten.cudnn_batch_norm.default, _CUDNN_BN_BACKWARD})
# elementwise ops whose output is like their tensor inputs (floating point, all of the same shape, dtype and
# contiguous strides; the other arguments Python numbers or the keyword named): their fake kernels are torch's
# Python references, about 1-3 ms a call for each new shape (every new batch's), the dispatch cache's misses
_POINTWISE = {op: keywords for ops, keywords in (
    ((aten.threshold_backward.default, aten.silu_backward.default, aten.sigmoid_backward.default,
      aten.tanh_backward.default, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.silu.default,
      aten.relu.default, aten.sigmoid.default, aten.tanh.default, aten.neg.default, aten.rsqrt.default,
      aten.pow.Tensor_Scalar), frozenset()),
    ((aten.add.Tensor,), frozenset({"alpha"})),
    ((aten.gelu.default, aten.gelu_backward.default), frozenset({"approximate"})),
) for op in ops}
_TO_COPY = aten._to_copy.default
# in-place elementwise ops (self first; the other arguments Python numbers, or tensors of self's shape and dtype on
# another storage; the keywords named): their output is self, as torch's kernel gives it back
_IN_PLACE = {op: keywords for ops, keywords in (
    ((aten.mul_.Tensor, aten.div_.Tensor, aten.relu_.default, aten.sigmoid_.default, aten.tanh_.default,
      aten.neg_.default, aten.rsqrt_.default, aten.silu_.default), frozenset()),
    ((aten.add_.Tensor, aten.sub_.Tensor), frozenset({"alpha"})),
) for op in ops}
_LIKE = frozenset({aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default})
# dtypes a factory shortcut leaves to torch (its own errors and warnings)
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_LIKE_KEYWORDS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_CONVOLUTIONS = frozenset({aten.convolution.default, aten.convolution_backward.default})
# cross entropy's four ops (log-softmax, NLL loss, their backwards): once a step each, ~15 ms of Python references
_CROSS_ENTROPY = frozenset({aten._log_softmax.default, aten._log_softmax_backward_data.default,
                            aten.nll_loss_forward.default, aten.nll_loss_backward.default})
_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
# the dtypes of a 0-d CPU constant whose value torch also keeps as a Python number (``item_memo``,
# FakeTensorConverter.from_real_tensor in torch 2.14)
_ITEM_MEMO_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.float64})

# op -> (the ``Shortcuts`` switch, the ``FakeMode`` method that makes its outputs, NotImplemented when unsure)
_ROUTES: dict[Any, tuple[str, str]] = {
    **{op: ("views", "_unsafe_view") for op in _VIEWS}, **{op: ("views", "_split") for op in _SPLITS},
    aten.detach.default: ("views", "_detach"),
    **{op: ("pointwise", "_pointwise") for op in _POINTWISE}, _TO_COPY: ("pointwise", "_cast"),
    **{op: ("pointwise", "_in_place") for op in _IN_PLACE},
    aten.empty_strided.default: ("factories", "_empty_strided"), **{op: ("factories", "_like") for op in _LIKE},
    **{op: ("pointwise", "_cross_entropy") for op in _CROSS_ENTROPY},
    **{op: ("convolution", "_convolution") for op in _CONVOLUTIONS},
    **{op: ("lift", "_lift_scalar") for op in _LIFTS},
    **{op: ("batch_norm", "_cudnn_batch_norm") for op in _BATCH_NORM_OPS},
}


def _plain_fake(mode, t) -> bool:
    """A strided fake tensor of ``mode`` on the device, without a constant or symbolic sizes."""
    return (type(t) is FakeTensor and t.fake_mode is mode and t.constant is None and t.layout == torch.strided
            and t.device.type != "cpu" and not t._has_symbolic_sizes_strides)


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` is not empty and has contiguous strides, or channels-last ones without a dimension of size 1
    (whose stride could be any): an elementwise op's output then has ``t``'s strides."""
    if 0 in t.shape:
        return False  # an empty tensor's strides are torch's to choose
    stride = t.stride()
    if stride == contiguous_strides(t.shape):
        return True
    return t.dim() == 4 and 1 not in t.shape and stride == channels_last_strides(t.shape)


# a tensor's own layout (FakeTensor.layout's, past its mkldnn check)
_LAYOUT = vars(torch._C.TensorBase)["layout"].__get__
_PLAIN_KEY_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format})


class FakeMode(FakeTensorMode):
    """FakeTensorMode that never initializes a device, even though
    ``torch.cuda.is_available()`` answers True inside the virtual GPU."""

    def __init__(self, shortcuts: Shortcuts | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shortcuts = shortcuts or Shortcuts()

    @property
    def avoid_device_init(self) -> bool:
        return True

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        rnn = _CUDNN_RNN_KERNELS.get(func)
        if rnn is not None:  # cuDNN's RNN ops: torch has no fake kernel with their sizes (cudnn_rnn.py)
            return rnn(self, args, kwargs)
        route = _ROUTES.get(func)
        if route is not None and getattr(self.shortcuts, route[0]):
            out = getattr(self, route[1])(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func.__name__.startswith("_foreach_"):
            out = self._foreach_elementwise(func, args, kwargs) if self.shortcuts.foreach else NotImplemented
            if out is not NotImplemented:
                return out
            return self._dispatch_impl(func, types, args, kwargs)
        return super()._cached_dispatch_impl(func, types, args, kwargs)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """A cache hit's output, built as torch builds it (an empty meta tensor with the entry's metadata, on the
        input's storage for a view) but made a FakeTensor without ``FakeTensor.__new__``'s general checks
        (``_fresh``): most of the time a cache hit took. torch's own path for anything else: an in-place op or a
        constant (nothing to build), symbolic sizes, a debug trace."""
        metadata = entry.metadata
        if (not self.shortcuts.cache_hits or metadata is None or entry.inplace_idx is not None
                or self.shape_env is not None or FakeTensorConfig.debug or not _normal(metadata.device)
                or not all(type(v) is int for v in (*metadata.shape, *metadata.stride, metadata.storage_offset))):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with torch._C._DisableTorchDispatch():  # as in_kernel_invocation_manager: no mode sees it
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype,
                                        layout=metadata.layout, device="meta", requires_grad=metadata.requires_grad)
        if metadata.is_conj:
            torch._C._set_conj(empty, True)
        if metadata.is_neg:
            torch._C._set_neg(empty, True)
        if isinstance(func, torch._ops.OpOverload) and func.is_view:  # the input's storage, as torch's path does
            view_arg = args[entry.view_idx]
            if type(view_arg) is not FakeTensor:
                return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
            storage = view_arg.untyped_storage()
            with torch._C._DisableTorchDispatch():  # (torch: in_kernel_invocation_manager, as in _on_storage)
                empty.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
        return self._fresh(empty, metadata.device)

    def _fresh(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self, elem, device)`` for a meta ``elem`` and a device a fake tensor keeps as it is
        (``_normal``): the same subclass instance with the same state (``FakeTensor.__new__`` in torch 2.14),
        without its argument checks."""
        t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        if not self._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(t)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        t.__dict__.update(_FRESH_STATE)
        t.__dict__["_fake_device"] = device
        t.__dict__["fake_mode"] = self
        return t

    def _takes(self, t: Any) -> bool:
        """Whether the shortcuts that make new outputs (elementwise, casts, cross entropy, convolutions) take ``t``:
        a plain fake tensor of this mode (``_plain_fake``) on a device it keeps as it is, without the conjugate
        or negative bit."""
        return _plain_fake(self, t) and _normal(t.device) and not t.is_conj() and not t.is_neg()

    def _pointwise(self, func, args, kwargs):
        """An elementwise op of ``_POINTWISE`` on floating-point tensors of one shape, dtype and strides (contiguous,
        or channels-last: ``_dense_layout``), as torch's reference kernel makes its output: a new tensor like
        them (no type promotion, no broadcast, no strides to choose). NotImplemented when unsure: any other
        tensor (a scalar one, a view with other strides, an integer one), a number that is not a plain int or
        float, another keyword."""
        if not kwargs.keys() <= _POINTWISE[func]:
            return NotImplemented
        first = None
        for a in args:
            if type(a) in (int, float):
                continue
            if not self._takes(a) or not a.is_floating_point():
                return NotImplemented
            if first is None:
                if not _dense_layout(a):
                    return NotImplemented
                first = a
            elif a.shape != first.shape or a.stride() != first.stride() or a.dtype != first.dtype \
                    or a.device != first.device:
                return NotImplemented
        if first is None or not all(type(v) in (int, float) for k, v in kwargs.items() if k != "approximate") \
                or kwargs.get("approximate", "none") not in ("none", "tanh"):
            return NotImplemented  # (another approximate: torch's error)
        return self._new(first.shape, first.stride(), first.dtype, first.device)

    def _in_place(self, func, args, kwargs):
        """An in-place elementwise op of ``_IN_PLACE`` on a floating-point ``self`` with contiguous or channels-last
        strides (``_dense_layout``: no element written twice), the other tensors of its shape, dtype and device on
        other storages, as torch's kernel ends: ``self`` itself (autograd bumps its version above this mode).
        NotImplemented when unsure: a broadcast, another dtype (a promotion torch may refuse), a storage shared
        with ``self`` (a real kernel checks the overlap), another keyword, inference mode."""
        if not args or not kwargs.keys() <= _IN_PLACE[func] or torch.is_inference_mode_enabled():
            return NotImplemented
        x = args[0]
        if not self._takes(x) or not x.is_floating_point() or x.is_inference() or not _dense_layout(x):
            return NotImplemented
        storage = x.untyped_storage()._cdata
        for a in (*args[1:], *kwargs.values()):
            if type(a) in (int, float):
                continue
            if not self._takes(a) or a.shape != x.shape or a.dtype != x.dtype or a.device != x.device \
                    or a.untyped_storage()._cdata == storage:
                return NotImplemented
        return x

    def _empty_strided(self, func, args, kwargs):
        """``empty_strided(size, stride)`` on a device this mode keeps as it is, not the CPU, as torch's
        constructor path makes it: a new tensor of those sizes and strides, of the dtype asked for (else the
        default one). NotImplemented when unsure: a negative size or stride, lengths that differ, another layout,
        pinned memory, a quantized dtype, no device or a device given otherwise than as a ``torch.device`` with an
        index, inference mode."""
        if len(args) != 2 or not kwargs.keys() <= {"dtype", "layout", "device", "pin_memory"} \
                or torch.is_inference_mode_enabled():
            return NotImplemented
        size, stride = args
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        if not (isinstance(size, (list, tuple)) and isinstance(stride, (list, tuple)) and len(size) == len(stride)
                and all(type(n) is int and n >= 0 for n in (*size, *stride))) \
                or not isinstance(device, torch.device) or not _normal(device) or device.type == "cpu" \
                or not (dtype is None or isinstance(dtype, torch.dtype) and dtype not in _QUANTIZED) \
                or kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
            return NotImplemented
        return self._new(tuple(size), tuple(stride), torch.get_default_dtype() if dtype is None else dtype, device)

    def _like(self, func, args, kwargs):
        """``zeros_like``, ``empty_like`` and ``ones_like`` of a tensor with contiguous or channels-last strides
        (``_dense_layout``), as torch's constructor path makes them: a new tensor with its sizes and strides
        (``preserve_format``), on its device, of its dtype or the one asked for. NotImplemented when unsure:
        another device, layout or memory format, pinned memory, a quantized dtype, other strides, inference
        mode."""
        if len(args) != 1 or not kwargs.keys() <= _LIKE_KEYWORDS or torch.is_inference_mode_enabled():
            return NotImplemented
        x = args[0]
        dtype = kwargs.get("dtype")
        if not self._takes(x) or x.is_inference() or not _dense_layout(x) or x.dtype in _QUANTIZED \
                or not (dtype is None or isinstance(dtype, torch.dtype) and dtype not in _QUANTIZED) \
                or kwargs.get("device") not in (None, x.device) or kwargs.get("layout") not in (None, torch.strided) \
                or kwargs.get("pin_memory") or kwargs.get("memory_format") not in (None, torch.preserve_format):
            return NotImplemented
        return self._new(x.shape, x.stride(), x.dtype if dtype is None else dtype, x.device)

    def _cast(self, func, args, kwargs):
        """``_to_copy(x, dtype=...)`` on ``x``'s own device (autocast's casts, ``.float()``) of a dense ``x``, as
        torch makes it: a new tensor with ``x``'s strides (``empty_like``'s ``preserve_format``) and the dtype
        asked for. NotImplemented when unsure: another device, layout or memory format, pinned memory, a
        tensor that is not dense or not plain."""
        if len(args) != 1 or not kwargs.keys() <= {"dtype", "layout", "device", "pin_memory", "non_blocking",
                                                    "memory_format"}:
            return NotImplemented
        x = args[0]
        if not self._takes(x) or not is_non_overlapping_and_dense(x):
            return NotImplemented
        dtype = kwargs.get("dtype") or x.dtype
        if not isinstance(dtype, torch.dtype) or kwargs.get("layout") not in (None, torch.strided) \
                or kwargs.get("device") not in (None, x.device) or kwargs.get("pin_memory") \
                or kwargs.get("non_blocking") or kwargs.get("memory_format") not in (None, torch.preserve_format):
            return NotImplemented
        return self._new(x.shape, x.stride(), dtype, x.device)

    def _convolution(self, func, args, kwargs):
        """``convolution`` and ``convolution_backward`` of a 2-d convolution (not transposed) as torch's fake kernel
        makes their outputs: the output's size by the usual formula, the gradients the input's and weight's, all
        in the memory format ``_select_conv_backend`` and ``_conv_determine_backend_memory_format`` give (called as
        torch's kernel calls them); the bias gradient of ``bias_sizes``. Only where the input, the output and the
        output's gradient have no dimension of size 1 (whose stride torch's kernel might leave as it comes; a 1x1
        kernel's weight is followed as torch makes it) and all are dense, of one floating dtype and device: a few
        hundred µs to 1 ms a call for each new batch's shapes. NotImplemented otherwise."""
        backward = func is aten.convolution_backward.default
        if kwargs or len(args) != (11 if backward else 9):
            return NotImplemented
        if backward:
            grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
            bias = None
        else:
            x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
            grad, bias_sizes, mask = None, None, None
        tensors = [t for t in (grad, x, w) if t is not None]
        if not all(self._takes(t) and t.dim() == 4 and 0 not in t.shape and t.is_floating_point()
                   and is_non_overlapping_and_dense(t) and t.dtype == x.dtype and t.device == x.device
                   for t in tensors) or 1 in x.shape:
            return NotImplemented
        if bias is not None and not (_plain_fake(self, bias) and bias.dim() == 1
                                     and bias.dtype == x.dtype and bias.device == x.device):
            return NotImplemented
        pairs = (stride, padding, dilation, output_padding)
        if transposed is not False or type(groups) is not int or groups < 1 \
                or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(type(v) is int for v in p)
                           for p in pairs) \
                or min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or any(output_padding):
            return NotImplemented
        (n, c, h, wd), (o, cg, kh, kw) = x.shape, w.shape
        if c != cg * groups or o % groups or (bias is not None and bias.shape != (o,)):
            return NotImplemented
        out = (n, o, *((size + 2 * pad - dil * (k - 1) - 1) // st + 1
                       for size, pad, dil, k, st in zip((h, wd), padding, dilation, (kh, kw), stride, strict=True)))
        if min(out) < 2:
            return NotImplemented
        if backward and (grad.shape != out or not isinstance(mask, (list, tuple)) or len(mask) != 3
                         or not all(type(m) is bool for m in mask) or not (
                             bias_sizes is None and not mask[2] or isinstance(bias_sizes, (list, tuple))
                             and len(bias_sizes) == 1 and type(bias_sizes[0]) is int and bias_sizes[0] >= 0)):
            return NotImplemented  # (a conv without a bias has bias_sizes [0])
        select: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": dilation, "transposed": False,
                                  "output_padding": output_padding, "groups": groups, "bias": bias}
        if bias is None:
            select["bias_sizes"] = bias_sizes
        with self:  # as torch's kernel: the tensors report their fake device
            backend = torch._C._select_conv_backend(x, w, **select)
            memory_format = torch._C._conv_determine_backend_memory_format(x, w, backend)
        if memory_format == torch.contiguous_format:
            strides = contiguous_strides
        elif memory_format == torch.channels_last:
            strides = channels_last_strides
        else:
            return NotImplemented
        device = x.device
        if not backward:
            return self._new(out, strides(out), x.dtype, device)
        # the weight's gradient: made contiguous, then ``.to(memory_format)``, which keeps a tensor already in that
        # format as it is (a 1x1 kernel's contiguous strides are channels-last ones too): as torch's kernel does
        with torch._C._DisableTorchDispatch():
            grad_w = torch.empty(w.shape, dtype=x.dtype, device="meta").to(memory_format=memory_format).stride()
        return (self._new(x.shape, strides(x.shape), x.dtype, device) if mask[0] else None,
                self._new(w.shape, grad_w, x.dtype, device) if mask[1] else None,
                self._new(tuple(bias_sizes), (1,), x.dtype, device) if mask[2] else None)

    def _cross_entropy(self, func, args, kwargs):
        """Cross entropy's ops as torch's references make their outputs, for the usual case: logits of shape
        (N, C) with contiguous strides, N int64 targets, no class weights, a mean or summed loss. Log-softmax
        and the gradients are like the logits (in float32 for ``half_to_float``, in the input's dtype backward);
        the loss and the total weight are scalars of the logits' dtype. NotImplemented otherwise."""
        if kwargs:
            return NotImplemented
        x = args[0] if func is not aten.nll_loss_backward.default else args[1]
        if not self._takes(x) or x.dim() != 2 or not x.is_floating_point() \
                or x.stride() != contiguous_strides(x.shape):
            return NotImplemented
        if func is aten._log_softmax.default:
            if len(args) != 3 or type(args[1]) is not int or not -2 <= args[1] < 2 or type(args[2]) is not bool \
                    or args[2] and x.dtype != torch.float16:  # half_to_float of anything else: torch's error
                return NotImplemented
            return self._new(x.shape, x.stride(), torch.float32 if args[2] else x.dtype, x.device)
        if func is aten._log_softmax_backward_data.default:
            out = args[1]
            if len(args) != 4 or type(args[2]) is not int or not -2 <= args[2] < 2 \
                    or not isinstance(args[3], torch.dtype) \
                    or not _plain_fake(self, out) or out.shape != x.shape \
                    or out.stride() != x.stride() or out.dtype != x.dtype or out.device != x.device:
                return NotImplemented
            return self._new(x.shape, x.stride(), args[3], x.device)
        forward = func is aten.nll_loss_forward.default
        target, weight, reduction, ignore = args[1:5] if forward else args[2:6]
        if len(args) != (5 if forward else 7) or weight is not None or reduction not in (1, 2) \
                or type(ignore) is not int or not _plain_fake(self, target) \
                or target.dtype != torch.int64 or target.shape != x.shape[:1] or target.device != x.device:
            return NotImplemented
        if forward:
            return self._new((), (), x.dtype, x.device), self._new((), (), x.dtype, x.device)
        grad, total = args[0], args[6]
        if not all(_plain_fake(self, t) and t.shape == () and t.dtype == x.dtype
                   and t.device == x.device for t in (grad, total)):
            return NotImplemented
        return self._new(x.shape, x.stride(), x.dtype, x.device)

    def _lift_scalar(self, func, args, kwargs):
        """``torch.tensor(x)``'s lift of a real 0-d CPU tensor into this mode as torch's path makes it
        (``_dispatch_impl``'s constant propagation, then ``from_real_tensor(copy, make_constant=True)``): a fake
        tensor whose constant is a copy of the value, memoized for that copy (an in-place op on the constant
        gives back this tensor), its Python number kept where torch keeps one, its storage mapped to it; without
        converting the copy through ``meta_utils`` (about 0.3 ms a call: Adam's first step lifts one step
        counter per parameter, about a tenth of a ResNet-50 simulation). NotImplemented when unsure: more than
        one element, a tensor that is not plain, symbolic shapes, export, a tracing context, a debug trace."""
        if kwargs or len(args) != 1:
            return NotImplemented
        t = args[0]
        if not (_is_plain_tensor(t) and t.dim() == 0 and t.device.type == "cpu") or t.requires_grad \
                or t.is_conj() or t.is_neg() or t.is_inference() or self.shape_env is not None \
                or self.fake_tensor_converter.export or FakeTensorConfig.debug \
                or torch._guards.TracingContext.try_get() is not None:
            return NotImplemented
        with no_dispatch():
            constant = t.clone()
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided((), (), dtype=t.dtype, device="meta")
        fake = self._fresh(empty, t.device)
        fake.constant = constant
        converter = self.fake_tensor_converter
        converter.set_tensor_memo(constant, fake)
        # and the constant's storage is the fake tensor's, as meta_utils memoizes it: an op worked out from the
        # constant whose result shares its storage (detach, a view) shares the fake tensor's
        meta = converter.meta_converter
        meta.set_storage_memo(meta.describer.describe_storage(constant.untyped_storage()), fake.untyped_storage())
        if t.dtype in _ITEM_MEMO_DTYPES:
            with no_dispatch():
                value = constant.item()
            if not (math.isnan(value) or math.isinf(value)):
                fake.item_memo = value
        converter.add_constant_storage_mapping(fake)
        return fake

    def _unsafe_view(self, func, args, kwargs):
        """``_unsafe_view(x, shape)`` of a contiguous ``x`` as torch's fake kernel makes it (``_view_meta``):
        ``x``'s storage at its offset, contiguous strides, not a view (its own version counter), without the
        Python reshape helper and the dispatch cache's bypass (about 0.5 ms a call). NotImplemented when unsure."""
        if kwargs or len(args) != 2:
            return NotImplemented
        x, shape = args
        # contiguous strides exactly (not only ``is_contiguous``, which ignores the stride of a dimension of size
        # 1): torch's reshape helper keeps the input's stride on each dimension it leaves alone
        if not self._viewable(x) or x.stride() != contiguous_strides(x.shape) \
                or not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= -1 for n in shape):
            return NotImplemented
        try:
            size = torch._prims_common.infer_size(shape, x.numel())
        except (RuntimeError, ValueError):
            return NotImplemented  # the general path raises torch's own error
        return self._on_storage(x, x.storage_offset(), size, contiguous_strides(size))

    def _detach(self, func, args, kwargs):
        """``detach(x)`` as torch's fake kernel makes it: ``x``'s storage, offset, sizes and strides, not requiring
        grad. NotImplemented when unsure (``_viewable``)."""
        if kwargs or len(args) != 1 or not self._viewable(args[0]):
            return NotImplemented
        x = args[0]
        return self._on_storage(x, x.storage_offset(), x.shape, x.stride())

    def _split(self, func, args, kwargs):
        """``split(x, size, dim)`` and ``split_with_sizes(x, sizes, dim)`` into parts that are not empty, as torch's
        fake kernel makes them: each part on ``x``'s storage at its offset, with ``x``'s strides. NotImplemented
        when unsure (an empty part, sizes that do not add up: torch's own path and its errors)."""
        if not 2 <= len(args) <= 3:
            return NotImplemented  # the parts given by keyword: torch's own path
        x, parts = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if kwargs.keys() - {"dim"} or not self._viewable(x) or type(dim) is not int or not -x.dim() <= dim < x.dim():
            return NotImplemented
        dim %= x.dim()
        length = x.shape[dim]
        if func is torch.ops.aten.split.Tensor:
            if type(parts) is not int or parts <= 0 or length <= 0:
                return NotImplemented
            parts = [parts] * (length // parts) + ([length % parts] if length % parts else [])
        elif not isinstance(parts, (list, tuple)) or not all(type(n) is int and n > 0 for n in parts) \
                or sum(parts) != length:
            return NotImplemented
        out, start, stride = [], x.storage_offset(), x.stride()
        if storage_length(x.shape, stride, start) * x.element_size() > x.untyped_storage().nbytes():
            return NotImplemented  # a storage resized below the tensor (FSDP frees a parameter so): set_ would grow it
        for n in parts:
            out.append(self._on_storage(x, start, (*x.shape[:dim], n, *x.shape[dim + 1:]), stride))
            start += n * stride[dim]
        return out

    def _viewable(self, x: Any) -> bool:
        """Whether the view shortcuts make views of ``x``: a plain fake tensor of this mode without the conjugate
        or negative bit (its views would carry it), on a device it keeps as it is (``_normal``) or on the meta
        device where this mode allows it (FSDP shards a model's meta parameters); not in a debug trace."""
        return (_plain_fake(self, x) and not x.is_conj() and not x.is_neg() and not FakeTensorConfig.debug
                and not x.is_inference() and not torch.is_inference_mode_enabled()  # autograd's view of those
                and (_normal(x.device) or x.device.type == "meta" and self.allow_meta))

    def _on_storage(self, x: FakeTensor, offset: int, size, stride) -> FakeTensor:
        """A fake tensor of ``x``'s dtype and device on ``x``'s storage, as a view op's output is made (torch sets
        the storage inside ``in_kernel_invocation_manager``, whose meta dispatch key a meta tensor has anyway)."""
        storage = x.untyped_storage()
        with torch._C._DisableTorchDispatch():
            empty = torch.empty((0,), dtype=x.dtype, device="meta")
            empty.set_(storage, offset, size, stride)
        return self._fresh(empty, x.device)

    def _new(self, shape, stride, dtype, device) -> FakeTensor:
        """A new fake tensor of this mode (``_fresh`` where the device is one it keeps as it is)."""
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return self._fresh(empty, device) if _normal(device) else FakeTensor(self, empty, device)

    def _cudnn_batch_norm(self, func, args, kwargs):
        """cuDNN batch norm's outputs as torch's fake kernel makes them, without running its Python
        decomposition (about 10 ms per new input shape, most of a fresh trace of a ResNet): the
        output (and grad_input) like the input, per-channel statistics and gradients, an empty
        reserve. NotImplemented (the general path) for anything unusual."""
        if kwargs or len(args) < 8:
            return NotImplemented
        x, weight = args[0], args[2] if func is _CUDNN_BN_BACKWARD else args[1]
        if not (_plain_fake(self, x) and _plain_fake(self, weight)) or x.dim() < 2 \
                or not is_non_overlapping_and_dense(x) or weight.shape != (x.shape[1],):
            return NotImplemented
        channels, device = x.shape[1], x.device
        if func is _CUDNN_BN_BACKWARD:
            grad_out = args[1]
            if not _plain_fake(self, grad_out) or grad_out.shape != x.shape or grad_out.stride() != x.stride() \
                    or grad_out.dtype != x.dtype:
                return NotImplemented
            return (self._new(x.shape, x.stride(), x.dtype, device),
                    self._new((channels,), (1,), weight.dtype, device),
                    self._new((channels,), (1,), weight.dtype, device))
        training = args[5]
        stats = ((channels,), torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype) \
            if training else ((0,), weight.dtype)
        return (self._new(x.shape, x.stride(), x.dtype, device),
                self._new(stats[0], (1,), stats[1], device),
                self._new(stats[0], (1,), stats[1], device),
                self._new((0,), (1,), torch.uint8, device))

    def _foreach_elementwise(self, func, args, kwargs):
        """An optimizer's elementwise foreach op on device tensors, without running each tensor's
        Python meta function (the cost of a fake optimizer step): in place it allocates nothing, out
        of place one tensor like each of the first list's. NotImplemented when unsure (mixed dtypes,
        shapes or layouts at an index, CPU tensors that carry constants): the general path decides."""
        name = func._overloadpacket.__name__.removeprefix("_foreach_")
        inplace = name.endswith("_")
        if name.rstrip("_") not in _FOREACH_ELEMENTWISE:
            return NotImplemented
        every = list(args) + list(kwargs.values())
        lists = [a for a in every if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        if not lists:
            return NotImplemented
        first = lists[0]
        for tensors in lists:
            if len(tensors) != len(first):
                return NotImplemented
            for t, f in zip(tensors, first, strict=True):
                if (not isinstance(t, FakeTensor) or t.fake_mode is not self or t.device.type == "cpu"
                        or t.dtype != f.dtype or t.shape != f.shape or t.stride() != f.stride()):
                    return NotImplemented
        for a in every:  # loose tensors: only scalar-like ones
            if isinstance(a, torch.Tensor) and a.dim() > 1:
                return NotImplemented
        if inplace:
            return None
        if not first[0].is_floating_point():  # an integer list times a float scalar is promoted
            return NotImplemented
        return [self._new(t.shape, t.stride(), t.dtype, t.device) for t in first]

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
        """torch's cache key, cheaper for the common case: a plain strided fake tensor of this mode
        becomes one tuple of the metadata that decides an op's outputs (shape, strides, storage,
        flags; the memory format torch also records follows from the strides). Everything else
        goes through torch's own translation."""
        if not self.shortcuts.cache_keys or isinstance(args, dict):
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(len(args))
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN_KEY_TYPES:
                result.append(kind)
                result.append(arg)
            elif kind is FakeTensor and arg.fake_mode is self and arg.constant is None and arg.dispatch_keys is None \
                    and _LAYOUT(arg) is torch.strided and not arg._has_symbolic_sizes_strides:
                # (no dispatch keys of its own: not mkldnn, so its layout is the tensor's own, read directly)
                result.append((arg.dtype, tuple(arg.shape), arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                               arg.is_inference(), arg.is_quantized))
            elif kind in (list, tuple):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _make_cache_entry(self, state, key, func, args, kwargs, output):
        # A cache hit rebuilds each output with its own storage, so outputs
        # that share one (mkldnn_rnn_layer_backward's two bias grads) would
        # cost an extra allocation from the second call on. Bypass those.
        if isinstance(output, (tuple, list)):
            storages = [t.untyped_storage()._cdata for t in output if isinstance(t, torch.Tensor)]
            if len(storages) != len(set(storages)):
                raise _BypassDispatchCache("outputs share a storage")
        return super()._make_cache_entry(state, key, func, args, kwargs, output)


_TORCH_DEEPCOPY = torch.Tensor.__deepcopy__


def deepcopy_fake(tensor: FakeTensor, memo: dict[Any, Any]) -> torch.Tensor:
    """``copy.deepcopy`` of a fake tensor as a real one copies it: a new tensor of this fake mode on the same
    device, with the same sizes and strides, whose storage is a new one of the source's size.

    Torch's own ``Tensor.__deepcopy__`` takes its clone path for a fake tensor (its data pointer is 0), then
    deep-copies the tensor's ``__dict__``, which for a fake tensor holds its fake mode (the copy would belong
    to a copy of the whole mode, which ops mixing it with the model's tensors refuse) and, for a CPU scalar
    made by ``torch.tensor``, its real ``constant`` (whose deep copy runs a real storage copy inside the fake
    mode and fails: DoryModel's sliding-window cache layers hold one). Here the copy is made by ops that the
    virtual GPU dispatches, so the observer records its allocation like any other: a ``clone`` where the
    tensor covers its storage exactly (the same bytes a real deepcopy allocates; the fake mode keeps a
    constant), else a copy of the whole storage viewed as the source is (a real deepcopy copies the storage,
    and tensors sharing one in the same deepcopy share the copy). Attributes set on the tensor are
    deep-copied as torch does; the fake tensor's own bookkeeping comes from the new tensor.
    """
    if not tensor.is_leaf:
        return _TORCH_DEEPCOPY(tensor, memo)  # torch's error: only leaves support the deepcopy protocol
    if id(tensor) in memo:
        return memo[id(tensor)]
    storage = tensor.untyped_storage()
    copies = memo.setdefault("batchfit.fake_storages", {})  # source storage -> a tensor on its copy
    copied = copies.get(storage._cdata)
    with torch.no_grad():
        covers = (tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == storage.nbytes()
                  and is_non_overlapping_and_dense(tensor))
        if copied is None and (covers or tensor.is_conj() or tensor.is_neg() or tensor.layout != torch.strided):
            new = copies[storage._cdata] = tensor.clone()
        else:
            if copied is None:
                copied = copies[storage._cdata] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                              device=tensor.device)
            new = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
            new.set_(copied.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    if tensor.requires_grad:
        new.requires_grad_()
    if tensor.grad is not None:
        new.grad = copy.deepcopy(tensor.grad, memo)
    for name, value in tensor.__dict__.items():
        if name not in new.__dict__:
            setattr(new, name, copy.deepcopy(value, memo))
    memo[id(tensor)] = new
    return new
