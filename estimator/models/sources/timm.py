"""timm: any name in ``timm.list_models()`` (a ``.tag`` suffix allowed), with allow-listed kwargs.

Default input: the model's ``pretrained_cfg["input_size"]``, with the
channels of ``in_chans`` and the side of a fixed patch grid when kwargs set
them (timm keeps the pretrained_cfg of the weights); models with a fixed
patch grid (ViT, DeiT, Swin, Mixer) must be built for the requested size
(``img_size`` in kwargs), which the request is checked against.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, Field

from estimator.errors import SpecError
from estimator.models import BuiltModel
from estimator.models.allowed import check_model_names, refuse_paths
from estimator.models.building import check_image, count_parameters, probe, unknown_name
from estimator.models.registry import ModelSource, register
from estimator.models.spec import STRICT, InputSpec, JSONValue


class TimmModel(BaseModel):
    model_config = STRICT
    source: Literal["timm"]
    name: str = Field(description="a name in timm.list_models()", examples=["convnext_tiny"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict, description="passed to timm.create_model")


def build_timm(spec: TimmModel, inp: InputSpec) -> BuiltModel:
    import timm

    from estimator.models import tasks

    base = spec.name.split(".", 1)[0]
    if not timm.is_model(base):
        raise unknown_name("model.name", spec.name, timm.list_models(), "a name in timm.list_models()")
    kwargs: dict[str, Any] = check_model_names("timm", spec.kwargs)  # allow-listed, download switches dropped
    factory = functools.partial(timm.create_model, spec.name, pretrained=False, **kwargs)
    model = probe(factory, "model.kwargs", spec.kwargs)
    if not hasattr(model, "get_classifier"):
        # A feature encoder (mobilenetv5_300m_enc, Gemma 3n's vision tower) has none of timm's classifier
        # interface and its forward returns feature maps ("does not support classification use cases"), while
        # batchfit trains a timm model as a classifier, with cross-entropy on its head's logits.
        headless = base[: -len("_enc")] if base.endswith("_enc") else None
        hint = f"; {headless} with model.kwargs num_classes has one" if headless and timm.is_model(headless) else ""
        raise SpecError("model.name", spec.name,
                        f"a timm model with a classification head ({type(model).__name__} is a feature encoder "
                        f"without one: its forward returns feature maps, not logits{hint})")
    default = tuple(getattr(model, "pretrained_cfg", {}).get("input_size") or (3, 224, 224))
    grid = getattr(getattr(model, "patch_embed", None), "img_size", None)
    patch_embed = getattr(model, "patch_embed", None)
    dynamic = getattr(patch_embed, "dynamic_img_size", False) or kwargs.get("dynamic_img_size")
    assumptions: list[str] = []
    if inp.image_size is None:
        channels_from = sides_from = ("model.name", spec.name)  # its pretrained_cfg (never a kwarg: allowed.py)
        if len(default) != 3 or not all(type(x) is int for x in default):
            raise SpecError(*sides_from, "a model whose pretrained_cfg input_size is [C, H, W], 3 integers")
        c, h, w = default
        if isinstance(kwargs.get("in_chans"), int):  # timm keeps the weights' pretrained_cfg: follow the kwargs
            c, channels_from = kwargs["in_chans"], ("model.kwargs.in_chans", kwargs["in_chans"])
        if "img_size" in kwargs and grid is not None and not dynamic:
            (h, w), sides_from = grid, ("model.kwargs.img_size", kwargs["img_size"])
        check_image(c, h, w, channels_from, sides_from)
        assumptions.append(f"input.image_size not given: {[c, h, w]}, {spec.name}'s pretrained_cfg input_size"
                           + ("" if [c, h, w] == list(default) else " and model.kwargs"))
    else:
        c, h, w = inp.image_size
        if grid is not None and not dynamic and tuple(grid) != (h, w):
            raise SpecError("input.image_size", inp.image_size,
                            f"[C, {grid[0]}, {grid[1]}]: {spec.name} is built for that size "
                            "(model.kwargs img_size or dynamic_img_size change it)")
    if c != getattr(model, "pretrained_cfg", {}).get("input_size", (c,))[0] and "in_chans" not in kwargs:
        raise SpecError("input.image_size", inp.image_size, f"{default[0]} channels (model.kwargs in_chans changes it)")
    return BuiltModel(f"timm:{spec.name}", factory, tasks.images(c, h, w), tasks.classification_loss,
                      {"image_size": [c, h, w]}, count_parameters(model), assumptions)


def _check_names(spec: TimmModel) -> None:
    refuse_paths(spec.name, "model.name")
    check_model_names("timm", spec.kwargs)


def _listing() -> dict[str, Any]:
    import timm

    return {"names": timm.list_models()}


register(ModelSource("timm", TimmModel, build_timm, _check_names, _listing, libraries=("timm",)))
