"""Gradient checkpointing applied to a model the way its users would.

``True``/``"reentrant"``/``"non-reentrant"``: transformers models have their own
per-layer switch; for any other model the largest ``nn.ModuleList``/``nn.Sequential``
of blocks gets each block wrapped in ``torch.utils.checkpoint.checkpoint`` (what
fairscale/FSDP's ``checkpoint_wrapper`` does per block).

``"selective"``: torchtitan's per-op selective activation checkpointing (SAC) on
each block: the outputs of expensive ops (matmuls, attention, some
communication) are saved, every second ``mm`` and everything else is
recomputed in backward (``selective_policy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from estimator.errors import SpecError

# torchtitan's SelectiveAC.Config.force_recompute_mm_shapes_by_fqns default: mms whose weight has
# the shape of a Linear whose qualified name contains one of these are always recomputed.
FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)


def _block_container(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    best, best_params = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) >= 2:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = (name, m), n
    return best


def _blocks(model: torch.nn.Module, mode: bool | str) -> tuple[str, list[tuple[str, torch.nn.Module]]]:
    found = find_blocks(model)
    if found is None:
        raise SpecError(
            "training.gradient_checkpointing", mode,
            "a model with a ModuleList/Sequential of at least 2 blocks, or a transformers model",
        )
    return found


def find_blocks(model: torch.nn.Module) -> tuple[str, list[tuple[str, torch.nn.Module]]] | None:
    """The blocks to wrap (checkpointing, FSDP's fully_shard), with their qualified names, and a
    description of where they are; None when the model has none.

    transformers models: the outermost ``GradientCheckpointingLayer`` modules, the layers
    transformers' own checkpointing wraps (an encoder-decoder's encoder and decoder layers
    both). Any other model, or a transformers model without such layers: the children of
    the largest ``ModuleList``/``Sequential``.
    """
    layer_cls: Any = None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layer_cls = GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if layer_cls is not None and getattr(model, "supports_gradient_checkpointing", False):
        layers: list[tuple[str, torch.nn.Module]] = []
        for name, m in model.named_modules():
            if isinstance(m, layer_cls) and not any(name.startswith(f"{outer}.") for outer, _ in layers):
                layers.append((name, m))
        if layers:
            return "transformers' decoder layers", layers
    found = _block_container(model)
    if found is None:
        return None
    name, container = found
    prefix = f"{name}." if name else ""
    return f"the blocks of '{name or 'model'}'", [(f"{prefix}{n}", b) for n, b in container.named_children()]


def _wrap_forward(block: torch.nn.Module, **checkpoint_kwargs: Any) -> None:
    """``block.forward`` runs inside ``checkpoint``; the block's own hooks stay outside it."""
    forward = block.forward

    @functools.wraps(forward)
    def wrapped(*args, _forward=forward, **kwargs):
        return checkpoint(_forward, *args, **checkpoint_kwargs, **kwargs)

    block.forward = wrapped


# --- selective activation checkpointing (torchtitan's per-op SAC) ---------------------------------
#
# From pytorch/torchtitan, torchtitan/distributed/activation_checkpoint.py (``_get_default_save_ops``
# and ``SelectiveAC._wrap_block``) at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (2026-08-21; the
# file last changed in c5d93d1098fe5f6f9b4fe6870b4e3d590ffa9cdf, #3674).


def _resolve(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


# (root, dotted path): torchtitan's compute_ops and comm_ops; an op this torch lacks is skipped.
_SAVE_OPS = (
    # SDPA variants
    (torch.ops.aten, "_scaled_dot_product_cudnn_attention.default"),
    (torch.ops.aten, "_scaled_dot_product_attention_math.default"),
    (torch.ops.aten, "_scaled_dot_product_fused_attention_overrideable.default"),
    # low precision training: the absolute maximum behind a scaling factor
    (torch.ops.aten, "max.default"),
    (torch, "_higher_order_ops.flex_attention"),
    (torch.ops.aten, "linear.default"),
    # MoE expert assignments stay stable between forward and recompute
    (torch.ops.aten, "topk.default"),
    (torch, "_higher_order_ops.inductor_compiled_code"),
    (torch.ops, "torch_attn._varlen_attn.default"),
    # communication, saved to avoid communicating again
    (torch.ops, "_c10d_functional.reduce_scatter_tensor.default"),
    (torch.ops, "_c10d_functional.all_to_all_single.default"),
    (torch.ops, "deepep.dispatch.default"),
    (torch.ops, "deepep.combine.default"),
    (torch.ops, "hybridep.dispatch.default"),
    (torch.ops, "hybridep.combine.default"),
)


@functools.cache
def sac_save_ops() -> frozenset[Any]:
    """torchtitan's default save set, as this torch has those ops.

    The partitioner's compute-intensive ops (``get_default_op_list().compute_intensive_ops``:
    mm, addmm, bmm, convolution, the flash/efficient attention ops, ...) plus the ops
    listed in ``_SAVE_OPS`` that exist here.
    """
    from torch._functorch.partitioners import get_default_op_list

    packets: Any = get_default_op_list().compute_intensive_ops
    ops = {op.default for op in packets}
    for root, path in _SAVE_OPS:
        try:
            ops.add(_resolve(root, path))
        except (AttributeError, RuntimeError):
            pass  # not registered in this torch
    return frozenset(ops)


def _op_name(op: Any) -> str:
    schema = getattr(op, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(op, "__name__", str(op))


# torchtitan handles both: some backends register aten.linear as a leaf op instead of decomposing it.
_MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def selective_policy(recompute_shapes: frozenset[tuple[int, int]] = frozenset()) -> Callable[..., CheckpointPolicy]:
    """One checkpoint call's policy (torchtitan's ``wrapped_policy``): a fresh mm count per call.

    Save the ops of ``sac_save_ops()`` except every second ``mm``/``linear`` (the 2nd,
    4th, ... of the block); recompute everything else. A CUDA-to-CPU copy is always
    saved. An mm whose weight (as ``(in, out)``) is in ``recompute_shapes`` is recomputed
    and not counted. Counts are kept apart for forward and recompute as torchtitan does;
    torch 2.14.1 calls the policy in the forward only (``is_recompute`` is always False,
    the recompute reads the forward's decisions by index).
    """
    save_ops = sac_save_ops()
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (func == torch.ops.aten._to_copy.default and "cuda" in str(args[0].device)
                and "device" in kwargs and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MM_OPS:
            weight_shape = args[1].shape
            if func == torch.ops.aten.linear.default:  # linear's weight is (out, in)
                weight_shape = torch.Size((weight_shape[1], weight_shape[0]))
            if tuple(weight_shape) in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[key] += 1
        if func in save_ops:
            if func in _MM_OPS and counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recompute_shapes(block: torch.nn.Module, block_name: str) -> frozenset[tuple[int, int]]:
    """torchtitan's forced-recompute mm shapes: ``(in, out)`` of each Linear named like ``FORCE_RECOMPUTE_FQNS``.

    torchtitan raises for a match that is not an ``nn.Linear``; a user's model here
    just keeps such a module under the ordinary policy.
    """
    shapes = set()
    for sub_name, sub in block.named_modules():
        fqn = f"{block_name}.{sub_name}" if sub_name else block_name
        if isinstance(sub, torch.nn.Linear) and any(f in fqn for f in FORCE_RECOMPUTE_FQNS):
            out_f, in_f = sub.weight.shape
            shapes.add((in_f, out_f))
    return frozenset(shapes)


def _no_kv_cache(model: torch.nn.Module) -> bool:
    """Turn off transformers' KV cache, as transformers does under its own checkpointing.

    A layer that writes the cache would write it again when recomputed in backward. True when the model has
    the cache at all (off already when an earlier build of the same config turned it off: the builds share it).
    """
    found = False
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and isinstance(getattr(config, "use_cache", None), bool):
            config.use_cache = False
            found = True
    return found


def _enable_selective(model: torch.nn.Module) -> str:
    where, blocks = _blocks(model, "selective")
    for name, block in blocks:
        shapes = _recompute_shapes(block, name)
        _wrap_forward(
            block, use_reentrant=False,
            context_fn=lambda s=shapes: create_selective_checkpoint_contexts(selective_policy(s)),
            # torchtitan's checkpoint_wrapper: the whole block is recomputed (no early stop)
            early_stop=False,
            # the legacy behaviour, without its FutureWarning when saved_tensors_hooks are active
            # (the virtual GPU's): SAC's cached outputs bypass those hooks
            respect_saved_tensors_hooks=False,
        )
    saved = ", ".join(sorted({_op_name(op) for op in sac_save_ops()}))
    cache = "; transformers' KV cache off (config.use_cache=False)" if _no_kv_cache(model) else ""
    return (f"gradient checkpointing: selective (torchtitan's per-op SAC, non-reentrant) on each of the "
            f"{len(blocks)} blocks ({where}): outputs of {saved} saved, every second mm recomputed, "
            f"all other ops recomputed in backward{cache}")


def enable_checkpointing(model: torch.nn.Module, mode: bool | str) -> str:
    """Turn checkpointing on; returns the assumption to report."""
    if mode == "selective":
        return _enable_selective(model)
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
        _wrap_forward(block, use_reentrant=reentrant)
    return f"gradient checkpointing: each of the {len(blocks)} blocks of '{name or 'model'}' ({flavour})"
