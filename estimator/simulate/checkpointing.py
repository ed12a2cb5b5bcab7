"""Gradient checkpointing applied to a model the way its users would.

transformers models have their own per-layer switch; for any other model the
largest ``nn.ModuleList``/``nn.Sequential`` of blocks gets each block wrapped
in ``torch.utils.checkpoint.checkpoint`` (what fairscale/FSDP's
``checkpoint_wrapper`` does per block).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from estimator.errors import SpecError


def _block_container(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    best, best_params = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) >= 2:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = (name, m), n
    return best


def enable_checkpointing(model: torch.nn.Module, mode: bool | str) -> str:
    """Turn checkpointing on; returns the assumption to report."""
    reentrant = mode == "reentrant"
    flavour = "reentrant" if reentrant else "non-reentrant"
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        enable: Any = model.gradient_checkpointing_enable
        enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return f"gradient checkpointing: transformers' per-layer checkpointing ({flavour})"
    found = _block_container(model)
    if found is None:
        raise SpecError(
            "training.gradient_checkpointing", mode,
            "a model with a ModuleList/Sequential of at least 2 blocks, or a transformers model",
        )
    name, container = found
    blocks: list[torch.nn.Module] = list(container.children())
    for block in blocks:
        forward = block.forward

        @functools.wraps(forward)
        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=reentrant, **kwargs)

        block.forward = wrapped
    return f"gradient checkpointing: each of the {len(blocks)} blocks of '{name or 'model'}' ({flavour})"
