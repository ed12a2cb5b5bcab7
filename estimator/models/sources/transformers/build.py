"""The transformers builder: a preset or inline config -> its task's model class, on the meta device.

>>> gpt2 = TransformersModel(source="transformers", preset="gpt2")
>>> build_transformers(gpt2, InputSpec(seq_len=256)).input                         # doctest: +SKIP
{'seq_len': 256}
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from estimator.errors import SpecError
from estimator.models import BuiltModel, Depth, blocks, peft, tasks
from estimator.models.building import check_seq_len, count_parameters, given_values, probe, unknown_name
from estimator.models.meta import build_on_meta
from estimator.models.sources.transformers import Task, TransformersModel, presets
from estimator.models.sources.transformers.checks import (
    NO_KERNEL,
    attention_line,
    check_attn,
    check_config_names,
    check_experts,
    check_trains,
    check_values,
    experts_lines,
    kernel_lines,
)
from estimator.models.sources.transformers.image_inputs import image_input
from estimator.models.sources.transformers.text_inputs import max_positions, position_key, text_inputs
from estimator.models.spec import InputSpec
from estimator.options import MAX_SEQ_LEN

# The Auto class that builds each task's head.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}
# The task a config's ``architectures`` entry trains.
_ARCH_TASK: tuple[tuple[str, Task], ...] = (
    ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
    ("ForConditionalGeneration", "seq2seq-lm"), ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
)


def _config_dict(spec: TransformersModel) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if spec.preset is not None:
        table = presets()
        if spec.preset not in table:
            raise unknown_name("model.preset", spec.preset, sorted(table), "a batchfit preset (GET /models)")
        merged.update(table[spec.preset])
    if spec.config is not None:
        check_config_names(spec.config)
        merged.update(spec.config)
    merged.pop("_source", None)
    return merged


def _model_config(config: Any, model_class: type, assumptions: list[str]) -> Any:
    """The config ``model_class`` is built from. A composite config whose task class is one sub-model's (musicgen's
    causal LM is its decoder, built from the ``decoder`` sub-config) gives that sub-config, as transformers'
    ``from_config`` does for a ``text_config`` only; an encoder-decoder without a pad id (which shifting the labels
    right needs) takes its decoder's."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):  # a text_config: from_config takes it itself
        subs = [key for key in getattr(config, "sub_configs", {})
                if key != "text_config" and isinstance(getattr(config, key, None), wanted)]
        if len(subs) == 1:
            assumptions.append(f"{model_class.__name__} is built from the config's {subs[0]}")
            return getattr(config, subs[0])
    pad = getattr(getattr(config, "decoder", None), "pad_token_id", None)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "pad_token_id", None) is None \
            and isinstance(pad, int):
        config.pad_token_id = pad
        assumptions.append(f"pad_token_id unset: using {config.pad_token_id} (the decoder's)")
    return config


def _fine_tuned(model: Any, spec: TransformersModel, task: Task, lines: list[str]) -> Any:
    """The model quantized and wrapped with adapters as the request asks (estimator/models/peft.py)."""
    if spec.quantization is not None:
        model = peft.quantize(model, spec.quantization, lines)
    if spec.peft is not None:
        model = peft.adapt(model, spec.peft, task, lines)
    return model


def build_transformers(spec: TransformersModel, inp: InputSpec) -> BuiltModel:
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.auto_factory import _get_model_class
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = _config_dict(spec)
    model_type = raw.pop("model_type", None)
    if not isinstance(model_type, str):
        raise SpecError("model.config.model_type", model_type, "a transformers model type, e.g. 'llama'")
    if model_type not in CONFIG_MAPPING:
        raise unknown_name("model.config.model_type", model_type, list(CONFIG_MAPPING.keys()),
                           "a model type built into transformers")
    if spec.config:
        check_values(CONFIG_MAPPING[model_type], spec.config)
    with given_values("model.config", spec.config, f"a valid {model_type} config"):
        config = AutoConfig.for_model(model_type, **raw)
    architectures = raw.get("architectures") or []
    task = spec.task or next((t for suffix, t in _ARCH_TASK for a in architectures if a.endswith(suffix)),
                             None)
    if task is None:
        raise SpecError("model.task", None, f"one of {', '.join(AUTO_CLASSES)} (the config names no architecture)")
    auto = getattr(transformers, AUTO_CLASSES[task])
    if type(config) not in auto._model_mapping:
        supported = [t for t, name in AUTO_CLASSES.items()
                     if type(config) in getattr(transformers, name)._model_mapping]
        raise SpecError("model.task", task, f"a task {model_type} supports: {', '.join(supported) or 'none'}")
    assumptions: list[str] = []
    if getattr(config, "architectures", None) is None:
        # transformers' _get_model_class iterates config.architectures where the task maps the type to several
        # classes (deit, levit, perceiver); a config without the key has None there, and from_config raises
        # TypeError. An empty list makes it pick what transformers means to: the first (the trainable) class.
        config.architectures = []
    model_class = _get_model_class(config, auto._model_mapping)
    config = _model_config(config, model_class, assumptions)
    # A sub-model's config (musicgen's decoder) is no key of the auto mapping: its class builds it, as from_config would
    make = auto.from_config if type(config) in auto._model_mapping else model_class._from_config
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        # Decoder-only classifiers find the last token through the pad id.
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
        assumptions.append(f"pad_token_id unset: using {config.pad_token_id} (the eos token)")

    # attn_implementation None is what from_config does when not told: PreTrainedModel.__init__ calls
    # _check_and_adjust_attn_implementation(None), whose get_correct_attn_implementation (transformers 5.x,
    # modeling_utils.py) tries "sdpa" and falls back to "eager" when the class's _supports_sdpa is False. Flash
    # and flex kernels are only used when named, so the choice depends on the class alone, not on the device
    # or on which kernels are installed: a real GPU run with these packages picks the same.
    check_attn(model_class, spec.attn_implementation)
    check_experts(model_class, spec.experts_implementation)
    if task != "image-classification":
        check_trains(model_class, model_type, task)

    def factory_of(config: Any) -> Callable[[], Any]:
        def base_factory():
            # A config's torch_dtype is how the checkpoint is stored; training keeps fp32 master weights (the
            # recipe's precision decides the rest). The explicit None also undoes the previous build's choice,
            # which transformers leaves on the (shared) config.
            try:
                return make(config, attn_implementation=spec.attn_implementation,
                            experts_implementation=spec.experts_implementation, dtype=torch.float32)
            except ValueError as exc:  # a sub-model class without the named kernel (the top class is checked above)
                found = NO_KERNEL.match(str(exc))
                if found is None:
                    raise
                raise SpecError("model.attn_implementation", spec.attn_implementation,
                                f"eager or null ({found.group(1)}, inside {name}, has no such kernel)") from exc
        return base_factory

    base_factory = factory_of(config)

    def factory():
        return _fine_tuned(base_factory(), spec, task, [])

    name = spec.preset or model_type
    model = probe(base_factory, "model.config", spec.config)
    tuned = model
    if spec.peft is not None:  # built once on meta here, so that a bad adapter option fails before a simulation
        tuned = build_on_meta(lambda: _fine_tuned(base_factory(), spec, task, assumptions))
    elif spec.quantization is not None:
        tuned = build_on_meta(factory)
    assumptions.append(attention_line(model, spec.attn_implementation))
    assumptions.extend(experts_lines(model, spec))
    assumptions.extend(kernel_lines(model, name))
    if task == "image-classification":
        batches, loss, resolved_image, notes = image_input(config, model_class, inp, name)
        assumptions.extend(notes)
        return BuiltModel(f"transformers:{name}", factory, batches, loss, resolved_image, count_parameters(model),
                          assumptions, moe_routing=spec.moe_routing)
    limit = max_positions(config)
    seq = inp.seq_len
    if seq is None:
        seq = limit or 512
        if limit:
            key = position_key(config) or ""
            check_seq_len(limit, (f"model.config.{config.attribute_map.get(key, key)}", limit))
        assumptions.append(f"input.seq_len not given: {seq}, the model's maximum positions" if limit
                           else "input.seq_len not given: 512")
    elif limit is not None and seq > limit:
        raise SpecError("input.seq_len", seq, f"at most {limit}, {name}'s maximum positions")
    resolved: dict[str, Any] = {"seq_len": seq}
    fed = text_inputs(model, config, seq, spec, inp)
    target = None
    if task == "seq2seq-lm":
        target = inp.target_seq_len or seq
        if inp.target_seq_len is None:
            assumptions.append(f"input.target_seq_len not given: {target} (= seq_len)")
        resolved["target_seq_len"] = target
    assumptions.extend(fed.lines)
    batches = tasks.text(task, seq, target, extra=fed.extra, label_len=fed.label_len, codebooks=fed.codebooks)
    built = BuiltModel(f"transformers:{name}", factory, batches, tasks.model_loss, resolved, count_parameters(model),
                       assumptions, moe_routing=spec.moe_routing,
                       max_seq_len=min(limit, MAX_SEQ_LEN) if limit is not None else None)

    built.depth = _depth(model, tuned, config, built,
                         lambda n: lambda: _fine_tuned(factory_of(_shallow_config(config, n))(), spec, task, []))
    if built.depth is not None and spec.peft is not None:
        # the adapters' gradients and optimizer state grow in runs whose place drifts by a block at each depth:
        # a drifting rule at 2 (depths 1 to 4), LoRA's and QLoRA's alike (tests/test_depth.py)
        built.depth = dataclasses.replace(built.depth, grows_by=("drifting", 2))
    return built


def _shallow_config(config: Any, n: int) -> Any:
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = n
    return shallow


def _depth(model: Any, tuned: Any, config: Any, built: BuiltModel,
           factory_at: Callable[[int], Callable[[], Any]]) -> Depth | None:
    """The decoder's (or encoder's) repeating blocks: one ``ModuleList`` of ``config.num_hidden_layers`` modules,
    built again at another depth by a copy of the config (estimator/simulate/depth.py). None for a config with
    per-layer lists (``layer_types``: a copy would not follow its depth), another count of block lists, or
    blocks of the fine-tuned model (``tuned``) that differ (estimator/models/blocks.py). A build at another depth
    is offered only when its blocks and the rest of it have the full model's signatures."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return None
    if any(isinstance(v, (list, tuple)) and len(v) == layers for v in vars(config).values()):
        return None
    found = [path for path, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if len(found) != 1:
        return None
    path = blocks.container_in(tuned, found[0], layers)
    block = None if path is None else blocks.alike(tuned, path)
    if path is None or block is None:
        return None
    rest = blocks.signature(tuned, skip=path)

    builds: dict[int, BuiltModel | None] = {}  # every simulator of this model shares the builds

    def at(n: int) -> BuiltModel | None:
        if n not in builds:
            builds[n] = _at(n)
        return builds[n]

    def _at(n: int) -> BuiltModel | None:
        factory = factory_at(n)
        shallow = build_on_meta(factory)
        inside = blocks.container_in(shallow, found[0], n)
        if (inside is None or blocks.signature(shallow, skip=inside) != rest
                or (n > 0 and blocks.alike(shallow, inside) != block)):
            return None
        return dataclasses.replace(built, factory=factory, depth=None, assumptions=[])

    return Depth(layers, found[0], at)
