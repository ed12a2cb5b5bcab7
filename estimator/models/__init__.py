"""Model builders: a request's ``model`` and ``input`` -> what the simulator runs.

>>> from estimator import parse_request                                          # doctest: +SKIP
>>> built = build(parse_request({"model": {"source": "timm", "name": "resnet18"}}))
>>> built.input, built.parameter_count
({'image_size': [3, 224, 224]}, 11689512)

Builders never download weights or configs and never run a model's own
code from a request: torchvision and timm construct from their registries
with ``weights=None`` / ``pretrained=False``; transformers models come from
configs shipped in ``presets/`` or given inline, through the library's own
classes (``auto_map`` is refused). A local ``package.module:factory`` is
imported only when the caller allows local code (library, CLI).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from estimator.errors import SpecError
from estimator.request.spec import EstimateRequest, TimmModel, TorchvisionModel, TransformersModel


@dataclass
class BuiltModel:
    """What the simulator needs: call ``factory()`` under ``torch.device("meta")``."""

    name: str
    factory: Callable[[], torch.nn.Module]
    batch_factory: Callable[[int, Any], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    input: dict[str, Any]
    parameter_count: int
    assumptions: list[str] = field(default_factory=list)
    worst_case: bool = False  # data-dependent sizes at their maximum (detection)


def build(request: EstimateRequest) -> BuiltModel:
    """Build the request's model on the meta device (checks names, kwargs, input limits)."""
    model = request.model
    if isinstance(model, TorchvisionModel):
        from estimator.models.torchvision_models import build_torchvision

        return build_torchvision(model, request.input)
    if isinstance(model, TimmModel):
        from estimator.models.timm_models import build_timm

        return build_timm(model, request.input)
    if isinstance(model, TransformersModel):
        from estimator.models.transformers_models import build_transformers

        return build_transformers(model, request.input)
    from estimator.models.custom import build_custom

    return build_custom(model, request.input)


def unknown_name(field_name: str, name: str, known: list[str], what: str) -> SpecError:
    """A ``SpecError`` for a name not in ``known``, with close matches."""
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=3, cutoff=0.6)
    by_lower = {k.lower(): k for k in known}
    hint = f" (did you mean {', '.join(by_lower[c] for c in close)}?)" if close else ""
    return SpecError(field_name, name, f"{what}{hint}")


def probe(factory: Callable[[], torch.nn.Module], field_name: str, value: Any) -> torch.nn.Module:
    """Build once on meta so bad kwargs fail here, as a ``SpecError``."""
    from estimator.models.meta import build_on_meta

    try:
        model = build_on_meta(factory)
    except (TypeError, ValueError, KeyError, AssertionError, AttributeError, NotImplementedError) as exc:
        raise SpecError(field_name, value, f"arguments the constructor accepts ({type(exc).__name__}: {exc})") from exc
    if not isinstance(model, torch.nn.Module):
        raise SpecError(field_name, value, "a factory returning a torch.nn.Module")
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights once), as ``sum(p.numel())`` over ``model.parameters()``."""
    return sum(p.numel() for p in model.parameters())


def model_sources() -> dict[str, Any]:
    """What each model source offers, as JSON data (``GET /models``)."""
    from typing import get_args

    import timm

    from estimator.models.torchvision_models import families
    from estimator.models.transformers_models import presets
    from estimator.request.spec import AttnImplementation, Task

    return {
        "torchvision": families(),
        "timm": {"names": timm.list_models()},
        "transformers": {"presets": sorted(presets()), "tasks": list(get_args(Task)),
                         "attn_implementation": list(get_args(AttnImplementation))},
    }
