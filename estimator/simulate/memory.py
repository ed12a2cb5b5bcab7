"""The memory of one training step of a model given as callables: the library's ``estimate_memory``.

>>> report = estimate_memory(make_model, make_batch, F.cross_entropy, 32, gpu="H100-80GB")   # doctest: +SKIP
>>> report.device_peak_bytes, report.fits, report.breakdown.activations
>>> estimate_memory(my_module, make_batch, batch_size=32, step_fn=lambda m, b: m(**b).loss)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from estimator.errors import SpecError
from estimator.gpus import GPU, get_gpu
from estimator.models import BatchFactory, LossFn, StepFn
from estimator.models.user import user_model
from estimator.replay.allocator import AllocatorConfig
from estimator.replay.report import MemoryReport, report_from_trace
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built, record_training


def estimate_memory(model: Any, batch_factory: BatchFactory, loss_fn: LossFn | None = None,
                    batch_size: int | None = None, *, step_fn: StepFn | None = None, recipe: Recipe | None = None,
                    gpu: str | GPU | None = "A100-80GB", allocator: AllocatorConfig | None = None,
                    worst_case: bool | None = None) -> MemoryReport:
    """Simulate training steps of the model on ``gpu`` and report peak memory.

    ``model``: a factory, called under ``torch.device("meta")``, or an ``nn.Module`` instance, simulated
    through a copy of its structure with fake parameters (the instance untouched, no weight copied to any
    device). ``batch_factory(batch_size, device)`` returns ``(inputs, targets)`` where ``inputs`` is a
    tensor, a tuple (positional) or a dict (keyword arguments); ``loss_fn(outputs, targets)`` returns the
    scalar loss. For a loop whose loss is not ``loss_fn(model(inputs), targets)``, ``step_fn(model, batch)``
    returns it from the batch factory's whole value instead (give one of the two). ``gpu=None`` targets the
    CPU. ``worst_case``: data-dependent sizes at their maximum (virtual_gpu/worst_case.py); None (default)
    applies the policy only when the step turns out to need it, False raises ``DataDependentError`` then.
    """
    if batch_size is None:
        raise SpecError("batch_size", None, "an integer >= 1")
    card = get_gpu(gpu) if isinstance(gpu, str) else gpu
    built = user_model(model, batch_factory, loss_fn, step_fn=step_fn)
    built.worst_case = bool(worst_case)
    if worst_case is None:
        trace = record_built(built, batch_size, recipe or Recipe(), card)
    else:
        trace = record_training(built.factory, batch_factory, loss_fn, batch_size, recipe or Recipe(), card,
                                worst_case=worst_case, step_fn=step_fn)
    return report_from_trace(trace, batch_size, card, allocator)
