"""torchvision: classification, segmentation, video and detection models, by their registry name.

Detection models train on a list of images and synthesized targets (boxes,
labels, and masks or keypoints where the model has those heads); their
data-dependent sizes are simulated at their maximum (virtual_gpu/worst_case.py).

Default input: a ViT's own ``image_size``; else the crop size of the first
weights torchvision publishes for the model (its training resolution:
299 for Inception v3, 600 for EfficientNet-B7, 520 for segmentation, 16
frames of 112 px for the R(2+1)D family); else 3x224x224.
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


class TorchvisionModel(BaseModel):
    model_config = STRICT
    source: Literal["torchvision"]
    name: str = Field(description="torchvision's model name", examples=["resnet50"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict, description="constructor arguments",
                                         examples=[{"num_classes": 10}])

DEFAULT_FRAMES = 16  # torchvision's video references train on 16-frame clips
# COCO train2017 has about 7.3 annotated objects per image; 8 rounds up.
DEFAULT_OBJECTS = 8
# Detection inputs: the transform inside R-CNN/RetinaNet/FCOS resizes to
# min 800 / max 1333 px, so a COCO-sized image; SSD models train at their
# fixed size; the *_320_fpn variants resize to 320.
_DETECTION_SIDE = {"ssd300_vgg16": (300, 300), "ssdlite320_mobilenet_v3_large": (320, 320),
                   "fasterrcnn_mobilenet_v3_large_320_fpn": (320, 320)}
COCO_KEYPOINTS = 17


def families() -> dict[str, list[str]]:
    import torchvision.models as tvm

    return {
        "classification": tvm.list_models(module=tvm),
        "segmentation": tvm.list_models(module=tvm.segmentation),
        "video": tvm.list_models(module=tvm.video),
        "detection": tvm.list_models(module=tvm.detection),
    }


def _default_weights_meta(name: str) -> tuple[int | None, int | None]:
    """(crop side, frames) from the first published weights, read from torchvision's tables."""
    import torchvision.models as tvm

    try:
        weights = list(tvm.get_model_weights(name))
    except (ValueError, KeyError):
        return None, None
    if not weights:
        return None, None
    kw = getattr(weights[0].transforms, "keywords", {}) or {}
    size = kw.get("crop_size", kw.get("resize_size"))
    if isinstance(size, (tuple, list)):
        size = size[0]
    return (int(size) if size else None), weights[0].meta.get("min_temporal_size")


def build_torchvision(spec: TorchvisionModel, inp: InputSpec) -> BuiltModel:
    import torchvision.models as tvm

    from estimator.models import tasks

    fam = families()
    family = next((f for f, names in fam.items() if spec.name in names), None)
    if family is None:
        known = [n for names in fam.values() for n in names]
        raise unknown_name("model.name", spec.name, known, "a torchvision model name")
    kwargs = check_model_names("torchvision", spec.kwargs)  # allow-listed, download switches dropped
    kwargs["weights"] = None
    if spec.name in ("googlenet", "inception_v3"):
        # Their scipy-based init only matters for real weights; skipping it
        # also skips torchvision's FutureWarning about it.
        kwargs.setdefault("init_weights", False)
    if family in ("segmentation", "detection"):
        kwargs["weights_backbone"] = None
    factory = functools.partial(tvm.get_model, spec.name, **kwargs)
    model = probe(factory, "model.kwargs", spec.kwargs)
    crop, frames = _default_weights_meta(spec.name)
    assumptions: list[str] = []
    fixed = getattr(model, "image_size", None)  # torchvision ViT: positional embedding for one size
    if inp.image_size is not None:
        c, h, w = inp.image_size
        if isinstance(fixed, int) and (h, w) != (fixed, fixed):
            raise SpecError("input.image_size", inp.image_size,
                            f"[C, {fixed}, {fixed}]: {spec.name} is built for {fixed} px "
                            "(kwargs image_size changes it)")
    elif family == "detection":
        h, w = _DETECTION_SIDE.get(spec.name, (800, 1333))
        c = 3
        assumptions.append(f"input.image_size not given: [3, {h}, {w}], {spec.name}'s training resolution")
    else:
        side = fixed if isinstance(fixed, int) else crop or 224
        c, h, w = 3, side, side
        side_from = ("model.kwargs.image_size", kwargs["image_size"]) if isinstance(fixed, int) \
            and "image_size" in kwargs else ("model.name", spec.name)
        check_image(c, h, w, ("model.name", spec.name), side_from)
        assumptions.append(f"input.image_size not given: [3, {side}, {side}], {spec.name}'s training resolution")
    if family == "detection":
        _check_resize(model, h, w, kwargs)
    resolved: dict = {"image_size": [c, h, w]}
    if family == "video":
        t = inp.num_frames or max(DEFAULT_FRAMES, frames or 0)
        if inp.num_frames is None:
            assumptions.append(f"input.num_frames not given: {t}")
        resolved["num_frames"] = t
        batch, loss = tasks.clips(c, t, h, w), tasks.classification_loss
    elif family == "segmentation":
        batch, loss = tasks.segmentation_images(c, h, w), tasks.segmentation_loss
    elif family == "detection":
        objects = inp.num_objects or DEFAULT_OBJECTS
        if inp.num_objects is None:
            assumptions.append(f"input.num_objects not given: {objects} per image (COCO averages about 7.3)")
        resolved["num_objects"] = objects
        keypoints = getattr(getattr(model, "roi_heads", None), "keypoint_predictor", None)
        batch = tasks.detection(c, h, w, objects, COCO_KEYPOINTS if keypoints is not None else None,
                                masks=getattr(getattr(model, "roi_heads", None), "mask_predictor", None) is not None)
        return BuiltModel(f"torchvision:{spec.name}", factory, batch, tasks.model_loss, resolved,
                          count_parameters(model), assumptions, worst_case=True)
    else:
        batch, loss = tasks.images(c, h, w), tasks.classification_loss
    return BuiltModel(f"torchvision:{spec.name}", factory, batch, loss, resolved, count_parameters(model), assumptions)


def _check_resize(model: Any, h: int, w: int, kwargs: dict[str, Any]) -> None:
    """A detection model resizes its images itself (GeneralizedRCNNTransform: the short side to the largest
    ``min_size``, the long one at most ``max_size``, or a ``fixed_size``): the backbone's input is held to the
    image limits too, blamed on the kwargs that set it."""
    transform = getattr(model, "transform", None)
    if transform is None or not hasattr(transform, "min_size"):
        return
    fixed = getattr(transform, "fixed_size", None)
    if fixed:
        rh, rw = fixed
    else:
        scale = min(max(transform.min_size) / min(h, w), transform.max_size / max(h, w))
        rh, rw = int(h * scale), int(w * scale)
    given = [k for k in ("min_size", "max_size") if k in kwargs]
    blamed = (f"model.kwargs.{given[0]}", kwargs[given[0]]) if given else ("input.image_size", [3, h, w])
    check_image(3, rh, rw, blamed, blamed)


def _check_names(spec: TorchvisionModel) -> None:
    refuse_paths(spec.name, "model.name")
    check_model_names("torchvision", spec.kwargs)


register(ModelSource("torchvision", TorchvisionModel, build_torchvision, _check_names, families,
                     libraries=("torchvision",)))
