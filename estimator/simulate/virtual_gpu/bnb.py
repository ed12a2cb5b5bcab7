"""bitsandbytes on the virtual GPU: quantized weights built on fake tensors, and the CUDA kernels' allocations.

bitsandbytes' own modules run (``bnb.nn.Linear4bit``, ``Linear8bitLt``, ``MatMul4Bit``, ``MatMul8bitLt``, peft's
LoRA layers around them); two things need help on fake tensors:

- ``Params4bit`` / ``Int8Params`` cannot be made around a fake tensor ("Creating a new Tensor subclass Params4bit
  but the raw Tensor object is already associated to a python object of type FakeTensor"). ``materialize`` gives
  each quantized layer a plain frozen parameter holding what ``Params4bit._quantize`` / ``Int8Params._quantize``
  (bitsandbytes/nn/modules.py) leave in ``.data``, with the quant state as attributes, quantized by bitsandbytes'
  own ``functional.quantize_4bit`` / ``int8_vectorwise_quant`` from a full-precision copy of the layer's weight
  that lives only while its layer is quantized (as ``from_pretrained`` quantizes one tensor at a time). The
  layers' forward reads ``weight.quant_state`` (``fix_4bit_weight_quant_state_from_module`` then leaves it).
- The ops' registered fake kernels (bitsandbytes/_ops.py) make only their outputs; the CUDA kernels
  (bitsandbytes/backends/cuda/ops.py, and backends/default/ops.py where CUDA has none) allocate more inside.
  ``internals`` lists what each allocates and frees around its outputs, as ``cudnn_rnn.internals`` does for
  cuDNN, and ``dispatch`` answers the two int8 ops whose outlier columns are data-dependent.

What the CUDA kernels allocate (bitsandbytes 0.50.2):

- ``gemm_4bit`` (``MatMul4Bit.forward``, and ``matmul_4bit`` without grad): past
  ``_gemm_4bit_custom_max_m`` = 1536 rows of A (training: batch x seq tokens), or when K is not a multiple of
  the blocksize, or when ``_gemm_4bit_use_custom_cuda`` says the card prefers it, ``_dequant_linear_fallback``:
  with double quant the float32 absmax (``absmax_dq``, then ``absmax_dq + offset``), then ``B_dq`` (N x K in A's
  dtype), then ``F.linear``; all freed on return. The fused kernel (``_gemm_4bit_kernel_impl``) allocates only
  its output (and a contiguous copy of a strided A).
- ``int8_vectorwise_quant`` with a threshold: ``A.abs()`` and ``A.abs() >= threshold`` (the outlier mask), its
  ``any(dim=0)``, and the outlier columns ``argwhere`` finds.
- ``int8_scaled_mm`` (default backend): ``int8_linear_matmul``'s int32 product, ``int8_mm_dequant``'s fp16
  output and its cast to the requested dtype.
- ``int8_mixed_scaled_mm`` (default backend): the outlier columns of A and of the weight (dequantized in fp32,
  then in A's dtype), ``int8_scaled_mm``, and ``addmm`` of the outliers.

Outlier columns are data; LLM.int8() (Dettmers et al. 2022, section 4) finds the systematic outliers of models up
to 13B in at most 7 hidden dimensions: ``OUTLIER_COLUMNS`` = 8 per call.

>>> gemm_fallback(2048, 4096, 4096, 64, True)                           # doctest: +SKIP
True
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

OUTLIER_COLUMNS = 8  # LLM.int8(): systematic outliers in <= 7 hidden dimensions up to 13B
CUSTOM_MAX_M = 1536  # backends/cuda/ops.py _gemm_4bit_custom_max_m: dequant + F.linear past it
CUSTOM_FLOOR_M = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M: the fused kernel at or below it
NESTED_BLOCKSIZE = 256  # functional.quantize_4bit: the absmax's own blocks with compress_statistics

ASSUMPTION = (
    "bitsandbytes: the quantized weights are what Params4bit/Int8Params hold after .cuda() (packed uint8 or int8, "
    "absmax, nested absmax and code tables), quantized one layer at a time from a copy in the compute dtype; "
    "gemm_4bit dequantizes the weight to a temporary of the compute dtype past 1536 tokens (or where bitsandbytes' "
    "heuristic prefers it), the backward always does; LLM.int8() outliers: 8 columns per matmul")

Internal = tuple[bool, str, int]  # (allocate?, label, bytes), in the kernel's order


def loaded() -> bool:
    """Whether bitsandbytes is imported (a model with its layers cannot exist otherwise)."""
    return sys.modules.get("bitsandbytes") is not None  # None: blocked (a test without the extra)


def quantized_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's ``bnb.nn.Linear4bit`` and ``Linear8bitLt`` layers, by name."""
    if not loaded():
        return []
    import bitsandbytes as bnb

    return [(n, m) for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def materialize(model: torch.nn.Module, materialize_rest: Any, device: torch.device) -> list[torch.Tensor]:
    """``materialize_rest(model)`` (the virtual GPU's) for everything but the quantized weights, then each quantized
    layer's weight quantized on ``device`` by bitsandbytes; the quant-state tensors, which are the weights' storage
    as much as the packed parameter is."""
    layers = quantized_layers(model)
    if not layers:
        materialize_rest(model)
        return []
    _code_table()
    # the meta Params4bit / Int8Params (which carry the layer's options) out of the way of materialize_rest
    metas = [m._parameters.pop("weight") for _, m in layers]
    materialize_rest(model)
    state: list[torch.Tensor] = []
    for (_, m), meta in zip(layers, metas, strict=True):
        state.extend(_quantize(m, meta, device))
    return state


def materialize_real(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A meta model on a real card, its quantized layers quantized by bitsandbytes' own ``Params4bit`` /
    ``Int8Params`` one at a time from an empty copy in the compute dtype (as ``from_pretrained`` loads and quantizes
    each tensor): what a real step measures (estimator/measure/cuda.py)."""
    import bitsandbytes as bnb

    layers = quantized_layers(model)
    metas: list[Any] = [m._parameters.pop("weight") for _, m in layers]  # the meta Params4bit / Int8Params
    model.to_empty(device=device)
    for (_, m), meta in zip(layers, metas, strict=True):
        if isinstance(m, bnb.nn.Linear4bit):
            full = torch.empty(tuple(meta.shape), dtype=m.compute_dtype or meta.dtype, device=device)
            m.weight = bnb.nn.Params4bit(full, requires_grad=False, blocksize=meta.blocksize,
                                         compress_statistics=meta.compress_statistics, quant_type=meta.quant_type,
                                         quant_storage=meta.quant_storage, module=m)._quantize(device)
        else:
            full = torch.empty(tuple(meta.shape), dtype=torch.float16, device=device)
            m.weight = bnb.nn.Int8Params(full, requires_grad=False, has_fp16_weights=False)._quantize(device)
        del full
    return model


def _code_table() -> torch.Tensor:
    """bitsandbytes' 8-bit dynamic code (``functional.name2qmap["dynamic"]``, the nested absmax's), computed on the
    host: ``create_dynamic_map`` reads values (``tolist``), which fake tensors do not have. Each nested state keeps
    its own device copy (``quantize_blockwise``: ``code.to(A.device, copy=True)``); the cache's own device copy, 1 KiB
    once per process on a card, is not counted."""
    import bitsandbytes.functional as F
    from torch.utils._python_dispatch import _disable_current_modes

    host = F.name2qmap.get("dynamic")
    if host is None or isinstance(host, FakeTensor):
        with _disable_current_modes():
            host = F.name2qmap["dynamic"] = F.create_dynamic_map()
    return host


def _quantize(module: torch.nn.Module, meta: Any, device: torch.device) -> list[torch.Tensor]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    shape = tuple(meta.shape)
    if isinstance(module, bnb.nn.Linear4bit):
        # a checkpoint loaded in the compute dtype (QLoRA's recipe), quantized on the card (Params4bit._quantize)
        full = torch.empty(shape, dtype=module.compute_dtype or meta.dtype, device=device)
        packed, qs = F.quantize_4bit(full, blocksize=meta.blocksize, compress_statistics=meta.compress_statistics,
                                     quant_type=meta.quant_type, quant_storage=meta.quant_storage)
        del full
        weight = torch.nn.Parameter(packed, requires_grad=False)
        weight.quant_state = qs  # type: ignore[attr-defined]  # what Linear4bit.forward reads
        module.weight = weight
        module.quant_state = qs
        return quant_state_tensors(qs)
    # Int8Params._quantize: the weight in fp16 on the card, then row-wise int8 and its scales
    full = torch.empty(shape, dtype=torch.float16, device=device)
    cb, scb, _ = F.int8_vectorwise_quant(full)
    del full
    weight = torch.nn.Parameter(cb, requires_grad=False)
    weight.CB, weight.SCB = cb, scb  # type: ignore[attr-defined]  # Linear8bitLt.forward moves them to its state
    module.weight = weight
    return [scb]


def patch_peft(patches: Any) -> None:
    """peft's ``dequantize_module_weight`` (DoRA's weight norm, every forward) for the quantized layers
    ``materialize`` made: their weights are plain parameters, so it would hand back the packed bytes; here it
    dequantizes them as ``dequantize_bnb_weight`` does a ``Params4bit`` (``functional.dequantize_4bit``) or an
    ``Int8Params`` (``functional.int8_vectorwise_dequant``)."""
    if sys.modules.get("peft") is None:
        return
    import peft.tuners.lora.dora as dora
    import peft.tuners.lora.variants as variants

    original = dora.dequantize_module_weight

    def dequantize_module_weight(module: torch.nn.Module) -> torch.Tensor:
        import bitsandbytes.functional as F

        weight = getattr(module, "weight", None)
        if isinstance(weight, FakeTensor):
            if getattr(weight, "quant_state", None) is not None:
                return F.dequantize_4bit(weight.data, weight.quant_state)  # type: ignore[attr-defined]
            state = getattr(module, "state", None)
            if weight.dtype == torch.int8 and state is not None and state.SCB is not None:
                return F.int8_vectorwise_dequant(weight.data, state.SCB)
        return original(module)

    for where in (dora, variants):
        patches.set(where, "dequantize_module_weight", dequantize_module_weight)


def quant_state_tensors(qs: Any) -> list[torch.Tensor]:
    """The tensors of a ``QuantState``: absmax, code, and with double quant the offset and the nested state's."""
    out = [qs.absmax, qs.code]
    if qs.nested:
        out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


# --- the CUDA kernels


def _nbytes(shape: Any, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def gemm_fallback(m: int, n: int, k: int, blocksize: int, dtype: torch.dtype,
                  capability: tuple[int, int]) -> bool:
    """Whether the CUDA ``gemm_4bit`` takes ``_dequant_linear_fallback`` (backends/cuda/ops.py, the op's kernel):
    past 1536 rows, for K off the blocksize, else as ``_gemm_4bit_use_custom_cuda`` decides for the card."""
    if m > CUSTOM_MAX_M or k % blocksize:
        return True
    if m <= CUSTOM_FLOOR_M:
        return False
    return not _custom_heuristic(m, n, k, dtype, capability)


def _custom_heuristic(m: int, n: int, k: int, dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """bitsandbytes' own heuristic (its per-arch tables), asked about the card: its device-properties read patched
    to the card's capability (108 SMs, an A100's, where the catalog has no count)."""
    import bitsandbytes.backends.cuda.ops as cuda_ops

    heuristic = cuda_ops._gemm_4bit_use_custom_cuda.__wrapped__  # its cache keys on the device index alone
    props = cuda_ops._gpu_dispatch_props
    cuda_ops._gpu_dispatch_props = lambda index: (108, *capability)  # type: ignore[assignment]
    try:
        return bool(heuristic(0, dtype, m, n, k))
    finally:
        cuda_ops._gpu_dispatch_props = props


def internals(name: str, args: tuple, kwargs: dict[str, Any], capability: tuple[int, int]) -> list[Internal]:
    """What the CUDA kernel of bitsandbytes op ``name`` allocates and frees besides its outputs, in order."""
    events: list[Internal] = []
    for label, nbytes in _held(name, args, kwargs, capability):
        events.append((True, label, nbytes))
    return events + [(False, label, nbytes) for allocate, label, nbytes in reversed(events)]


def _held(name: str, args: tuple, kwargs: dict[str, Any], capability: tuple[int, int]) -> Iterator[tuple[str, int]]:
    if name == "gemm_4bit":
        a, _b, shape_b, absmax, blocksize = args[:5]
        absmax_8bit = kwargs.get("absmax_8bit", args[7] if len(args) > 7 else None)
        k = a.shape[-1]
        m, n = a.numel() // k, shape_b[0]
        if gemm_fallback(m, n, k, blocksize, a.dtype, capability):
            if absmax_8bit is not None:
                yield "absmax_dq", _nbytes(absmax_8bit.shape, torch.float32)
                yield "absmax_plus_offset", _nbytes(absmax_8bit.shape, torch.float32)
            yield "B_dq", _nbytes(shape_b, a.dtype)
        elif not a.is_contiguous():
            yield "A_contiguous", _nbytes(a.shape, a.dtype)
    elif name == "int8_vectorwise_quant" and _threshold(args, kwargs) > 0.0:
        a = args[0]
        yield "abs", _nbytes(a.shape, a.dtype)
        yield "outlier_mask", _nbytes(a.shape, torch.bool)
        yield "outlier_any", _nbytes(a.shape[-1:], torch.bool)
    elif name == "int8_scaled_mm":
        yield from _scaled_mm(args[0], args[1], kwargs.get("dtype", args[5] if len(args) > 5 else None))
    elif name == "int8_mixed_scaled_mm":
        a, _ca, cb = args[:3]
        cols = OUTLIER_COLUMNS
        yield "CB_outlier_columns", cb.shape[0] * cols * cb.dtype.itemsize
        yield "subB_fp32", cb.shape[0] * cols * 4
        yield "subB", cb.shape[0] * cols * a.dtype.itemsize
        yield from _scaled_mm(args[1], cb, a.dtype)


def _scaled_mm(ca: torch.Tensor, cb: torch.Tensor, dtype: torch.dtype | None) -> Iterator[tuple[str, int]]:
    rows = ca.numel() // ca.shape[-1]
    yield "int8_matmul_int32", rows * cb.shape[0] * 4
    if (dtype or torch.float16) != torch.float16:
        yield "mm_dequant_fp16", rows * cb.shape[0] * 2


def flops(name: str, args: tuple) -> int:
    """A bitsandbytes matmul's FLOPs (2 x M x N x K, as torch.utils.flop_counter counts ``mm``); 0 for the others."""
    if name == "gemm_4bit":
        a, shape_b = args[0], args[2]
        return 2 * (a.numel() // a.shape[-1]) * shape_b[0] * shape_b[1]
    if name in ("int8_scaled_mm", "int8_mixed_scaled_mm", "int8_linear_matmul"):
        ca, cb = (args[0], args[1]) if name != "int8_mixed_scaled_mm" else (args[1], args[2])
        return 2 * (ca.numel() // ca.shape[-1]) * cb.shape[0] * ca.shape[-1]
    return 0


def _threshold(args: tuple, kwargs: dict[str, Any]) -> float:
    return float(kwargs.get("threshold", args[1] if len(args) > 1 else 0.0))


def dispatch(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The two int8 ops whose outputs have a data-dependent size (the outlier columns), answered with
    ``OUTLIER_COLUMNS`` of them; NotImplemented for every other op."""
    if getattr(func, "namespace", None) != "bitsandbytes":
        return NotImplemented
    name = func._schema.name.split("::")[-1]
    if name == "int8_vectorwise_quant" and _threshold(args, kwargs) > 0.0:
        a = args[0]
        out_row, row_stats, _ = func(a, 0.0)
        return out_row, row_stats, torch.empty(OUTLIER_COLUMNS, dtype=torch.int64, device=a.device)
    if name == "int8_mixed_scaled_mm":
        a, ca, cb = args[:3]
        out = torch.empty((*ca.shape[:-1], cb.shape[0]), dtype=a.dtype, device=a.device)
        return out, torch.empty((a.shape[0], OUTLIER_COLUMNS), dtype=a.dtype, device=a.device)
    return NotImplemented
