"""What a request may name: allow-lists for model kwargs and inline configs, and no paths or URLs anywhere.

>>> check_model_names("timm", {"num_classes": 10, "drop_path_rate": 0.1})
{'num_classes': 10, 'drop_path_rate': 0.1}
>>> check_model_names("timm", {"checkpoint_path": "/etc/passwd"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
estimator.errors.SpecError: model.kwargs.checkpoint_path: got '/etc/passwd'; expected '': batchfit never downloads...

A request is data: it may shape a model, never make a library open a file,
reach the network or run code. Three rules:

- timm and torchvision kwargs: an allow-list of the constructor arguments
  that shape the model (``TIMM_KWARGS``, ``TORCHVISION_KWARGS``); the
  download switches may keep their off value and are dropped (``NO_DOWNLOAD``).
- transformers inline configs, at every depth (sub-configs such as
  ``vision_config`` or an encoder-decoder's ``encoder`` are configs too, and
  so are dicts inside lists): a ``model_type`` the library ships (not
  ``REFUSED_MODEL_TYPES``), no remote code, none of the fields that make
  transformers load another model by name (``_NAMING_KEYS``); the fields
  that name a timm model (``timm_wrapper``'s and ``gemma3n_vision``'s
  ``architecture`` and ``model_args``, ``timm_backbone``'s ``backbone``) are
  checked like a timm request. Found by reading transformers 5.24's config
  classes for fields that name models, paths or Hub ids.
- no string that looks like a path or URL (``looks_like_path``) in a name
  field or anywhere in the free-form JSON, keys included.

Torch-free: ``check_request`` runs it before a worker sees the request, and
the builders run it again (with the installed libraries' registries) for
requests built without ``parse_request``.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Callable, Collection
from typing import Any

from estimator.errors import SpecError

# Constructor arguments that shape the model (its parameters, its activations, what
# backward keeps), per source, JSON-valued. Anything else -- loaders, callables,
# thresholds that only act at inference -- is refused by name.
TORCHVISION_KWARGS = frozenset({
    # heads and outputs
    "num_classes", "num_keypoints", "aux_loss", "aux_logits",
    # dropout and stochastic depth (their masks are kept for backward)
    "dropout", "attention_dropout", "dropout_aux", "drop_rate", "stochastic_depth_prob",
    # architecture: ViT, ResNet(-like), DenseNet, MobileNetV2, ConvNeXt
    "image_size", "representation_size", "groups", "width_per_group", "replace_stride_with_dilation",
    "growth_rate", "block_config", "num_init_features", "bn_size", "memory_efficient", "width_mult",
    "round_nearest", "layer_scale", "transform_input", "init_weights",
    # detection: which backbone layers train, the input resize, how many boxes a step carries
    "trainable_backbone_layers", "min_size", "max_size", "box_detections_per_img", "detections_per_img",
    "topk_candidates", "rpn_pre_nms_top_n_train", "rpn_post_nms_top_n_train", "rpn_batch_size_per_image",
    "box_batch_size_per_image",
})
TIMM_KWARGS = frozenset({
    "num_classes", "in_chans", "img_size", "patch_size", "global_pool", "class_token", "no_embed_class",
    "reg_tokens", "dynamic_img_size", "dynamic_img_pad", "output_stride",
    "drop_rate", "drop_path_rate", "drop_block_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate",
    "patch_drop_rate",
    "embed_dim", "embed_dims", "depth", "depths", "dims", "widths", "layers", "num_heads", "mlp_ratio",
    "mlp_ratios", "qkv_bias", "qk_norm", "init_values", "ls_init_value", "layer_scale_init_value",
    "window_size", "stem_type", "stem_width", "cardinality", "base_width", "channel_multiplier",
    "head_hidden_size", "fc_norm", "act_layer", "norm_layer",
})
ALLOWED_KWARGS = {"torchvision": TORCHVISION_KWARGS, "timm": TIMM_KWARGS}
# The download switches a request may still send, at their off value only (docs/API.md); they are dropped.
NO_DOWNLOAD: dict[str, dict[str, Any]] = {
    "torchvision": {"weights": None, "weights_backbone": None},
    "timm": {"pretrained": False, "checkpoint_path": "", "pretrained_cfg_overlay": None, "cache_dir": None},
}

# transformers: a model_type refused at any depth, with why. RAG's retriever
# loads a dataset and a FAISS index by name (dataset, index_path, passages_path).
_HUB_KERNEL = "its modeling code fetches a CUDA kernel from the Hub (get_kernel('kernels-community/...'))"
REFUSED_MODEL_TYPES = {"rag": "its retriever loads a dataset and an index by name",
                       "yoso": _HUB_KERNEL, "mra": _HUB_KERNEL, "rwkv": _HUB_KERNEL}
# DiNAT's neighborhood attention runs only in the natten library's compiled kernels (no torch path; pip has
# it as a source distribution that builds CUDA extensions against the installed torch).
_natten = importlib.util.find_spec("natten")
if _natten is None or _natten.origin is None:  # not installed (a bare folder of that name is a namespace package)
    REFUSED_MODEL_TYPES["dinat"] = ("its modeling code needs the natten library (compiled neighborhood-attention "
                                    "kernels, no torch fallback), which is not installed here")
_REMOTE_KEYS = ("auto_map", "trust_remote_code")
# Fields that make transformers load another model by name, with what to give instead.
# ``backbone`` (outside a timm_backbone config) is looked up on the Hub while the config
# is built (backbone_utils.consolidate_backbone_kwargs_to_config: hf_api().repo_exists).
_NAMING_KEYS = {
    "backbone": "no backbone by name (transformers looks it up on the Hugging Face Hub): "
                "a backbone_config object with a model_type",
    "backbone_kwargs": "no backbone_kwargs (they go with a backbone by name): a backbone_config object",
    "attn_implementation": "no attention kernel in the config (one may name a Hub kernel): "
                           "set model.attn_implementation",
    "_attn_implementation": "no attention kernel in the config: set model.attn_implementation",
    "experts_implementation": "no experts kernel in the config (one may name a Hub kernel)",
    "_experts_implementation": "no experts kernel in the config (one may name a Hub kernel)",
}
# Switches that must stay off: in transformers 4.x use_pretrained_backbone downloads the backbone's weights.
_OFF_KEYS = ("use_pretrained_backbone",)
# The configs that build a timm model (transformers' TimmWrapperModel, TimmBackbone): the
# field that names it, checked like a timm request's model.name.
_TIMM_NAME_KEYS = {"architecture": None, "backbone": "timm_backbone"}  # key -> the model_type it belongs to (None: any)
_TIMM_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_-]+)?")  # a registry name and its tag; no source prefix

# Paths and URLs: a scheme URL, the source prefixes timm and huggingface_hub read
# (hf-hub:, local-dir:, file:), an absolute, home or Windows path, a ./ or ../ path.
_PATHLIKE = re.compile(r"""
    :// | ^(hf[-_]hub|local[-_]dir|file): | ^[/\\~] | ^[A-Za-z]:[/\\] | ^\.{1,2}[/\\] | (^|[/\\])\.\.([/\\]|$)
""", re.VERBOSE | re.IGNORECASE)


def looks_like_path(text: str) -> bool:
    """A string a library could read as a file, a folder or a URL.

    >>> [looks_like_path(s) for s in ("resnet50", "gelu_pytorch_tanh", "A100-80GB", "bfloat16", "vit_b.fb_in1k")]
    [False, False, False, False, False]
    >>> [looks_like_path(s) for s in ("http://x", "hf-hub:timm/resnet18", "local-dir:d", "/etc", "~/x", "a/../b")]
    [True, True, True, True, True, True]
    """
    return _PATHLIKE.search(text) is not None


def refuse_paths(value: Any, path: str) -> None:
    """``SpecError`` at the first string (value or key) in ``value`` that looks like a path or URL."""
    if isinstance(value, str):
        if looks_like_path(value):
            raise SpecError(path, value, "a name, not a path or URL: batchfit reads no files and fetches nothing")
    elif isinstance(value, dict):
        for k, v in value.items():
            refuse_paths(k, f"{path}.{k}")
            refuse_paths(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            refuse_paths(v, f"{path}[{i}]")


def _close(name: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def check_model_names(source: str, kwargs: dict[str, Any], path: str = "model.kwargs") -> dict[str, Any]:
    """The kwargs a timm or torchvision model is built with: every name allowed, download switches dropped."""
    return _check_kwargs(source, NO_DOWNLOAD[source], kwargs, path)


def _check_kwargs(source: str, off: dict[str, Any], kwargs: dict[str, Any], path: str) -> dict[str, Any]:
    allowed = ALLOWED_KWARGS[source]
    kept: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in off:
            if value != off[name]:
                raise SpecError(f"{path}.{name}", value, f"{off[name]!r}: batchfit never downloads weights or "
                                "reads files (memory does not depend on them)")
            continue
        if name not in allowed:
            raise SpecError(f"{path}.{name}", value, f"a {source} constructor argument that shapes the model"
                            f"{_close(name, allowed)}: one of {', '.join(sorted(allowed))}")
        refuse_paths(value, f"{path}.{name}")
        kept[name] = value
    return kept


def check_config(config: Any, path: str = "model.config", *, known_types: Collection[str] | None = None,
                 is_timm_model: Callable[[str], bool] | None = None, nested: bool = False) -> None:
    """Refuse what an inline transformers config may not name, at any depth (dicts inside lists too).

    ``known_types`` (transformers' ``CONFIG_MAPPING``) and ``is_timm_model`` (``timm.is_model``) check
    names against the installed libraries; without them (``check_request``) only the library-free rules run.
    A sub-config's empty ``model_type`` names nothing: a config class that is no registered type (nemo_speechlm's
    diarization head_config) saves it so, and its parent builds it from its own class, not by that name.
    """
    if isinstance(config, list):
        for i, item in enumerate(config):
            check_config(item, f"{path}[{i}]", known_types=known_types, is_timm_model=is_timm_model, nested=True)
        return
    if not isinstance(config, dict):
        refuse_paths(config, path)
        return
    model_type = config.get("model_type")
    for key, value in config.items():
        where = f"{path}.{key}"
        refuse_paths(key, where)
        if key in _REMOTE_KEYS:
            raise SpecError(where, value, "no remote code: batchfit builds only transformers' own architectures")
        if key in _OFF_KEYS and value:
            raise SpecError(where, value, "false: batchfit never downloads weights (memory does not depend on them)")
        if key in _TIMM_NAME_KEYS and _TIMM_NAME_KEYS[key] in (None, model_type):
            _check_timm_name(value, where, is_timm_model)
            continue
        if key in _NAMING_KEYS:
            raise SpecError(where, value, _NAMING_KEYS[key])
        if key == "model_args":  # timm_wrapper / gemma3n_vision: passed to timm.create_model
            if not isinstance(value, dict):
                raise SpecError(where, value, "an object of timm constructor arguments")
            _check_kwargs("timm", {}, value, where)  # transformers passes pretrained=False itself
            continue
        if key == "model_type":
            if not (nested and value == ""):
                _check_model_type(value, where, known_types)
            continue
        check_config(value, where, known_types=known_types, is_timm_model=is_timm_model, nested=True)


def _check_model_type(value: Any, path: str, known_types: Collection[str] | None) -> None:
    if not isinstance(value, str):
        raise SpecError(path, value, "a transformers model type, e.g. 'llama'")
    if value in REFUSED_MODEL_TYPES:
        raise SpecError(path, value, f"a model type batchfit can build ({value}: {REFUSED_MODEL_TYPES[value]})")
    refuse_paths(value, path)
    if known_types is not None and value not in known_types:
        raise SpecError(path, value, f"a model type built into transformers{_close(value, known_types)}")


def _check_timm_name(value: Any, path: str, is_timm_model: Callable[[str], bool] | None) -> None:
    if not isinstance(value, str) or not _TIMM_NAME.fullmatch(value):
        raise SpecError(path, value, "a name in timm.list_models() (a .tag suffix allowed): no hf-hub: or "
                        "local-dir: source, no path")
    if is_timm_model is not None and not is_timm_model(value.split(".", 1)[0]):
        raise SpecError(path, value, "a name in timm.list_models()")


def check_request_names(model: Any) -> None:
    """``check_request``'s hook: the name fields and free-form JSON of a request's model."""
    source = getattr(model, "source", None)
    if source in ("torchvision", "timm"):
        refuse_paths(model.name, "model.name")
        check_model_names(source, model.kwargs)
    elif source == "transformers":
        if model.preset is not None:
            refuse_paths(model.preset, "model.preset")
        if model.config is not None:
            check_config(model.config)
