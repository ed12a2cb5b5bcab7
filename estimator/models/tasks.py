"""Synthetic batches and the usual loss for each task.

A batch factory is ``make(batch_size, device) -> (inputs, targets)``; inputs
are a tensor, a tuple (positional) or a dict (keyword arguments). Values are
zeros: memory does not depend on them, and token id 0 / class 0 exist in
every vocabulary and label set. A factory's ``keep_dtype`` attribute names
the positions or keys of ``inputs`` that pure bf16 leaves in their dtype
(``Recipe.forward_inputs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

# torchvision's Inception v3 / GoogLeNet recipe weighs the auxiliary heads'
# losses (Szegedy et al. 2015/2016): 0.4 for aux logits; segmentation's
# auxiliary classifier is weighted 0.5 (torchvision references/segmentation).
AUX_CLASSIFIER_WEIGHT = 0.4
AUX_SEGMENTATION_WEIGHT = 0.5


def images(channels: int, height: int, width: int) -> Callable:
    def make(b: int, device: Any):
        x = torch.empty(b, channels, height, width, device=device)  # (B, C, H, W)
        return x, _classes(b, device)
    return make


def clips(channels: int, frames: int, height: int, width: int) -> Callable:
    def make(b: int, device: Any):
        x = torch.empty(b, channels, frames, height, width, device=device)  # (B, C, T, H, W)
        return x, _classes(b, device)
    return make


def segmentation_images(channels: int, height: int, width: int) -> Callable:
    def make(b: int, device: Any):
        x = torch.empty(b, channels, height, width, device=device)
        return x, torch.zeros(b, height, width, dtype=torch.long, device=device)  # (B, H, W) class per pixel
    return make


class _DetectionBatches:
    """A list of images and a list of target dicts, as torchvision's detection models train on."""

    keep_dtype = (1,)  # the targets: torchvision's roi_heads.check_targets refuses bf16 boxes

    def __init__(self, make: Callable[[int, Any], Any]) -> None:
        self.make = make

    def __call__(self, b: int, device: Any) -> Any:
        return self.make(b, device)


def detection(channels: int, height: int, width: int, objects: int, keypoints: int | None, masks: bool) -> Callable:
    """A list of images and a list of target dicts, as torchvision's detection models train on."""
    def make(b: int, device: Any):
        images = [torch.empty(channels, height, width, device=device) for _ in range(b)]
        targets = []
        for _ in range(b):
            # boxes must have positive width and height: (x1, y1, x2, y2) = (0, 0, 1, 1)
            boxes = torch.zeros(objects, 4, device=device)
            boxes[:, 2:] = 1.0
            t = {"boxes": boxes, "labels": torch.ones(objects, dtype=torch.long, device=device)}
            if masks:
                t["masks"] = torch.zeros(objects, height, width, dtype=torch.uint8, device=device)  # (N, H, W)
            if keypoints:
                t["keypoints"] = torch.zeros(objects, keypoints, 3, device=device)  # (N, K, [x, y, visible])
            targets.append(t)
        return (images, targets), None
    return _DetectionBatches(make)


def classification_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits; auxiliary heads (Inception, GoogLeNet) weighted in."""
    if isinstance(out, torch.Tensor):
        return F.cross_entropy(out, target)
    if hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
        loss = F.cross_entropy(out.logits, target)
        for name in ("aux_logits", "aux_logits1", "aux_logits2"):
            aux = getattr(out, name, None)
            if isinstance(aux, torch.Tensor):
                loss = loss + AUX_CLASSIFIER_WEIGHT * F.cross_entropy(aux, target)
        return loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return F.cross_entropy(out[0], target)
    raise TypeError(f"cannot find logits in a {type(out).__name__} model output")


def segmentation_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(out["out"], target)
    if out.get("aux") is not None:
        loss = loss + AUX_SEGMENTATION_WEIGHT * F.cross_entropy(out["aux"], target)
    return loss


def model_loss(out: Any, target: Any) -> torch.Tensor:
    """The loss a model computes itself (transformers with ``labels``, detection)."""
    if isinstance(out, dict) and not hasattr(out, "loss"):
        return cast(torch.Tensor, sum(out.values()))  # torchvision detection: a dict of losses
    return out.loss


def _classes(b: int, device: Any) -> torch.Tensor:
    """One class label per sample (B,): a classifier's targets."""
    return torch.zeros(b, dtype=torch.long, device=device)


def _ids(b: int, s: int, device: Any) -> torch.Tensor:
    return torch.zeros(b, s, dtype=torch.long, device=device)  # (B, S)


def text(task: str, seq_len: int, target_seq_len: int | None = None, *, attention_mask: bool = True,
         extra: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
         label_len: int | None = None, codebooks: int | None = None) -> Callable:
    """Batches for transformers' tasks; ``labels`` go in so the model computes its own loss.

    ``extra``: the inputs a model's training step needs besides the tokens (GIT's ``pixel_values``,
    VoxtralRealtime's ``input_features``, X-MOD's ``lang_ids``), each as its shape after the batch dimension and
    its dtype (floating: empty; integer: zeros, the first language). ``label_len``: the masked-LM labels'
    length where the model decodes a fixed number of positions, whatever the input's (Perceiver).
    ``codebooks``: a causal LM over that many parallel audio-code streams (MusicGen's decoder): ``input_ids`` of
    (batch x codebooks, seq), one row per sequence and codebook, the mask (batch, seq) and ``labels`` (batch,
    seq, codebooks), as its forward takes them."""
    if codebooks is not None and task != "causal-lm":
        raise ValueError(f"codebooks with {task}")

    def make(b: int, device: Any):
        ids = _ids(b * (codebooks or 1), seq_len, device)
        inputs: dict[str, torch.Tensor] = {"input_ids": ids}
        if attention_mask:
            inputs["attention_mask"] = torch.ones(b, seq_len, dtype=torch.long, device=device)
        for name, (shape, dtype) in (extra or {}).items():
            make_tensor = torch.empty if dtype.is_floating_point else torch.zeros
            inputs[name] = make_tensor(b, *shape, dtype=dtype, device=device)
        if task == "causal-lm" and codebooks:
            inputs["labels"] = torch.zeros(b, seq_len, codebooks, dtype=torch.long, device=device)
        elif task == "causal-lm":
            inputs["labels"] = ids  # the model shifts them (ForCausalLMLoss)
        elif task == "masked-lm":
            inputs["labels"] = _ids(b, label_len or seq_len, device)
        elif task == "sequence-classification":
            inputs["labels"] = _classes(b, device)
        elif task == "seq2seq-lm":
            inputs["labels"] = _ids(b, target_seq_len or seq_len, device)
        else:
            raise ValueError(task)
        return inputs, None
    return make


def pixels(channels: int, height: int, width: int, *, labels: bool = True) -> Callable:
    """``pixel_values`` (B, C, H, W); the class labels go in (the model computes its loss) or, for a model
    whose forward takes none (pp_lcnet), come back as the targets of ``head_loss``."""
    def make(b: int, device: Any):
        x = torch.empty(b, channels, height, width, device=device)
        target = _classes(b, device)
        return ({"pixel_values": x, "labels": target}, None) if labels else ({"pixel_values": x}, target)
    return make


def image_tokens(seq_len: int) -> Callable:
    """ImageGPT's input: one color-cluster id per pixel of the resized image (B, H*W), and class labels."""
    def make(b: int, device: Any):
        return {"input_ids": _ids(b, seq_len, device), "labels": _classes(b, device)}, None
    return make


def patches(max_patches: int, patch_dim: int, grid: tuple[int, int]) -> Callable:
    """Siglip2's input as its image processor makes it: each image cut into ``grid`` (rows, columns) patches
    of ``patch_dim`` values, padded to ``max_patches`` (B, N, D), the mask of the real ones (int32, as the
    processor's) and the grid (B, 2)."""
    def make(b: int, device: Any):
        x = torch.empty(b, max_patches, patch_dim, device=device)
        mask = torch.zeros(b, max_patches, dtype=torch.int32, device=device)
        mask[:, : grid[0] * grid[1]] = 1
        shapes = torch.empty(b, 2, dtype=torch.long, device=device)
        shapes[:, 0], shapes[:, 1] = grid
        return {"pixel_values": x, "pixel_attention_mask": mask, "spatial_shapes": shapes,
                "labels": _classes(b, device)}, None
    return make


def image_prompt(seq_len: int, image_tokens: int, image_token_id: int, channels: int, height: int,
                 width: int) -> Callable:
    """A multimodal classifier's input (ShieldGemma 2): the prompt's ``input_ids`` (B, S), where one image's
    ``image_tokens`` placeholder ids (``image_token_id``) stand after the first token and the model scatters
    the image's features, with ``token_type_ids`` 1 there (the image's bidirectional attention block),
    the attention mask and ``pixel_values`` (B, C, H, W); class targets for ``head_loss``."""
    def make(b: int, device: Any):
        ids = _ids(b, seq_len, device)
        types = torch.zeros_like(ids)
        ids[:, 1: 1 + image_tokens] = image_token_id
        types[:, 1: 1 + image_tokens] = 1
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": types,
                  "pixel_values": torch.empty(b, channels, height, width, device=device)}
        return inputs, _classes(b, device)
    return make


def head_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the classifier's output, for a model that computes no loss: its ``logits``, or a
    (B, classes) ``last_hidden_state`` (pp_lcnet returns its head's output under that name)."""
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        logits = getattr(out, "last_hidden_state", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise TypeError(f"cannot find (batch, classes) logits in a {type(out).__name__} model output")
    return F.cross_entropy(logits, target)
