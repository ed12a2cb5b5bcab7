"""The SDPA backend a card picks for a call, by the checks of torch's sdp_utils.cpp that decide memory.

>>> call = SdpaCall("torch.bfloat16", 4, (64, 64, 64), has_mask=False, requires_grad=True)
>>> backend_for(call, (9, 0)).name, backend_for(call, (7, 5)).name
('FLASH', 'MATH')

On fake CUDA tensors ``aten::_fused_sdp_choice`` answers MATH (docs/DESIGN.md, fact 5),
which materializes B·H·S² attention scores. A real card walks
``priority_order`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(flash, efficient, math, cudnn in torch 2.14) and takes the first backend
whose checks pass. The checks below are the ones that decide memory; the
numbers cite that file. Torch-free (dtypes by name): a portable profile
answers with them where torch is not loaded; the virtual GPU runs the chosen
kernel (``estimator/simulate/virtual_gpu/attention.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

_FP16, _BF16, _FP32 = "torch.float16", "torch.bfloat16", "torch.float32"
_HALF = (_FP16, _BF16)


class SDPBackend(IntEnum):
    """Values of ``sdp::SDPBackend`` (aten/src/ATen/native/transformers/sdp_utils.h)."""

    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3


@dataclass(frozen=True)
class SdpaCall:
    """What the backend choice reads from one call (none of it depends on the batch size)."""

    dtype: str  # the query's dtype by name, "torch.bfloat16": a profile reads it without torch
    dim: int
    head_dims: tuple[int, int, int]  # q, k, v
    has_mask: bool
    requires_grad: bool


def _flash_ok(capability: tuple[int, int], c: SdpaCall) -> bool:
    if not (8, 0) <= capability:  # check_sm_version: flash needs sm80+
        return False
    if c.dtype not in _HALF:  # check_flash_attention_datatype
        return False
    if c.has_mask:  # check_for_attn_mask
        return False
    if c.dim != 4:  # check_tensor_shapes
        return False
    dq, dk, dv = c.head_dims
    if not (dq == dk == dv) or dq > 256:  # check_head_dim_size_flash
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89
    if c.requires_grad and dq > 192 and capability in ((8, 6), (8, 9)):
        return False
    return True


def _efficient_ok(capability: tuple[int, int], c: SdpaCall) -> bool:
    if capability < (5, 0):  # check_sm_version: mem-efficient needs sm50+
        return False
    allowed = (_FP16, _FP32) + ((_BF16,) if capability >= (8, 0) else ())
    if c.dtype not in allowed:
        return False
    if c.dim != 4:
        return False
    # check_head_dim_size_mem_efficient: q/k last dims equal and aligned
    # (8 elements for 16-bit types on tensor cores, 4 for fp32).
    align = 8 if c.dtype in _HALF else 4
    dq, dk, dv = c.head_dims
    if dq != dk or dq % align or dv % align:
        return False
    return True


def backend_for(call: SdpaCall, capability: tuple[int, int]) -> SDPBackend:
    """The backend ``select_sdp_backend`` would return for this call on a card of this capability."""
    if _flash_ok(capability, call):
        return SDPBackend.FLASH
    if _efficient_ok(capability, call):
        return SDPBackend.EFFICIENT
    return SDPBackend.MATH


def backends_key(calls: Sequence[SdpaCall], capability: tuple[int, int],
                 thresholds: Sequence[tuple[int, int]] = ()) -> str:
    """The attention backends a step's SDPA calls get on a card of ``capability``, comma-joined ('' without
    SDPA), then which side of each capability threshold of the step's kernels the card is on (';sm8.0+',
    ';sm8.0-'): what cards that simulate alike share."""
    key = ",".join(backend_for(c, capability).name for c in calls)
    return key + "".join(f";sm{t[0]}.{t[1]}{'+' if capability >= tuple(t) else '-'}" for t in thresholds)
