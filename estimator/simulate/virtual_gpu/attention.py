"""The SDPA kernel the target card would run, in place of the math path fake tensors get.

The choice is ``estimator/simulate/sdpa_choice.py``'s (sdp_utils.cpp's checks); here it is made for each
call of ``F.scaled_dot_product_attention`` and the chosen kernel's aten op run (docs/DESIGN.md, fact 5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from estimator.simulate.sdpa_choice import SdpaCall, SDPBackend, backend_for


def call_of(q, k, v, attn_mask) -> SdpaCall:
    """What the backend choice reads from one call (none of it depends on the batch size)."""
    requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return SdpaCall(str(q.dtype), q.dim(), (q.shape[-1], k.shape[-1], v.shape[-1]), attn_mask is not None,
                    requires_grad)


def choose_backend(capability: tuple[int, int], q, k, v, attn_mask=None, dropout_p: float = 0.0) -> SDPBackend:
    """The backend ``select_sdp_backend`` would return on a card of this capability.

    >>> q = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="meta")
    >>> choose_backend((9, 0), q, q, q).name
    'FLASH'
    """
    return backend_for(call_of(q, k, v, attn_mask), capability)


def make_sdpa(original, capability: tuple[int, int], on_call: Callable[[SdpaCall], None] | None = None):
    """``F.scaled_dot_product_attention`` that runs the backend the card would pick.

    ``aten::scaled_dot_product_attention`` asks a device stub, not an op, for
    the backend, so the choice is made here, above the dispatcher.
    ``on_call`` sees what each choice read.
    """

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        call = call_of(query, key, value, attn_mask)
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
