"""Whether a model's repeating blocks are alike: what a shallow copy of it may stand for.

A config can make its blocks differ by their index without a per-layer list:
DeepSeek's ``first_k_dense_replace`` (dense MLPs below, experts above),
Qwen2-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``, Qwen2's
``max_window_layers``; so can a fine-tuning request (LoRA's
``target_modules`` or ``layers_to_transform`` naming some layers, a
quantization's skipped modules). A model built with fewer blocks then is not
the full model's blocks repeated, and its simulated step says nothing about
the full one's. ``signature`` names what decides a block's memory: each
submodule's path and class, its parameters and buffers (shape, dtype,
trainable) and its plain attributes, the ones holding the block's own index
(``layer_idx``) left out. The shortcut (estimator/simulate/depth.py) is only
offered when every block of the full model has one signature, and a shallow
build is only used when its blocks, and everything outside them, have the
full model's signatures.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import torch

# attributes that hold the block's own position: they differ by design and decide no memory by themselves
# (what they decide, such as a sliding window or an MoE layer, shows in the other attributes and the modules)
_INDEX = re.compile(r"(^|_)(idx|index|id|number)$")
_PLAIN = (bool, int, float, str, type(None))


def _attribute(value: Any, lists: bool) -> Hashable | None:
    """``value`` as compared (its repr: NaN equals NaN), or None for what is not a plain value (nor, unless
    ``lists``, a list of them)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if lists and isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return repr(list(value))
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, _PLAIN) for k, v in value.items()):
        return repr(sorted(value.items()))  # peft's per-adapter r, lora_alpha, scaling
    return None


def _own(module: torch.nn.Module, lists: bool) -> Hashable:
    attributes = []
    for key, value in vars(module).items():
        if key.startswith("_") or key == "training" or _INDEX.search(key):
            continue
        plain = _attribute(value, lists)
        if plain is not None:
            attributes.append((key, plain))
    tensors = [(name, type(p).__name__, tuple(p.shape), str(p.dtype), p.requires_grad)
               for name, p in module.named_parameters(recurse=False)]
    tensors += [(name, "buffer", tuple(b.shape), str(b.dtype), False)
                for name, b in module.named_buffers(recurse=False)]
    return type(module).__module__, type(module).__qualname__, tuple(sorted(attributes)), tuple(tensors)


def signature(module: torch.nn.Module, skip: str | None = None) -> Hashable:
    """What decides ``module``'s memory, submodule by submodule. ``skip``: the blocks' path, whose subtree is
    left out, and so are lists (PEFT's ``targeted_module_names`` lists every block's modules)."""
    out = []
    for path, sub in module.named_modules(remove_duplicate=False):
        if skip is not None and (path == skip or path.startswith(skip + ".")):
            continue
        out.append((path, _own(sub, lists=skip is None)))
    return tuple(out)


def container_in(model: torch.nn.Module, container: str, layers: int) -> str | None:
    """The path of ``container`` (found on the base model) in ``model``, which may wrap it (a PEFT model's
    ``base_model.model.``): the one ``ModuleList`` of ``layers`` modules whose path ends with it."""
    found = [path for path, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == layers
             and (path == container or path.endswith("." + container))]
    return found[0] if len(found) == 1 else None


def alike(model: torch.nn.Module, path: str) -> Hashable | None:
    """The one signature of every block in ``model.<path>``, or None when two blocks differ."""
    first, *others = (signature(block) for block in model.get_submodule(path).children())
    return first if all(other == first for other in others) else None
