"""The SDPA backend the target card would pick.

On fake CUDA tensors ``aten::_fused_sdp_choice`` answers MATH (docs/DESIGN.md, fact 5),
which materializes B·H·S² attention scores. A real card walks
``priority_order`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(flash, efficient, math, cudnn in torch 2.14) and takes the first backend
whose checks pass. The checks below are the ones that decide memory; the
numbers cite that file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch


class SDPBackend(IntEnum):
    """Values of ``sdp::SDPBackend`` (aten/src/ATen/native/transformers/sdp_utils.h)."""

    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3


@dataclass(frozen=True)
class SdpaCall:
    """What the backend choice reads from one call (none of it depends on the batch size)."""

    dtype: torch.dtype
    dim: int
    head_dims: tuple[int, int, int]  # q, k, v
    has_mask: bool
    requires_grad: bool

    @classmethod
    def of(cls, q, k, v, attn_mask) -> SdpaCall:
        requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return cls(q.dtype, q.dim(), (q.shape[-1], k.shape[-1], v.shape[-1]), attn_mask is not None, requires_grad)


def _flash_ok(capability: tuple[int, int], c: SdpaCall) -> bool:
    if not (8, 0) <= capability:  # check_sm_version: flash needs sm80+
        return False
    if c.dtype not in (torch.float16, torch.bfloat16):  # check_flash_attention_datatype
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
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    if c.dtype not in allowed:
        return False
    if c.dim != 4:
        return False
    # check_head_dim_size_mem_efficient: q/k last dims equal and aligned
    # (8 elements for 16-bit types on tensor cores, 4 for fp32).
    align = 8 if c.dtype in (torch.float16, torch.bfloat16) else 4
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


def choose_backend(capability: tuple[int, int], q, k, v, attn_mask=None, dropout_p: float = 0.0) -> SDPBackend:
    """The backend ``select_sdp_backend`` would return on a card of this capability.

    >>> q = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="meta")
    >>> choose_backend((9, 0), q, q, q).name
    'FLASH'
    """
    return backend_for(SdpaCall.of(q, k, v, attn_mask), capability)


def make_sdpa(original, capability: tuple[int, int], on_call: Callable[[SdpaCall], None] | None = None):
    """``F.scaled_dot_product_attention`` that runs the backend the card would pick.

    ``aten::scaled_dot_product_attention`` asks a device stub, not an op, for
    the backend, so the choice is made here, above the dispatcher.
    ``on_call`` sees what each choice read.
    """

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        call = SdpaCall.of(query, key, value, attn_mask)
        if on_call is not None:
            on_call(call)
        backend = backend_for(call, capability)
        if enable_gqa or backend == SDPBackend.MATH or query.device.type != "cuda":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if backend == SDPBackend.FLASH:
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            # convert_boolean_attn_mask: True keeps, False gets -inf
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(bias.logical_not(), float("-inf"))
        if bias is not None:
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        need_lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale
        )
        return out[0]

    return sdpa
