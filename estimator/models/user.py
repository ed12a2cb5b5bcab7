"""The user's own model and training step as the simulator takes them: ``user_model``.

>>> built = user_model(my_module, make_batch, step_fn=lambda m, b: m(b["x"]).pow(2).mean())  # doctest: +SKIP
>>> Simulator(built, Recipe()).simulate(8, get_gpu("A100-80GB"))

``model`` is an ``nn.Module`` instance or a factory. An instance is simulated through a copy of its structure
with its parameters and buffers on the meta device (``meta.meta_copy``): the caller's module is untouched and
no weight is copied to any device. The step is ``loss_fn(model(inputs), targets)`` or, for a loop that is not,
``step_fn(model, batch)``; ``optimizer_fn(model)`` builds the model's own optimizer (a Lightning module's
``configure_optimizers``) instead of the recipe's, and ``on_device(model)`` runs once the model is on the
device (a framework re-pointing what it holds there).
"""

from __future__ import annotations

from typing import Any

from estimator.errors import SpecError
from estimator.models import BatchFactory, BuiltModel, LossFn, OnDevice, OptimizerFn, StepFn


def user_model(model: Any, batch_factory: BatchFactory, loss_fn: LossFn | None = None, *,
               step_fn: StepFn | None = None, optimizer_fn: OptimizerFn | None = None,
               on_device: OnDevice | None = None, name: str | None = None,
               share: tuple[object, ...] = ()) -> BuiltModel:
    """The ``BuiltModel`` of a user's model and step (this module's docstring); ``share``: objects the copy of
    an instance references instead of copying (``meta.meta_copy``)."""
    import torch

    from estimator.models.building import count_parameters
    from estimator.models.meta import meta_copy

    if (loss_fn is None) == (step_fn is None):
        raise SpecError("step_fn", step_fn, "either loss_fn(outputs, targets) or step_fn(model, batch), "
                        f"not {'both' if step_fn is not None else 'neither'}")
    if isinstance(model, torch.nn.Module):
        instance = model

        def factory() -> torch.nn.Module:
            try:
                return meta_copy(instance, share)
            except Exception as exc:
                raise SpecError("model", type(instance).__name__, "a module copy.deepcopy can copy (batchfit "
                                f"simulates a copy with fake parameters), or a factory ({exc})") from exc

        return BuiltModel(name or type(model).__name__, factory, batch_factory, loss_fn, {},
                          count_parameters(model), step_fn=step_fn, optimizer_fn=optimizer_fn, on_device=on_device)
    if not callable(model):
        raise SpecError("model", type(model).__name__, "an nn.Module or a factory returning one")
    return BuiltModel(str(name or getattr(model, "__name__", "model")), model, batch_factory, loss_fn, {}, 0,
                      step_fn=step_fn, optimizer_fn=optimizer_fn, on_device=on_device)

