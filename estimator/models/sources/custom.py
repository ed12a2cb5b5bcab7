"""A local ``package.module:factory`` (library and CLI only; ``parse_request`` refuses it otherwise).

The batch follows ``input``: ``image_size`` -> images and class labels with
cross-entropy; ``seq_len`` -> token ids, with the model's own ``.loss`` when
it returns one, else next-token cross-entropy on (B, S, V) logits.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from estimator.errors import SpecError
from estimator.models import BuiltModel
from estimator.models.building import count_parameters, probe
from estimator.models.registry import ModelSource, register
from estimator.models.spec import STRICT, InputSpec, JSONValue

if TYPE_CHECKING:
    import torch


class CustomModel(BaseModel):
    """A local ``package.module:factory``; library and CLI only, refused over HTTP."""

    model_config = STRICT
    source: Literal["custom"]
    factory: str = Field(description="package.module:callable returning an nn.Module", examples=["mypkg.nets:make"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict)


def load_factory(ref: str, field_name: str = "model.factory"):
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(field_name, ref, "'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(field_name, ref, f"an importable module ({exc})") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise SpecError(field_name, ref, f"a callable named {attr!r} in {module_name}")
    if not callable(obj):
        raise SpecError(field_name, ref, "a callable")
    return obj


def token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out if isinstance(out, torch.Tensor) else out.logits  # (B, S, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def build_custom(spec: CustomModel, inp: InputSpec) -> BuiltModel:
    import torch

    from estimator.models import tasks

    factory = functools.partial(load_factory(spec.factory), **spec.kwargs)
    model = probe(factory, "model.kwargs", spec.kwargs)
    if inp.seq_len is not None:
        seq = inp.seq_len

        def batch(b, device):
            ids = torch.zeros(b, seq, dtype=torch.long, device=device)  # (B, S)
            return ids, ids
        return BuiltModel(f"custom:{spec.factory}", factory, batch, token_loss, {"seq_len": seq},
                          count_parameters(model))
    if inp.image_size is None:
        raise SpecError("input", None, "image_size [C, H, W] or seq_len for a custom model")
    c, h, w = inp.image_size
    return BuiltModel(f"custom:{spec.factory}", factory, tasks.images(c, h, w), tasks.classification_loss,
                      {"image_size": [c, h, w]}, count_parameters(model))


def _no_names(spec: CustomModel) -> None:
    """A local factory names no library model: nothing to check beyond the schema (and it never comes over
    the network: ``local_code``)."""


register(ModelSource("custom", CustomModel, build_custom, _no_names, dict, local_code=True))
