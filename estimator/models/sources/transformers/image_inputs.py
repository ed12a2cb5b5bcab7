"""What a transformers image classifier's step is fed, per architecture, as its image processor makes it.

>>> image_input(config, model_class, inp, "vit")        # doctest: +SKIP
(<batch factory>, <loss>, {'image_size': [3, 224, 224]}, ['input.image_size not given: [3, 224, 224] from the config'])

Most take ``pixel_values`` (B, C, H, W) of the config's num_channels and image_size, and labels; a classifier
whose forward takes no labels (pp_lcnet) is trained with cross-entropy on its output. The others are entries of
``IMAGE_INPUTS`` (``estimator/models/rules.py``), matched by what their forward takes: ImageGPT's color-cluster
ids, ShieldGemma 2's prompt around the image, Siglip2's padded patches.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from estimator.errors import SpecError
from estimator.models import tasks
from estimator.models.building import check_image
from estimator.models.rules import Rules
from estimator.models.sources.transformers.text_inputs import max_positions

if TYPE_CHECKING:
    from estimator.models.spec import InputSpec

# (batch factory, loss, resolved input, assumption lines)
ImageInput = tuple[Any, Any, dict[str, Any], list[str]]
IMAGE_INPUTS = Rules("transformers image inputs")


def _takes(model_class: type[Any]) -> Any:
    return inspect.signature(model_class.forward).parameters


def image_input(config: Any, model_class: type, inp: InputSpec, name: str) -> ImageInput:
    """What an image classifier's forward takes and its loss: (batch factory, loss, resolved input, assumptions)."""
    rule = IMAGE_INPUTS.find(model_class, config)
    if rule is not None:
        return rule.apply(config, model_class, inp, name)
    notes: list[str] = []
    c, h, w = image_shape(config)
    if inp.image_size is not None and inp.image_size != [c, h, w]:
        raise SpecError("input.image_size", inp.image_size,
                        f"[{c}, {h}, {w}] (the config's num_channels and image_size; change them in model.config)")
    if inp.image_size is None:
        notes.append(f"input.image_size not given: [{c}, {h}, {w}] from the config")
    if "labels" in _takes(model_class):
        return tasks.pixels(c, h, w), tasks.model_loss, {"image_size": [c, h, w]}, notes
    notes.append(f"loss: cross-entropy on {model_class.__name__}'s output (its forward takes no labels)")
    return tasks.pixels(c, h, w, labels=False), tasks.head_loss, {"image_size": [c, h, w]}, notes

def _side(value: Any) -> tuple[int, int] | None:
    """A config's ``image_size``: one side (224) or an [H, W] pair ((224, 224): hiera, pvt_v2, textnet)."""
    if type(value) is int:
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return None


def image_shape(config: Any, prefix: str = "model.config") -> tuple[int, int, int]:
    """[C, H, W] from the config (``prefix`` names it in errors): num_channels (textnet names them
    stem_num_channels; 3 where unset) and image_size, an int or an [H, W] pair (224 where unset)."""
    channel_key = next((k for k in ("num_channels", "stem_num_channels") if getattr(config, k, None) is not None),
                       "num_channels")
    c = getattr(config, channel_key, None)
    c = 3 if c is None else c
    size = getattr(config, "image_size", None)
    sides = (224, 224) if size is None else _side(size)
    if type(c) is not int:
        raise SpecError(f"{prefix}.{channel_key}", c, "an integer number of input channels")
    if sides is None:
        raise SpecError(f"{prefix}.image_size", size, "an integer side or an [H, W] pair of integers")
    h, w = sides
    check_image(c, h, w, (f"{prefix}.{channel_key}", c), (f"{prefix}.image_size", size))
    return c, h, w


# Prompt tokens when input.seq_len is not given for a model that reads a prompt with the image (ShieldGemma 2:
# the chat template around one policy, the image's tokens among them), as a text model's default without a
# position limit.
PROMPT_TOKENS = 512


@IMAGE_INPUTS.register("imagegpt-color-clusters", lambda cls, config: "input_ids" in _takes(cls)
                       and "pixel_values" not in _takes(cls))
def _color_clusters(config: Any, model_class: type, inp: InputSpec, name: str) -> ImageInput:
    """ImageGPT takes the resized image's color-cluster ids (``input_ids``, one per pixel: the config's
    n_positions)."""
    notes: list[str] = []
    if inp.image_size is not None:
        raise SpecError("input.image_size", inp.image_size,
                        f"null: {name} takes color-cluster token ids, one per pixel of the image its "
                        "processor resizes (input.seq_len of them), not pixels")
    limit = max_positions(config)
    seq = inp.seq_len or limit or 1024
    if limit is not None and seq > limit:
        raise SpecError("input.seq_len", seq, f"at most {limit}, {name}'s maximum positions")
    if inp.seq_len is None:
        notes.append(f"input.seq_len not given: {seq} color-cluster ids, the model's maximum positions "
                     f"(a {math.isqrt(seq)} x {math.isqrt(seq)} image)" if math.isqrt(seq) ** 2 == seq else
                     f"input.seq_len not given: {seq} color-cluster ids, the model's maximum positions")
    return tasks.image_tokens(seq), tasks.model_loss, {"seq_len": seq}, notes


@IMAGE_INPUTS.register("shieldgemma2-prompt", lambda cls, config: "input_ids" in _takes(cls)
                       and "pixel_values" in _takes(cls))
def _image_prompt(config: Any, model_class: type, inp: InputSpec, name: str) -> ImageInput:
    """ShieldGemma 2: its processor writes a chat prompt per (image, policy) with the image's
    ``mm_tokens_per_image`` placeholder tokens; the forward answers (B, 2) Yes/No logits and computes no loss
    (its ``labels`` would go to the language model), so the classifier is trained with cross-entropy on them."""
    vision = getattr(config, "vision_config", config)
    c, h, w = image_shape(vision, "model.config.vision_config")
    if inp.image_size is not None and inp.image_size != [c, h, w]:
        raise SpecError("input.image_size", inp.image_size, f"[{c}, {h}, {w}] (the vision config's num_channels and "
                        "image_size, which its processor resizes to; change them in model.config.vision_config)")
    image_tokens = int(getattr(config, "mm_tokens_per_image", 256))
    seq = inp.seq_len or PROMPT_TOKENS
    if seq < image_tokens + 2:
        raise SpecError("input.seq_len", seq, f"at least {image_tokens + 2}: the prompt holds the image's "
                        f"{image_tokens} tokens (model.config.mm_tokens_per_image) between its begin and end tokens")
    notes = [f"input.image_size not given: [{c}, {h}, {w}] from the vision config"] if inp.image_size is None else []
    if inp.seq_len is None:
        notes.append(f"input.seq_len not given: {seq} prompt tokens, the image's {image_tokens} among them")
    notes.append(f"loss: cross-entropy on {model_class.__name__}'s Yes/No logits (its forward computes none)")
    batches = tasks.image_prompt(seq, image_tokens, int(config.image_token_id), c, h, w)
    return batches, tasks.head_loss, {"image_size": [c, h, w], "seq_len": seq}, notes


@IMAGE_INPUTS.register("siglip2-patches", lambda cls, config: "spatial_shapes" in _takes(cls)
                       and "input_ids" not in _takes(cls))
def _patches(config: Any, model_class: type, inp: InputSpec, name: str) -> ImageInput:
    """Siglip2 takes patches padded to the processor's ``max_num_patches`` (the vision config's num_patches),
    with their mask and grid."""
    notes: list[str] = []
    vision = getattr(config, "vision_config", config)
    c, p = int(vision.num_channels), int(vision.patch_size)
    most = inp.seq_len or int(vision.num_patches)
    if inp.image_size is not None:
        if inp.image_size[0] != c:
            raise SpecError("input.image_size", inp.image_size,
                            f"[{c}, H, W] (the config's vision_config.num_channels)")
        from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

        h, w = get_image_size_for_max_num_patches(inp.image_size[1], inp.image_size[2], p, most)
        grid = (h // p, w // p)
        image = list(inp.image_size)
    else:
        side = math.isqrt(most)
        grid, image = (side, side), [c, side * p, side * p]
        notes.append(f"input.image_size not given: a square image, {side} x {side} patches of {p} px")
    if inp.seq_len is None:
        notes.append(f"input.seq_len not given: {most} patches (the vision config's num_patches, the image "
                     "processor's max_num_patches), each image padded to them")
    return (tasks.patches(most, c * p * p, grid), tasks.model_loss, {"image_size": image, "seq_len": most},
            notes)
