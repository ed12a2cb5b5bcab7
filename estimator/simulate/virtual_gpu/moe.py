"""Mixture-of-experts kernels as the target card runs them (docs/DESIGN.md, fact 21).

transformers' experts (``integrations/moe.py``, ``grouped_mm`` implementation, its default) call
``torch._grouped_mm`` with the input cast to the weights' dtype, and the op has no autocast kernel:
with fp32 master weights it runs in fp32 even under amp. torch 2.14.1's CUDA (and CPU) kernel accepts
fp32, bf16 and fp16 (``_grouped_mm_validate_inputs`` in ATen/native/GroupedMMUtils.h) and runs CUTLASS's
grouped GEMM only for bf16 on sm90/sm100; everything else goes to ``_grouped_mm_fallback``, one ``mm_out``
per group into slices of the output, which allocates nothing beyond the output. The meta function that
fake tensors run (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) is stricter and refuses
fp32 ("Expected mat_a to be BFloat16 or supported Float16 matrix"), a failure no GPU has: ``GroupedMM``
answers fp32 calls with the kernel's own checks and output (``create_grouped_gemm_output_tensor``: rows
padded to 16 bytes) and lets the meta function answer the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from estimator.models.routing import ROUTING

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _transposed(name: str, mat: torch.Tensor) -> bool:
    """GroupedMMUtils.h, ``check_valid_strides_and_return_transposed``: one unit stride, the other 16-byte aligned."""
    stride, size, end = mat.stride(), mat.shape, mat.dim() - 1
    alignment = 16 // mat.element_size()
    if stride[end - 1] == 1 and stride[end] >= max(1, size[end - 1]):
        _check(stride[end] % alignment == 0, "strides should be multiple of 16 bytes")
        return True
    if stride[end] == 1 and stride[end - 1] >= max(1, size[end]):
        _check(stride[end - 1] % alignment == 0, "strides should be multiple of 16 bytes")
        return False
    raise RuntimeError(f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes ({name})")


def output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``create_grouped_gemm_output_tensor``: the result, its last dimension's stride padded to 16 bytes."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        assert offs is not None
        _check(offs.size(0) == mat_b.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        assert offs is not None
        _check(offs.size(0) == mat_a.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        _check(mat_a.size(0) == mat_b.size(0), "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def path(capability: tuple[int, int], dtype: torch.dtype) -> str:
    """Which kernel ``_grouped_mm_cuda`` (ATen/native/cuda/GroupedBlas.cpp) runs at ``capability``."""
    if dtype == torch.bfloat16 and capability[0] in (9, 10):  # _scaled_mm_allowed_device(sm90_only, sm100_only)
        return f"CUTLASS's grouped GEMM (bf16 on sm{capability[0]}{capability[1]})"
    sm = f"sm{capability[0]}{capability[1]}"
    why = "" if dtype != torch.bfloat16 else f"; CUTLASS's needs sm90 or sm100, this card is {sm}"
    return f"its fallback, one mm per expert, in {_NAMES.get(dtype, str(dtype))}{why}"


class GroupedMM:
    """``aten._grouped_mm`` on the virtual device: the kernel's dtype rules, and which path each call takes."""

    def __init__(self, capability: tuple[int, int] | None) -> None:
        self.capability = capability  # None: the CPU target (its kernel is the fallback loop)
        self.paths: set[str] = set()

    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        """The op's result, or NotImplemented to let the meta function answer (bf16, fp16)."""
        if func is not aten._grouped_mm.default:
            return NotImplemented
        mat_a, mat_b, offs, bias, out_dtype = _bind(*args, **kwargs)
        if self.capability is not None:
            self.paths.add(path(self.capability, mat_a.dtype))
        if mat_a.dtype != torch.float32:
            return NotImplemented
        # GroupedMMUtils.h, _grouped_mm_validate_inputs, then _resolve_grouped_mm_out_dtype
        _check(mat_b.dtype in _DTYPES, f"Expected mat_b to be Float32, BFloat16 or Float16 matrix, got {mat_b.dtype}")
        _check(mat_a.dim() in (2, 3), "mat_a has to be 2 or 3d")
        _check(mat_b.dim() in (2, 3), "mat_b has to be 2 or 3d")
        a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
        if not a2 or not b2:
            _check(mat_a.size(-1) == mat_b.size(-2), "contraction dimension of mat_a and mat_b must match")
        _transposed("mat_a", mat_a)
        _transposed("mat_b", mat_b)
        _check((offs is not None) == (a2 or b2),
               "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
        if offs is not None:
            _check(offs.dim() == 1, "offs has to be 1D")
            _check(offs.dtype == torch.int32, "Offsets have to be int32")
        _check(bias is None, "Bias not supported yet")
        dtype = out_dtype or mat_a.dtype
        _check(dtype == mat_a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
        # the fallback's at::mm_out needs one dtype (pytorch/pytorch#174763's error)
        _check(mat_b.dtype == mat_a.dtype, f"expected mat1 and mat2 to have the same dtype, but got: "
               f"{_NAMES[mat_a.dtype]} != {_NAMES[mat_b.dtype]}")
        return output(mat_a, mat_b, offs, dtype)

    def assumptions(self, card: str) -> list[str]:
        return [f"experts on {card}: torch._grouped_mm runs {p}" for p in sorted(self.paths)]


def _bind(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    return mat_a, mat_b, offs, bias, out_dtype


_FOLLOW = {aten.permute.default, aten.sum.dim_IntList, aten.gt.Scalar, aten.ge.Scalar, aten.ne.Scalar,
           aten.eq.Scalar, aten.unbind.int, aten.select.int, aten.index.Tensor, aten.view.default,
           aten._unsafe_view.default, aten.alias.default, aten.clone.default, aten.detach.default,
           aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten._to_copy.default, aten.nonzero.default}


class _Mask:
    """One layer's routing: ``tokens`` tokens, each to ``top_k`` of ``experts`` experts."""

    def __init__(self, tokens: int, top_k: int, experts: int, policy: str) -> None:
        self.tokens, self.top_k, self.experts, self.policy = tokens, top_k, experts, policy
        self.served = 0  # experts whose tokens the loop has asked for so far

    def hit(self) -> int:
        """How many experts receive tokens."""
        if self.policy == "worst-case":
            return min(self.top_k, self.experts)
        return min(self.experts, self.tokens * self.top_k)

    def next_expert(self) -> int:
        """Tokens of the next expert the loop serves."""
        i, self.served = self.served, self.served + 1
        if self.policy == "worst-case":
            return self.tokens  # each token picks every hit expert once among its top-k
        pairs = self.tokens * self.top_k
        return pairs // self.experts + (1 if i % self.experts < pairs % self.experts else 0)


class Routing:
    """Tokens per expert in transformers' eager experts loop, which reads them from the data.

    The loop (``MixtralExperts.forward`` and the ~65 classes made from it) builds
    ``one_hot(top_k_index, num_experts + 1)`` (the last class takes expert-parallel sentinels), finds the
    experts hit with ``nonzero``, skips the sentinel (``expert_idx == num_experts``) and gathers each
    expert's tokens with ``torch.where(expert_mask[expert_idx])``. Tensors derived from the one-hot mask are
    followed; their ``nonzero`` answers the policy's counts, and a read of their value says "not the
    sentinel" (False, or expert 0: every expert has the same shapes).
    """

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.masks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the _Mask it derives from

    def owns(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.masks

    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if func is aten.nonzero.default and self.owns(args[0]):
            x, mask = args[0], self.masks[args[0]]
            rows = mask.hit() if x.dim() == 1 else mask.next_expert()
            return torch.empty((rows, x.dim()), dtype=torch.long, device=x.device)
        return NotImplemented

    def after(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        if func is aten.eq.Tensor and _one_hot(args):
            # one_hot(top_k_index, num_classes) on fake tensors: top_k_index.unsqueeze(-1) == arange(num_classes)
            idx, classes = args
            self.masks[out] = _Mask(idx.shape[0], idx.shape[1], classes.shape[0] - 1, ROUTING.get())
        elif func in _FOLLOW and args and self.owns(args[0]):
            mask = self.masks[args[0]]
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.masks[t] = mask

    def scalar(self, t: torch.Tensor) -> Any:
        return False if t.dtype == torch.bool else 0


def _one_hot(args: tuple) -> bool:
    """``eq`` of an (S, top_k, 1) integer index with a (num_classes,) range: one_hot as it decomposes."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    idx, classes = args
    return (idx.dim() == 3 and idx.shape[-1] == 1 and classes.dim() == 1 and classes.shape[0] > 1
            and not idx.is_floating_point() and not classes.is_floating_point())
