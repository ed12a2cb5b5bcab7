"""cuDNN RNNs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) on the virtual GPU: what a real card allocates around them.

On a CUDA tensor with ``torch.backends.cudnn.enabled`` (the default),
``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` take cuDNN's path
(native/RNN.cpp: ``if (at::cudnn_is_acceptable(input))`` -> ``*_cudnn_stub``).
That path is C++ composite code that asks cuDNN for a handle, so on fake
tensors it initializes CUDA and fails. The virtual GPU runs it in Python, op
for op as aten/src/ATen/native/cudnn/RNN.cpp does, and gives the cuDNN ops
fake kernels (docs/DESIGN.md, fact 20). With cuDNN disabled the native path
runs, as on a card.

What RNN.cpp allocates through the caching allocator:

- ``flatten_parameters`` (at ``module.cuda()``, ``_apply``):
  ``_cudnn_rnn_flatten_weight`` -> ``copy_weights_to_flat_buf_views``:
  ``at::zeros(num_weights)``, the weights copied in and each parameter
  ``set_`` to a view of it; the old parameter storages die. ``num_weights`` is
  cuDNN's weight space: every layer's and direction's matrices and both bias
  vectors (cuDNN keeps the biases even for ``bias=False``).
- ``_cudnn_impl``: ``try_get_weight_buf`` hands the parameters' common storage
  to ``_cudnn_rnn`` when they are laid out as cuDNN expects, else undefined;
  ``get_dropout_state`` (training with dropout > 0, once per device and
  process): an 8-byte seed tensor, then ``_cudnn_init_dropout_state``'s RNG
  states, cached for good ("slightly over 2MB").
- ``_cudnn_rnn``: ``x = input.contiguous()`` (a copy for ``batch_first``),
  ``output`` (T, B, D*H_out), ``hy`` (L*D, B, H_out), ``cy`` (L*D, B, H),
  a weight buffer with the weights copied in when none was handed over (and
  the warning that says so), ``workspace`` (freed when it returns) and, in
  training, ``reserve``; it returns (output, hy, cy, reserve, weight_buf), and
  autograd saves input, weights, hx, cx, output, reserve and weight_buf.
- ``_cudnn_rnn_backward``: zeros for each undefined grad (output, hy, cy);
  ``_cudnn_rnn_backward_input``: contiguous copies of x and dy, ``dx``,
  ``dhx``, ``dcx`` and a workspace; ``_cudnn_rnn_backward_weight``: x again,
  ``dw = at::zeros(weight_buf)`` and a workspace; the weights' grads are views
  of ``dw`` (own tensors, copied from it, when the weight list's stride differs,
  as for ``bias=False``).
- autocast (aten/src/ATen/cudnn/AutocastRNN.cpp, ``_cudnn_rnn_cast_reflatten``):
  weights not already fp16 are copied into a new fp16 flat buffer on every call
  (autograd-exposed: their grads come back through the copies, in fp32), input,
  hx and cx are cast to fp16 (fp16 even under bf16 autocast).

The workspace and reserve sizes come from cuDNN (``cudnnGetRNNTempSpaceSizes``),
which is closed; the policy (``reserve_bytes``, ``workspace_bytes``):

- reserve: per token (T*B, or the packed batch's total) and direction, each
  layer keeps ``STORED[mode]`` vectors of H (LSTM: its 4 gates and the cell,
  plus the unprojected h with a projection; GRU: 3 input and 3 recurrent
  pre-activations; RNN: its activation) and each layer but the last its output
  (the next layer's input, H_out); plus one byte per element of the dropout
  masks between layers. These count what the backward reads. They reproduce
  the two sizes cuDNN reported in pytorch/pytorch#2895 (P100, fp32, 4 layers,
  H = 320, on 25,000 tokens): 736,000,000 B for an LSTM and 864,000,000 B for a
  GRU. The number of tokens is inferred from those figures and the parameter
  counts, not quoted from the script; a doubled count of tokens with every
  term doubled would fit too.
- workspace: one layer's gate pre-activations for the whole sequence (tokens x
  D x gates x H), the input GEMM of Appleyard et al. (2016, arXiv:1604.01946)
  that cuDNN's standard algorithm runs before the recurrence; an upper bound
  (cuDNN reported 17,730,560 B for that LSTM, this gives 128,000,000 B).
- both in the math type (``promote_rnn_math_type``: fp32 for fp16 and bf16
  inputs), which bounds a reduced-precision layout.
- the dropout states: ``DROPOUT_STATE_BYTES`` (RNN.cpp's "slightly over 2MB").

>>> g = Geometry(LSTM, 32, 64, 0, 2, False)
>>> g.num_weights()                                  # (4*64*(32+64) + 8*64) + (4*64*(64+64) + 8*64)
58368
>>> reserve_bytes(g, 128, torch.float32, 0.0)        # 128 tokens x (2*5*64 + 64) x 4 B
360448
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from estimator.simulate.virtual_gpu.device import Patches

RNN_RELU, RNN_TANH, LSTM, GRU = 0, 1, 2, 3  # cudnnRNNMode_t (torch._C._cudnn.RNNMode)
GATES = {RNN_RELU: 1, RNN_TANH: 1, LSTM: 4, GRU: 3}
STORED = {RNN_RELU: 1, RNN_TANH: 1, LSTM: 5, GRU: 6}  # H-vectors per layer, direction and token in the reserve
_MODULE_MODES = {"RNN_RELU": RNN_RELU, "RNN_TANH": RNN_TANH, "LSTM": LSTM, "GRU": GRU}
_VF_MODES = {"lstm": LSTM, "gru": GRU, "rnn_tanh": RNN_TANH, "rnn_relu": RNN_RELU}
DROPOUT_STATE_BYTES = 2 * 1024 * 1024 + 64 * 1024  # "slightly over 2MB", rounded up
SEED_BYTES = 8  # get_dropout_state's at::empty({}, kLong) for the seed

WORKSPACE = "cudnn_rnn_workspace"

ASSUMPTION = (
    "cuDNN RNNs: PyTorch's allocations from RNN.cpp (flattened weight buffer, output, hy/cy, dx/dhx/dcx, dw, "
    "contiguous copies); cuDNN's own sizes are a policy, not measured on the card: reserve (kept from forward to "
    "backward) = per token, direction and layer the gate and cell vectors the backward reads (LSTM 5 x H, GRU 6 x H, "
    "RNN 1 x H) plus every layer's output but the last, and the dropout masks; workspace (per call, freed when it "
    "returns) = one layer's gate pre-activations over the whole sequence, an upper bound; both in fp32 for fp16/bf16; "
    "dropout RNG states 2.06 MiB once. Under autocast the weights are copied into a new fp16 buffer on every call "
    "(AutocastRNN.cpp)")


@dataclass(frozen=True)
class Geometry:
    """An RNN as cuDNN sees it: cell type, sizes, layers, directions."""

    mode: int
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    bidirectional: bool

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def gates(self) -> int:
        return GATES[self.mode]

    @property
    def out_size(self) -> int:
        """H_out: the projection's size, else the hidden size."""
        return self.proj_size or self.hidden_size

    def layer_shapes(self, layer: int) -> list[tuple[int, ...]]:
        """One layer's and direction's tensors in cuDNN's buffer: w_ih, w_hh, b_ih, b_hh[, w_hr]."""
        gh = self.gates * self.hidden_size
        inp = self.input_size if layer == 0 else self.out_size * self.directions
        shapes: list[tuple[int, ...]] = [(gh, inp), (gh, self.out_size), (gh,), (gh,)]
        if self.proj_size:
            shapes.append((self.proj_size, self.hidden_size))
        return shapes

    def _blocks(self) -> list[list[tuple[int, ...]]]:
        return [self.layer_shapes(layer) for layer in range(self.num_layers) for _ in range(self.directions)]

    def num_weights(self) -> int:
        """cudnnGetRNNWeightSpaceSize in elements: all matrices and both bias vectors of every layer."""
        return sum(math.prod(s) for block in self._blocks() for s in block)

    def offsets(self, has_biases: bool) -> list[int]:
        """Where each of the module's flat weights (w_ih, w_hh[, b_ih, b_hh][, w_hr] per layer and direction)
        starts in the buffer: biases after the matrices, the projection last (get_parameters)."""
        return [offset for offset, _ in self.merged_params(has_biases)]

    def merged_params(self, include_bias: bool) -> list[tuple[int, int]]:
        """get_parameters' (offset, numel) views, per layer and direction: each matrix and bias with its gates
        merged into one (numel, 1) column."""
        found = []
        start = 0
        for block in self._blocks():
            starts = [start + sum(math.prod(s) for s in block[:i]) for i in range(len(block))]
            keep = [0, 1] + ([2, 3] if include_bias else []) + ([4] if self.proj_size else [])
            found += [(starts[i], math.prod(block[i])) for i in keep]
            start += sum(math.prod(s) for s in block)
        return found

    def stride0(self, include_bias: bool = True) -> int:
        """Tensors per layer and direction in get_parameters' list."""
        return (4 if include_bias else 2) + (1 if self.proj_size else 0)


def math_size(dtype: torch.dtype) -> int:
    """Bytes of cuDNN's math type for ``dtype`` (promote_rnn_math_type: fp16 and bf16 compute in fp32)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 4
    return dtype.itemsize


def reserve_bytes(geom: Geometry, tokens: int, dtype: torch.dtype, dropout: float) -> int:
    """The training reserve of one call (the policy in the module docstring)."""
    d, h = geom.directions, geom.hidden_size
    stored = STORED[geom.mode] + (1 if geom.proj_size else 0)
    between = (geom.num_layers - 1) * d * geom.out_size  # every layer's output but the last
    elems = tokens * (geom.num_layers * d * stored * h + between)
    masks = tokens * between if dropout > 0 else 0  # one byte per element of the masks between layers
    return elems * math_size(dtype) + masks


def workspace_bytes(geom: Geometry, tokens: int, dtype: torch.dtype) -> int:
    """One call's workspace: a layer's gate pre-activations over the whole sequence (an upper bound)."""
    return tokens * geom.directions * geom.gates * geom.hidden_size * math_size(dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``is_contiguous()`` from sizes and strides (dimensions of size 1 have any stride)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size == 0:
            return True
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _transposed(shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(B, T, C) with the strides of a contiguous (T, B, C): ``transpose_(0, 1)`` of the kernels' result."""
    b, t, c = shape
    return (b, t, c), (c, b * c, 1)


def cudnn_accepts(t: torch.Tensor) -> bool:
    """``torch.backends.cudnn.is_acceptable`` without its library check (``_init`` asks the host's cuDNN
    about the host's devices, and caches the answer for the process)."""
    return (torch._C._get_cudnn_enabled() and t.device.type == "cuda"
            and t.dtype in torch.backends.cudnn.CUDNN_TENSOR_DTYPES and torch._C._has_cudnn)


def flatten(weights: list[torch.Tensor], has_biases: bool, geom: Geometry) -> torch.Tensor:
    """``_cudnn_rnn_flatten_weight``: a zeroed buffer of cuDNN's weight space, each weight ``set_`` to its
    place in it (the copy of the values is left out: fake tensors have none)."""
    first = weights[0]
    buf = torch.zeros(geom.num_weights(), dtype=first.dtype, device=first.device)
    storage = buf.untyped_storage()
    with torch.no_grad():
        for w, offset in zip(weights, geom.offsets(has_biases), strict=True):
            w.set_(storage, offset, w.shape, _contiguous_strides(tuple(w.shape)))
    return buf


def flatten_parameters(self: torch.nn.RNNBase) -> None:
    """``RNNBase.flatten_parameters`` on the virtual GPU: torch's checks, with storage identity where torch
    compares ``data_ptr`` (0 for every fake tensor), then ``flatten``."""
    weights = [w for w in self._flat_weights if isinstance(w, torch.Tensor)]
    if len(weights) != len(self._flat_weights) or len(weights) != len(self._flat_weights_names):
        return
    dtype = weights[0].dtype
    if any(w.dtype != dtype or not w.is_cuda or not cudnn_accepts(w) for w in weights):
        return
    if len({(w.untyped_storage()._cdata, w.storage_offset()) for w in weights}) != len(weights):
        return  # aliased parameters: torch keeps the copying path
    if not torch._use_cudnn_rnn_flatten_weight():
        return
    geom = Geometry(_MODULE_MODES[self.mode], self.input_size, self.hidden_size, self.proj_size, self.num_layers,
                    bool(self.bidirectional))
    flatten(weights, bool(self.bias), geom)


def weight_buf(params: list[torch.Tensor], has_biases: bool, geom: Geometry) -> torch.Tensor | None:
    """``try_get_weight_buf``: the parameters' common storage as a flat buffer when every weight sits where
    cuDNN expects it, else None (``_cudnn_rnn`` then copies them into a new buffer)."""
    first = params[0]
    storage = first.untyped_storage()
    n = geom.num_weights()
    if storage.nbytes() // first.element_size() < n:
        return None
    for p, offset in zip(params, geom.offsets(has_biases), strict=True):
        if p.untyped_storage()._cdata != storage._cdata or p.storage_offset() != offset:
            return None
    if not params[-1].is_contiguous():
        return None
    return first.detach().as_strided((n,), (1,), 0)


@dataclass
class CudnnRnns:
    """The virtual GPU's cuDNN RNN path: ``flatten_parameters`` and the ``_VF`` RNN ops, patched while
    inside; ``calls`` counts the RNN calls that went through cuDNN."""

    dropout_state: torch.Tensor | None = None  # get_dropout_state's cache: one per device, for good
    calls: int = 0
    reflattened: int = 0  # calls whose weights autocast copied into an fp16 buffer

    def patch(self, patches: Patches) -> None:
        patches.set(torch.nn.RNNBase, "flatten_parameters", flatten_parameters)
        for name, mode in _VF_MODES.items():
            patches.set(torch._VF, name, self._op(mode, getattr(torch._VF, name)))

    def _op(self, mode: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            if kwargs or len(args) != 9:
                return original(*args, **kwargs)
            packed = isinstance(args[3], (list, tuple))  # (data, batch_sizes, hx, params, ...) vs (input, hx, ...)
            if packed:
                data, batch_sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
                batch_first = False
            else:
                data, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
                batch_sizes = None
            if not torch.cudnn_is_acceptable(data):
                return original(*args)  # native/RNN.cpp's other paths, as on a card
            h, c = (hx[0], hx[1]) if mode == LSTM else (hx, None)
            out = self._cudnn_impl(mode, data, batch_sizes, h, c, list(params), bool(has_biases), int(layers),
                                   float(dropout), bool(train), bool(bidirectional), bool(batch_first))
            return (out[0], out[1], out[2]) if mode == LSTM else (out[0], out[1])

        return op

    def _cudnn_impl(self, mode: int, data: torch.Tensor, batch_sizes: torch.Tensor | None, h: torch.Tensor,
                    c: torch.Tensor | None, params: list[torch.Tensor], has_biases: bool, layers: int,
                    dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple:
        """RNN.cpp ``_cudnn_impl``: weight buffer, dropout state, then ``_cudnn_rnn``."""
        hidden, proj = h.size(2), 0
        if c is not None and c.size(2) != h.size(2):  # an LSTM with projections
            hidden, proj = c.size(2), h.size(2)
        geom = Geometry(mode, data.size(-1), hidden, proj, layers, bidirectional)
        buf = weight_buf(params, has_biases, geom)
        state = self._dropout(dropout, train, data.device)
        stride0 = (4 if has_biases else 2) + (1 if proj else 0)
        sizes = [] if batch_sizes is None else [int(b) for b in batch_sizes.tolist()]
        self.calls += 1
        call = [data, params, stride0, buf, h, c, mode, hidden, proj, layers, batch_first, dropout, train,
                bidirectional, sizes, state]
        if torch.is_autocast_enabled("cuda"):
            torch.set_autocast_enabled("cuda", False)  # AutocastRNN.cpp excludes the Autocast key as it goes
            try:
                return torch.ops.aten._cudnn_rnn.default(*self._cast_reflatten(call, geom))
            finally:
                torch.set_autocast_enabled("cuda", True)
        return torch.ops.aten._cudnn_rnn.default(*call)

    def _dropout(self, p: float, train: bool, device: torch.device) -> torch.Tensor | None:
        """``get_dropout_state``: made on the first call that trains with dropout, then kept."""
        if train and p > 0 and self.dropout_state is None:
            torch.empty((), dtype=torch.long, device=device)  # the seed, read with .item() and dropped
            self.dropout_state = torch.ops.aten._cudnn_init_dropout_state.default(
                p, train, 0, dtype=torch.uint8, device=device)
        return self.dropout_state

    def _cast_reflatten(self, call: list, geom: Geometry) -> list:
        """AutocastRNN.cpp ``_cudnn_rnn_cast_reflatten``: weights into a new fp16 flat buffer, inputs to fp16."""
        data, params, stride0, buf, h, c = call[:6]
        half = torch.float16
        eligible = (buf if buf is not None else params[0]).dtype
        if eligible.is_floating_point and eligible not in (torch.float64, half):
            self.reflattened += 1
            include_bias = not (stride0 == 2 or (stride0 == 3 and geom.proj_size > 0))
            buf = torch.zeros(geom.num_weights(), dtype=half, device=data.device)
            storage, views = buf.untyped_storage(), []
            for w, (offset, numel) in zip(params, geom.merged_params(include_bias), strict=True):
                view = torch.empty((0,), dtype=half, device=data.device).set_(storage, offset, (numel, 1), (1, 1))
                view.copy_(w.view_as(view))  # autograd-exposed, as in _viewOrCopyParams
                views.append(view)
            params = views

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not t.is_floating_point() or t.dtype in (half, torch.float64):
                return t
            return t.to(half)

        return [cast(data), params, stride0, buf, cast(h), cast(c), *call[6:]]


@dataclass(frozen=True)
class RnnCall:
    """What one ``_cudnn_rnn`` / ``_cudnn_rnn_backward`` call is, read from its arguments."""

    geom: Geometry
    batch_first: bool
    packed: bool
    seq: int
    batch: int
    tokens: int
    dtype: torch.dtype
    dropout: float
    train: bool

    @classmethod
    def of(cls, input: torch.Tensor, mode: int, hidden: int, proj: int, layers: int, batch_first: bool,
           dropout: float, train: bool, bidirectional: bool, batch_sizes: list) -> RnnCall:
        geom = Geometry(int(mode), int(input.shape[-1]), int(hidden), int(proj), int(layers), bool(bidirectional))
        if batch_sizes:
            seq, batch, tokens = len(batch_sizes), int(batch_sizes[0]), int(input.shape[0])
        else:
            seq, batch = (int(input.shape[1]), int(input.shape[0])) if batch_first else \
                (int(input.shape[0]), int(input.shape[1]))
            tokens = seq * batch
        return cls(geom, bool(batch_first), bool(batch_sizes), seq, batch, tokens, input.dtype, float(dropout),
                   bool(train))

    @classmethod
    def forward(cls, args: tuple) -> RnnCall:
        mode, hidden, proj, layers, batch_first, dropout, train, bidirectional = args[6:14]
        return cls.of(args[0], mode, hidden, proj, layers, batch_first, dropout, train, bidirectional, list(args[14]))

    @classmethod
    def backward(cls, args: tuple) -> RnnCall:
        mode, hidden, proj, layers, batch_first, dropout, train, bidirectional = args[10:18]
        return cls.of(args[0], mode, hidden, proj, layers, batch_first, dropout, train, bidirectional, list(args[18]))

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        g = self.geom
        return (g.num_layers * g.directions, self.batch, g.out_size)

    @property
    def cell_shape(self) -> tuple[int, int, int]:
        g = self.geom
        return (g.num_layers * g.directions, self.batch, g.hidden_size)

    def sequence_shape(self, channels: int) -> tuple[int, ...]:
        """The (T, B, C) layout the kernels work in ((tokens, C) when packed)."""
        return (self.tokens, channels) if self.packed else (self.seq, self.batch, channels)

    def needs_copy(self, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
        """Whether RNN.cpp's ``contiguous()`` of a tensor (transposed to (T, B, C) for batch_first) copies it."""
        if self.batch_first and not self.packed:
            shape = (shape[1], shape[0], *shape[2:])
            strides = (strides[1], strides[0], *strides[2:])
        return not _is_contiguous(shape, strides)


def _views(mode: Any, numel: int, dtype: torch.dtype, device: torch.device,
           layout: list[tuple[tuple[int, ...], int]]) -> list[FakeTensor]:
    """Fake tensors at (shape, offset) in one new storage of ``numel`` elements (contiguous each)."""
    base = torch.empty((numel,), dtype=dtype, device="meta")
    return [FakeTensor(mode, base.as_strided(shape, _contiguous_strides(shape), offset), device)
            for shape, offset in layout]


def _sequence(mode: Any, call: RnnCall, channels: int, dtype: torch.dtype, device: torch.device) -> FakeTensor:
    shape = call.sequence_shape(channels)
    if call.batch_first and not call.packed:
        b_t, strides = _transposed((call.batch, call.seq, channels))
        return mode._new(b_t, strides, dtype, device)
    return mode._new(shape, _contiguous_strides(shape), dtype, device)


def fake_cudnn_rnn(mode: Any, args: tuple, kwargs: dict) -> tuple:
    """``_cudnn_rnn``'s outputs with RNN.cpp's sizes: (output, hy, cy, reserve, weight_buf)."""
    call = RnnCall.forward(args)
    input, weights, buf, hx, cx = args[0], args[1], args[3], args[4], args[5]
    for t in list(weights) + [hx] + ([cx] if cx is not None else []):
        if t.dtype != input.dtype:  # check_attributes(..., check_dtype=true)
            raise RuntimeError(f"Input and parameter tensors are not the same dtype, found input tensor with "
                               f"{input.dtype} and parameter tensor with {t.dtype}")
    device, g = input.device, call.geom
    output = _sequence(mode, call, g.out_size * g.directions, input.dtype, device)
    hy = mode._new(call.hidden_shape, _contiguous_strides(call.hidden_shape), hx.dtype, device)
    cell = call.cell_shape if cx is not None else (0,)
    cy = mode._new(cell, _contiguous_strides(cell), (cx if cx is not None else hx).dtype, device)
    nbytes = reserve_bytes(g, call.tokens, input.dtype, call.dropout) if call.train else 0
    reserve = mode._new((nbytes,), (1,), torch.uint8, device)
    if buf is None:  # no flat weights handed over: _cudnn_rnn copies them into a buffer of its own
        buf = mode._new((g.num_weights(),), (1,), input.dtype, device)
    return output, hy, cy, reserve, buf


def fake_cudnn_rnn_backward(mode: Any, args: tuple, kwargs: dict) -> tuple:
    """``_cudnn_rnn_backward``'s outputs: dx, dhx, dcx and the weights' grads (views of one ``dw``)."""
    call = RnnCall.backward(args)
    input, weights, stride0, buf, hx, cx = args[:6]
    grads, mask = args[7:10], args[21]
    if all(t is None for t in grads):
        return None, None, None, [None] * len(weights)
    device, g = input.device, call.geom
    dx = _sequence(mode, call, int(input.shape[-1]), input.dtype, device)
    dhx = mode._new(call.hidden_shape, _contiguous_strides(call.hidden_shape), hx.dtype, device)
    dcx = mode._new(call.cell_shape, _contiguous_strides(call.cell_shape), cx.dtype, device) \
        if cx is not None else None
    dw: list = []
    if mask[3]:
        include_bias = True  # get_parameters' default: the grads' list always has the biases
        if int(stride0) == g.stride0(include_bias):
            offsets = g.offsets(True)
            dw = _views(mode, int(buf.numel()), buf.dtype, device,
                        [(tuple(w.shape), off) for w, off in zip(weights, offsets, strict=True)])
        else:  # grad_weight_arr: own tensors, copied from dw
            dw = [mode._new(tuple(w.shape), _contiguous_strides(tuple(w.shape)), w.dtype, device) for w in weights]
    return dx, dhx, dcx, dw


def fake_init_dropout_state(mode: Any, args: tuple, kwargs: dict) -> FakeTensor:
    """``_cudnn_init_dropout_state``: cuDNN's RNG states (``DROPOUT_STATE_BYTES``)."""
    device = kwargs.get("device") or torch.device("cuda", 0)
    return mode._new((DROPOUT_STATE_BYTES,), (1,), torch.uint8, torch.device(device))


GRU_WORKSPACE_MULTIPLIER = 5  # native/cuda/RNN.cu


def fake_fused_gru_cell(mode: Any, args: tuple, kwargs: dict) -> tuple:
    """The native path's (cuDNN disabled) ``_thnn_fused_gru_cell``, which torch gives no fake kernel:
    RNN.cu allocates ``workspace`` (B, 5 x H) and ``hy`` like hx; returns (hy, workspace)."""
    hx = args[2]
    b, h = int(hx.shape[0]), int(hx.shape[1])
    hy = mode._new((b, h), (h, 1), hx.dtype, hx.device)
    return hy, mode._new((b, h * GRU_WORKSPACE_MULTIPLIER), (h * GRU_WORKSPACE_MULTIPLIER, 1), hx.dtype, hx.device)


def fake_fused_gru_cell_backward(mode: Any, args: tuple, kwargs: dict) -> tuple:
    """``_thnn_fused_gru_cell_backward`` (RNN.cu): the gates' grads (B, 3 x H) twice, grad_hx, and their
    sums over the batch for the biases."""
    grad_hy, workspace, has_bias = args[0], args[1], bool(args[2])
    b, h = int(workspace.shape[0]), int(workspace.shape[1]) // GRU_WORKSPACE_MULTIPLIER
    dtype, device = workspace.dtype, workspace.device
    gates = [mode._new((b, 3 * h), (3 * h, 1), dtype, device) for _ in range(2)]
    grad_hx = mode._new(tuple(grad_hy.shape), _contiguous_strides(tuple(grad_hy.shape)), grad_hy.dtype, device)
    biases = [mode._new((3 * h,), (1,), dtype, device) for _ in range(2)] if has_bias else [None, None]
    return gates[0], gates[1], grad_hx, biases[0], biases[1]


FAKE_KERNELS: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    torch.ops.aten._cudnn_rnn.default: fake_cudnn_rnn,
    torch.ops.aten._cudnn_rnn_backward.default: fake_cudnn_rnn_backward,
    torch.ops.aten._cudnn_init_dropout_state.default: fake_init_dropout_state,
    torch.ops.aten._thnn_fused_gru_cell.default: fake_fused_gru_cell,
    torch.ops.aten._thnn_fused_gru_cell_backward.default: fake_fused_gru_cell_backward,
}

# (allocate?, label, bytes): what a call allocates and frees inside, after its outputs
Internal = tuple[bool, str, int]


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def internals(name: str, args: tuple, out: Any) -> list[Internal]:
    """What ``_cudnn_rnn`` / ``_cudnn_rnn_backward`` allocate and free inside (RNN.cpp), in order: contiguous
    copies, zeros for undefined grads, workspaces, and a ``dw`` the grads were copied from."""
    events: list[Internal] = []

    def hold(label: str, nbytes: int) -> None:
        if nbytes:
            events.append((True, label, nbytes))

    def drop(label: str, nbytes: int) -> None:
        if nbytes:
            events.append((False, label, nbytes))

    if name == "_cudnn_rnn":
        call = RnnCall.forward(args)
        x = _size(args[0]) if call.needs_copy(tuple(args[0].shape), args[0].stride()) else 0
        ws = workspace_bytes(call.geom, call.tokens, call.dtype)
        hold("x_contiguous", x)
        hold(WORKSPACE, ws)
        drop(WORKSPACE, ws)
        drop("x_contiguous", x)
        return events
    if name != "_cudnn_rnn_backward" or out[0] is None:
        return events
    call = RnnCall.backward(args)
    input, output, hx, cx = args[0], args[6], args[4], args[5]
    grad_output, grad_hy, grad_cy, mask = args[7], args[8], args[9], args[21]
    zeros = [("zeros_grad_output", _size(output) if grad_output is None else 0),
             ("zeros_grad_hy", _size(hx) if grad_hy is None else 0),
             ("zeros_grad_cy", _size(cx) if cx is not None and grad_cy is None else 0)]
    for label, nbytes in zeros:
        hold(label, nbytes)
    ws = workspace_bytes(call.geom, call.tokens, call.dtype)
    x = _size(input) if call.needs_copy(tuple(input.shape), input.stride()) else 0
    # dy: the grad, or zeros_like(output) in the legacy contiguous format, seen as (T, B, C)
    shape = tuple(output.shape)
    strides = grad_output.stride() if grad_output is not None else _contiguous_strides(shape)
    dy = _size(output) if call.needs_copy(shape, strides) else 0
    dhy = _size(grad_hy) if grad_hy is not None and not grad_hy.is_contiguous() else 0
    dcy = _size(grad_cy) if cx is not None and grad_cy is not None and not grad_cy.is_contiguous() else 0
    data = [("x_contiguous", x), ("dy_contiguous", dy), ("dhy_contiguous", dhy), ("dcy_contiguous", dcy),
            (WORKSPACE, ws)]
    for label, nbytes in data:
        hold(label, nbytes)
    for label, nbytes in reversed(data):
        drop(label, nbytes)
    if mask[3]:
        buf = args[3]
        copied = int(args[2]) != call.geom.stride0(True)
        weight = [("x_contiguous", x), ("dw", _size(buf) if copied else 0), (WORKSPACE, ws)]
        for label, nbytes in weight:
            hold(label, nbytes)
        drop(WORKSPACE, ws)
        drop("x_contiguous", x)
        if copied:
            drop("dw", _size(buf))
    for label, nbytes in reversed(zeros):
        drop(label, nbytes)
    return events


def flops(name: str, args: tuple) -> int:
    """The GEMM FLOPs of a call: 2 x tokens x gates x H x (layer input + H_out) per layer and direction, and
    twice that for a backward (data and weights)."""
    call = RnnCall.forward(args) if name == "_cudnn_rnn" else RnnCall.backward(args)
    g = call.geom
    per_token = sum(2 * g.gates * g.hidden_size * (shapes[0][1] + shapes[1][1])
                    + (2 * g.proj_size * g.hidden_size if g.proj_size else 0)
                    for shapes in g._blocks())
    return per_token * call.tokens * (1 if name == "_cudnn_rnn" else 2)
