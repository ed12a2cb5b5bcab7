"""Optimizers built from a recipe, with PyTorch's own defaults on the target.

``foreach``/``fused`` left as ``None`` are decided by torch itself
(``_default_to_fused_or_foreach``), which the virtual GPU answers as a real
GPU would (docs/DESIGN.md, fact 6). Adafactor is ``torch.optim.Adafactor``; the 8-bit and paged ones are
bitsandbytes' own (``estimator.simulate.bnb_optimizers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from estimator.errors import SpecError
from estimator.simulate import bnb_optimizers
from estimator.simulate.recipe import Recipe

_CLASSES = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adafactor": torch.optim.Adafactor,
}
_DEFAULT_LR = {"sgd": 0.1, "adagrad": 0.01, "rmsprop": 0.01, "adafactor": 0.01}


def optimizer_class_and_kwargs(recipe: Recipe) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The ``torch.optim`` class for ``recipe.optimizer`` and the keyword arguments it is built with
    (also what a ``ZeroRedundancyOptimizer`` is given, estimator/testing/distributed_truth.py)."""
    if recipe.optimizer in bnb_optimizers.NAMES:
        cls = bnb_optimizers._simulable(recipe.optimizer)
    else:
        cls = _CLASSES[recipe.optimizer]
    kwargs: dict[str, Any] = {"lr": _DEFAULT_LR.get(recipe.optimizer, 1e-3)}
    kwargs.update({k: v for k, v in recipe.optimizer_kwargs.items() if v is not None})
    if recipe.optimizer == "sgd" and kwargs.get("nesterov") and not kwargs.get("momentum"):
        kwargs["momentum"] = 0.9
    return cls, kwargs


def build_optimizer(recipe: Recipe, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer for ``recipe.optimizer`` with its memory-relevant options."""
    cls, kwargs = optimizer_class_and_kwargs(recipe)
    try:
        if recipe.distributed.strategy == "zero1":
            from estimator.simulate.distributed import zero_optimizer

            return zero_optimizer(cls, list(params), kwargs)
        return cls(list(params), **kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(
            "training.optimizer", recipe.optimizer_kwargs,
            f"options accepted by torch.optim.{cls.__name__} ({exc})",
        ) from exc
