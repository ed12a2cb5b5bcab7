"""batchfit: GPU memory of a PyTorch training step, predicted without a GPU.

>>> from estimator import estimate_memory, Recipe                  # doctest: +SKIP
>>> r = estimate_memory(make_model, make_batch, loss_fn, 32, recipe=Recipe(precision="amp-bf16"), gpu="H100-80GB")
>>> r.device_peak_bytes, r.fits, r.breakdown.activations

Nothing is imported at import time beyond the names below (torch loads lazily).
"""

from __future__ import annotations

__version__ = "0.2.0"
__all__ = ["estimate_memory", "Recipe", "MemoryReport", "Breakdown", "AllocatorConfig", "get_gpu", "CATALOG"]


def __getattr__(name: str):
    if name in ("estimate_memory", "MemoryReport", "Breakdown"):
        from estimator import report

        return getattr(report, name)
    if name == "Recipe":
        from estimator.recipe import Recipe

        return Recipe
    if name == "AllocatorConfig":
        from estimator.allocator import AllocatorConfig

        return AllocatorConfig
    if name in ("get_gpu", "CATALOG"):
        from estimator import gpus

        return getattr(gpus, name)
    raise AttributeError(name)
