"""batchfit: GPU memory of a PyTorch training step, predicted without a GPU.

>>> from estimator import estimate_memory, Recipe                  # doctest: +SKIP
>>> r = estimate_memory(make_model, make_batch, loss_fn, 32, recipe=Recipe(precision="amp-bf16"), gpu="H100-80GB")
>>> r.device_peak_bytes, r.fits, r.breakdown.activations

The public facade. Nothing is imported at import time (torch loads lazily,
when a name that needs it is first used). The service (``app/``) imports
these names and the torch-free ``estimator.errors``, ``estimator.gpus`` and
``estimator.options`` (tests/test_layers.py holds it to that); the CLI
(``estimator.cli``) reaches into the layers it presents.

The layers, in the order a request passes through them, which is also the
import order (docs/DESIGN.md, "Layout"):

    pipeline      one request end to end
    request/      the request: schema, parse, job_of
    portable/     the portable profile
    simulate/     the virtual GPU, the recorder, the training loop, the Simulator
    models/       the model sources and their builders
    plan/         the answer: steps, searches, strategy, advice, results
    replay/       the caching allocator's replay, reports
    trace, options, gpus, errors    the contracts every layer reads
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.6.0"

# name -> the module that defines it (module:name where the names differ)
_PUBLIC = {
    "estimate": "estimator.pipeline",
    "estimate_memory": "estimator.simulate.memory",
    "estimate_from_profile": "estimator.pipeline",
    "make_profile": "estimator.pipeline",
    "step_view": "estimator.pipeline",
    "timeline": "estimator.pipeline",
    "snapshot": "estimator.pipeline",
    "parse_request": "estimator.request.parse",
    "check_request": "estimator.request.spec",
    "EstimateRequest": "estimator.request.spec",
    "describe_validation_error": "estimator.request.parse",
    "job_of": "estimator.request.adapt",
    "EstimateResponse": "estimator.plan.results",
    "to_json": "estimator.plan.results",
    "Recipe": "estimator.simulate.recipe",
    "MemoryReport": "estimator.replay.report",
    "Timeline": "estimator.replay.timeline",
    "Breakdown": "estimator.replay.report",
    "AllocatorConfig": "estimator.replay.allocator",
    "PortableProfile": "estimator.portable.profile",
    "check_profile": "estimator.request.profile",
    "parse_profile_request": "estimator.request.profile",
    "ProfileEstimateRequest": "estimator.request.profile",
    "EstimateBody": "estimator.request.profile",
    "profile_id": "estimator.portable.schema",
    "canonical_json": "estimator.portable.schema",
    "GPU": "estimator.gpus",
    "get_gpu": "estimator.gpus",
    "CATALOG": "estimator.gpus",
    "CATALOG_VERSION": "estimator.gpus",
    "catalog": "estimator.gpus",
    "model_sources": "estimator.models",
    "warm_libraries": "estimator.models.registry:warm",
    "warm_up": "estimator.pipeline",
    "validate_on_gpu": "estimator.measure.cuda:validate",
    "validation_json": "estimator.measure.cuda:as_json",
}
__all__ = sorted(_PUBLIC) + ["__version__", "torch_version"]


def torch_version() -> str:
    """The installed torch's version (``2.14.1``), without importing torch."""
    from importlib.metadata import version

    return version("torch").split("+")[0]


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'estimator' has no attribute {name!r}")
    module, _, attr = where.partition(":")
    return getattr(import_module(module), attr or name)
