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

from estimator.simulate.virtual_gpu.worst_case import version

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
    """One layer's routing: ``tokens`` tokens, each to ``top_k`` of ``experts`` experts.

    With a ``capacity`` (Switch Transformers' ``expert_capacity``), the tokens come in ``groups`` sequences of
    ``tokens // groups`` and each expert keeps at most ``capacity`` tokens of each sequence.
    """

    def __init__(self, tokens: int, top_k: int, experts: int, policy: str, *, groups: int = 1,
                 capacity: int | None = None) -> None:
        self.tokens, self.top_k, self.experts, self.policy = tokens, top_k, experts, policy
        self.groups, self.capacity = groups, capacity
        self.served = 0  # experts whose tokens the loop has asked for so far

    def hit(self) -> int:
        """How many experts receive tokens."""
        if self.policy == "worst-case":
            if self.capacity is not None:  # the tokens past one expert's capacity fill the next ones
                routed = self.tokens // self.groups * self.top_k
                return min(self.experts, -(-routed // max(self.capacity, 1)))
            return min(self.top_k, self.experts)
        return min(self.experts, self.tokens // self.groups * self.top_k)

    def next_expert(self) -> int:
        """Tokens of the next expert the loop serves."""
        i, self.served = self.served, self.served + 1
        if self.policy == "worst-case":
            return self.count(i)  # the loop serves only the hit experts, in turn
        return self.count(i % self.experts)

    def count(self, expert: int) -> int:
        """Tokens that expert ``expert`` receives: balanced, tokens x top-k spread over the experts in turn;
        worst case, every token to the first top-k experts (each token picks each of them once); per sequence,
        and at most ``capacity`` of each, where the router has a capacity (then the worst case fills the experts
        in turn)."""
        per = self.tokens // self.groups
        if self.policy == "worst-case" and self.capacity is not None:
            # With a capacity, sending every token to one expert routes the fewest (the rest are dropped): the
            # most a router can route fills the experts in turn, each to its capacity.
            return self.groups * min(self.capacity, max(0, per * self.top_k - expert * self.capacity))
        if self.policy == "worst-case":
            kept = per if expert < self.top_k else 0
        else:
            pairs = per * self.top_k
            kept = pairs // self.experts + (1 if expert < pairs % self.experts else 0)
        return self.groups * (kept if self.capacity is None else min(kept, self.capacity))


class Routing:
    """Tokens per expert in the experts loops that read them from the data.

    transformers' eager loop (``MixtralExperts.forward`` and the ~65 classes made from it) builds
    ``one_hot(top_k_index, num_experts + 1)`` (the last class takes expert-parallel sentinels), finds the
    experts hit with ``nonzero``, skips the sentinel (``expert_idx == num_experts``) and gathers each
    expert's tokens with ``torch.where(expert_mask[expert_idx])``. Tensors derived from the one-hot mask are
    followed; their ``nonzero`` answers the policy's counts, and a read of their value says "not the
    sentinel" (False, or expert 0: every expert has the same shapes).

    Switch Transformers' top-1 router (``SwitchTransformersTop1Router``) makes ``one_hot(argmax, num_experts)``
    of its (batch, seq) choices, then drops the tokens past an expert's capacity in each sequence:
    ``mask * (cumsum(mask, dim=-2) <= expert_capacity)``. A one-hot mask whose next op is that ``cumsum`` is read
    so: batch x seq tokens, top-1, no sentinel class; the ``le`` gives the capacity, the product is the mask the
    experts loop (the eager loop's pattern) reads.

    JetMoE's gate (``JetMoeTopKGating``) scatters ones into a (tokens, experts) zeros tensor at the top-k
    indices, sums it over the tokens and reads the counts (``expert_size.tolist()``) to split the sorted
    tokens between the experts (``split_with_sizes``); each count read answers the policy's count for that
    expert, so that the split sizes add up to tokens x top-k.

    ``policy``: the request's ``model.moe_routing`` ("balanced" or "worst-case"), which the builder hands the
    simulation with the model (``BuiltModel.moe_routing``).
    """

    def __init__(self, policy: str = "balanced") -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.policy = policy

        self.masks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the _Mask it derives from
        self.zeros: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors made as zeros -> their version then
        self.gates: WeakIdKeyDictionary = WeakIdKeyDictionary()  # (tokens, experts) top-k indicator -> _Mask
        # per-expert counts -> (the _Mask, None), and one count read from them -> (the _Mask, its expert)
        self.counts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Switch's router: the one-hot mask's running count -> its routing read as top-1 per sequence, and the
        # capacity check on that count -> (that routing, the capacity)
        self.priorities: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.capacities: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._following = False  # a one-hot mask or a top-k gate made: every op may derive from it from now on

    def owns(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (t in self.masks or self.counts.get(t, (None, None))[1] is not None)

    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if func is aten.nonzero.default and args[0] in self.masks:
            x, mask = args[0], self.masks[args[0]]
            rows = mask.hit() if x.dim() == 1 else mask.next_expert()
            return torch.empty((rows, x.dim()), dtype=torch.long, device=x.device)
        return NotImplemented

    def after(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        if not self._following and func not in _STARTS:
            return  # nothing followed yet, and this op starts nothing (most ops of a step without experts)
        first = args[0] if args else None
        if func in _ZEROS:
            self.zeros[out] = version(out)  # any later write, through a view too, moves the version on
            return
        if not isinstance(first, torch.Tensor):
            return
        if func is aten.eq.Tensor and _one_hot(args):
            # one_hot(top_k_index, num_classes) on fake tensors: top_k_index.unsqueeze(-1) == arange(num_classes)
            idx, classes = args
            self.masks[out] = _Mask(idx.shape[0], idx.shape[1], classes.shape[0] - 1, self.policy)
            self._following = True
        elif func is aten.cumsum.default and first in self.masks and first.dim() == 3 \
                and args[1] in (-2, 1):
            mask = self.masks[first]  # read as (tokens, top_k, 1) == classes - 1 experts; it is (batch, seq)
            batch, seq, experts = first.shape
            self.priorities[out] = _Mask(batch * seq, 1, experts, mask.policy, groups=batch)
        elif func is aten.le.Scalar and first in self.priorities and isinstance(args[1], int):
            self.capacities[out] = (self.priorities[first], args[1])
        elif func is aten.mul.Tensor and first in self.masks and len(args) > 1 and args[1] in self.capacities:
            routed, capacity = self.capacities[args[1]]
            self.masks[out] = _Mask(routed.tokens, 1, routed.experts, routed.policy, groups=routed.groups,
                                    capacity=capacity)
        elif func in _SCATTERS and self._still_zeros(first) and _top_k_scatter(args):
            tokens, experts = first.shape
            self.gates[out] = _Mask(tokens, args[2].shape[1], experts, self.policy)
            self._following = True
        elif self.masks and func in _FOLLOW and first in self.masks:
            mask = self.masks[first]
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.masks[t] = mask
        elif self.gates and first in self.gates:
            if func in _KEEP:
                self.gates[out] = self.gates[first]
            elif func is aten.sum.dim_IntList and list(args[1]) in ([0], [-2]) and out.dim() == 1:
                self.counts[out] = (self.gates[first], None)
        elif self.counts and first in self.counts:
            self._follow_counts(func, args, out)

    def _still_zeros(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was made as zeros and not written since (an in-place scatter's own write bumps the
        version only after the op returns: worst_case.WorstCase._set)."""
        made = self.zeros.get(t) if self.zeros else None
        return made is not None and made == version(t)

    def _follow_counts(self, func, args: tuple, out: Any) -> None:
        """One expert's count from the per-expert counts (``tolist`` unbinds them and reads each)."""
        mask, expert = self.counts[args[0]]
        if func in _KEEP:
            self.counts[out] = (mask, expert)
        elif expert is None and func is aten.unbind.int and (args[1] if len(args) > 1 else 0) == 0:
            for i, t in enumerate(out):
                self.counts[t] = (mask, i)
        elif expert is None and func is aten.select.int and args[1] == 0:
            self.counts[out] = (mask, args[2] % mask.experts)

    def scalar(self, t: torch.Tensor) -> Any:
        counted = self.counts.get(t)
        if counted is not None and counted[1] is not None:
            return counted[0].count(counted[1])
        return False if t.dtype == torch.bool else 0


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_SCATTERS = {aten.scatter.value, aten.scatter_.value}
_STARTS = frozenset({*_ZEROS, *_SCATTERS, aten.eq.Tensor})  # what ``Routing.after`` follows from nothing
_KEEP = {aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default, aten.view.default,
         aten._unsafe_view.default}


def _top_k_scatter(args: tuple) -> bool:
    """``zeros(tokens, experts).scatter(1, top_k_index, 1)``: a (tokens, top_k) integer index into dim 1."""
    if len(args) != 4 or not all(isinstance(a, torch.Tensor) for a in (args[0], args[2])):
        return False
    x, dim, idx, value = args
    return (x.dim() == 2 and dim in (1, -1) and idx.dim() == 2 and idx.shape[0] == x.shape[0]
            and idx.shape[1] <= x.shape[1] and not idx.is_floating_point() and value == 1)


def _one_hot(args: tuple) -> bool:
    """``eq`` of an (S, top_k, 1) integer index with a (num_classes,) range: one_hot as it decomposes."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    idx, classes = args
    return (idx.dim() == 3 and idx.shape[-1] == 1 and classes.dim() == 1 and classes.shape[0] > 1
            and not idx.is_floating_point() and not classes.is_floating_point())
