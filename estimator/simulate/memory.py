"""The memory of one training step of a model given as three callables: the library's ``estimate_memory``.

>>> report = estimate_memory(make_model, make_batch, F.cross_entropy, 32, gpu="H100-80GB")   # doctest: +SKIP
>>> report.device_peak_bytes, report.fits, report.breakdown.activations
"""

from __future__ import annotations

from estimator.gpus import GPU, get_gpu
from estimator.models import BatchFactory, BuiltModel, LossFn, ModelFactory
from estimator.replay.allocator import AllocatorConfig
from estimator.replay.report import MemoryReport, report_from_trace
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built, record_training


def estimate_memory(model_factory: ModelFactory, batch_factory: BatchFactory, loss_fn: LossFn, batch_size: int, *,
                    recipe: Recipe | None = None, gpu: str | GPU | None = "A100-80GB",
                    allocator: AllocatorConfig | None = None, worst_case: bool | None = None) -> MemoryReport:
    """Simulate training steps of the model on ``gpu`` and report peak memory.

    ``model_factory()`` is called under ``torch.device("meta")``;
    ``batch_factory(batch_size, device)`` returns ``(inputs, targets)`` where
    ``inputs`` is a tensor, a tuple (positional) or a dict (keyword arguments);
    ``loss_fn(outputs, targets)`` returns the scalar loss. ``gpu=None``
    targets the CPU. ``worst_case``: data-dependent sizes at their maximum
    (virtual_gpu/worst_case.py); None (default) applies the policy only when
    the step turns out to need it, False raises ``DataDependentError`` then.
    """
    card = get_gpu(gpu) if isinstance(gpu, str) else gpu
    built = BuiltModel("model", model_factory, batch_factory, loss_fn, {}, 0, worst_case=bool(worst_case))
    if worst_case is None:
        trace = record_built(built, batch_size, recipe or Recipe(), card)
    else:
        trace = record_training(model_factory, batch_factory, loss_fn, batch_size, recipe or Recipe(), card,
                                worst_case=worst_case)
    return report_from_trace(trace, batch_size, card, allocator)
