"""transformers: presets shipped as config JSON, inline configs, five training tasks.

Only transformers' own classes are used (``AutoModelFor*.from_config``); a
config carrying ``auto_map`` or ``trust_remote_code``, or naming another
model by name (a backbone, a timm model given by a path or a Hub id), is
refused at any depth (estimator/request/allowed.py), nothing is fetched
from the Hub. Each preset file names its source in ``_source``.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from functools import lru_cache
from importlib import resources
from typing import Any, get_args

import torch

from estimator.errors import SpecError
from estimator.models import (
    BuiltModel,
    check_image,
    check_seq_len,
    count_parameters,
    describe,
    given_values,
    probe,
    tasks,
    unknown_name,
)
from estimator.models.routing import ROUTING
from estimator.request.allowed import check_config
from estimator.request.limits import MAX_SEQ_LEN
from estimator.request.spec import AttnImplementation, InputSpec, Task, TransformersModel

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


@lru_cache(maxsize=1)
def presets() -> dict[str, dict[str, Any]]:
    """Preset name -> config dict (``_source`` kept, for provenance)."""
    out = {}
    for entry in resources.files("estimator.models").joinpath("presets").iterdir():
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text())
    return out


def _check_names(config: dict[str, Any]) -> None:
    """estimator/request/allowed.py's config rules, against the installed transformers and timm registries."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def is_timm_model(name: str) -> bool:
        import timm

        return bool(timm.is_model(name))

    check_config(config, "model.config", known_types=CONFIG_MAPPING.keys(), is_timm_model=is_timm_model)


def _config_dict(spec: TransformersModel) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if spec.preset is not None:
        table = presets()
        if spec.preset not in table:
            raise unknown_name("model.preset", spec.preset, sorted(table), "a batchfit preset (GET /models)")
        merged.update(table[spec.preset])
    if spec.config is not None:
        _check_names(spec.config)
        merged.update(spec.config)
    merged.pop("_source", None)
    return merged


# What a config default's type asks of a request's value (bool before int: a bool is an int).
_KINDS: tuple[tuple[type, tuple[type, ...], str], ...] = (
    (bool, (bool,), "true or false"), (int, (int,), "an integer"), (float, (int, float), "a number"),
    (str, (str,), "a string"), (list, (list,), "a list"), (dict, (dict,), "an object"),
)


def _fits(value: Any, accepted: tuple[type, ...]) -> bool:
    """``isinstance``, except that true and false are no integers or numbers."""
    return isinstance(value, accepted) and not (isinstance(value, bool) and int in accepted and bool not in accepted)


def _check_values(config_class: type, given: dict[str, Any]) -> None:
    """The request's config values against the config class, before anything is built: its declared field
    types where it has them (transformers' strict configs), else the type of its ``__init__`` default."""
    defaults = {p.name: p.default for p in inspect.signature(config_class).parameters.values()
                if p.default is not inspect.Parameter.empty}
    validators = getattr(config_class, "__validators__", {})
    for key, value in given.items():
        default = defaults.get(key)
        accepted, kind = next(((a, what) for t, a, what in _KINDS if isinstance(default, t)), ((object,), ""))
        for validate in validators.get(key, ()):
            try:
                validate(value)
            except (TypeError, ValueError) as exc:
                why = describe(exc)
                raise SpecError(f"model.config.{key}", value, why if _fits(value, accepted) else f"{kind} ({why})") \
                    from exc
        if key not in validators and not _fits(value, accepted):
            raise SpecError(f"model.config.{key}", value, f"{kind}, as {config_class.__name__}'s default {default!r}")
    architectures = given.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise SpecError("model.config.architectures", architectures,
                        "a list of transformers class names, e.g. ['GPT2LMHeadModel']")


# The class flag that says a model class can run each named kernel ("eager" needs none).
_ATTN_FLAGS = {"sdpa": "_supports_sdpa"}
# The ValueError transformers raises when a (sub-)model class cannot run the kernel named
# (modeling_utils.py, PreTrainedModel._sdpa_can_dispatch).
_NO_KERNEL = re.compile(r"^(\w+) does not support an attention implementation")


def _attn_supported(model_class: type) -> list[str]:
    """The kernels of ``model.attn_implementation`` that ``model_class`` can run."""
    return [impl for impl in get_args(AttnImplementation)
            if impl not in _ATTN_FLAGS or getattr(model_class, _ATTN_FLAGS[impl], False)]


def _check_attn(model_class: type, named: str | None) -> None:
    """A named kernel the class cannot run is the request's error, before transformers raises it."""
    supported = _attn_supported(model_class)
    if named is not None and named not in supported:
        raise SpecError("model.attn_implementation", named,
                        f"one {model_class.__name__} supports: {', '.join(supported)} "
                        "(or null: transformers' default for the class)")


def _attention_line(model: torch.nn.Module, named: str | None) -> str:
    """The kernel the built model runs, read back from its config (transformers resolved it in ``__init__``),
    and any sub-model that resolved another one (a sub-model class without SDPA falls back on its own)."""
    from transformers import PreTrainedModel

    used = getattr(model.config, "_attn_implementation", None)
    top = type(model).__name__
    why = f"model.attn_implementation, on {top}" if named is not None else (
        f"transformers' default for {top}" + ("" if used == "sdpa" else ", which has no SDPA"))
    seen, others = {id(model.config)}, []
    for m in model.modules():  # outermost first: one line per sub-config, named by the model that owns it
        if isinstance(m, PreTrainedModel) and id(m.config) not in seen:
            seen.add(id(m.config))
            if (own := getattr(m.config, "_attn_implementation", None)) != used:
                others.append(f"; {own} in {type(m).__name__}")
    return f"attention: {used} ({why})" + "".join(others)


def _check_experts(model_class: type, named: str | None) -> None:
    """A named experts kernel on a class that cannot switch one (no ``@use_experts_implementation``) is the
    request's error: transformers raises for grouped_mm and ignores the others."""
    if named is not None and not getattr(model_class, "_can_set_experts_implementation", lambda: False)():
        raise SpecError("model.experts_implementation", named,
                        f"null ({model_class.__name__} has no experts kernel to choose)")


def _check_trains(model_class: type[torch.nn.Module], model_type: str, task: str) -> None:
    """A text class whose forward takes no ``labels`` computes no loss, so there is no training step of its own to
    simulate (batchfit's text tasks train on the model's loss): the request's error, named before the build.

    Gemma 4's assistants are so: draft models for assisted decoding, whose forward takes the hidden states and
    KV states of the model they draft for (``inputs_embeds``, ``shared_kv_states``) and returns logits only."""
    params = inspect.signature(model_class.forward).parameters
    if "labels" in params:
        return
    fed = " (an assisted-decoding draft model: the model it drafts for feeds it inputs_embeds and " \
          "shared_kv_states)" if "shared_kv_states" in params else ""
    raise SpecError("model.config.model_type", model_type,
                    f"a model that trains on its own: {model_class.__name__}, its {task} class, takes no labels and "
                    f"computes no loss{fed}")


# Top-k gates outside transformers' experts kernels whose tokens per expert the simulation's routing answers
# (virtual_gpu/moe.py, ``Routing``: JetMoE's split sizes, in its MoE MLP and its mixture of attention heads;
# Switch Transformers' top-1 router with its per-sequence expert capacity).
_ROUTED_GATES = ("JetMoeTopKGating", "SwitchTransformersTop1Router")


def _experts_lines(model: torch.nn.Module, spec: TransformersModel) -> list[str]:
    """The experts kernel the built model runs and the routing policy, for a mixture-of-experts model.

    Experts are the modules ``@use_experts_implementation`` decorates (they carry ``num_experts`` and
    ``_is_expert_parallel``); the router's ``top_k`` (or the config's ``num_experts_per_tok``) says how many
    experts each token goes to. A model without them whose gates are in ``_ROUTED_GATES`` gets the routing
    line alone (it has no experts kernel to choose)."""
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]
    gates = [m for m in model.modules() if type(m).__name__ in _ROUTED_GATES]
    if not experts and not gates:
        return []
    lines, kept = [], ""
    if experts:
        config = model.config
        used = getattr(experts[0].config, "_experts_implementation", None) or "eager"
        why = "model.experts_implementation" if spec.experts_implementation else "transformers' default"
        n = experts[0].num_experts
        k = next((m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)),
                 getattr(config, "num_experts_per_tok", None))
        layers = f"{len(experts)} MoE layer" + ("s" if len(experts) > 1 else "")
        lines.append(f"experts: {used} ({why} for {type(model).__name__}, {layers})")
        kept = ("; the buffers' sizes do not depend on routing, only the offsets' values" if used == "grouped_mm"
                else "; the buffers' sizes do not depend on routing" if used == "batched_mm" else "")
    else:
        n, k = gates[0].num_experts, getattr(gates[0], "top_k", 1)
        capacity = getattr(gates[0], "expert_capacity", None)
        what = "split sizes" if capacity is None else f"expert capacity ({capacity} tokens per sequence)"
        kept = f"; {type(gates[0]).__name__}'s {what}, {len(gates)} gate" + ("s" if len(gates) > 1 else "")
    share = f"{k} of {n} experts per token" if isinstance(k, int) else f"{n} experts"
    if spec.moe_routing == "balanced":
        spread = f"tokens x {k} / {n} per expert" if isinstance(k, int) else "tokens spread evenly"
    else:
        spread = ("the experts filled in turn to their capacity" if gates and not experts
                  and getattr(gates[0], "expert_capacity", None) is not None
                  else "every token to the same expert" if k == 1 else f"every token to the same {k} experts"
                  if isinstance(k, int) else "every token to the same experts")
    lines.append(f"moe_routing: {spec.moe_routing} ({share}, {spread}{kept})")
    return lines


# The pip distribution of each optional kernel package (transformers' own _PACKAGE_TO_DISTRIBUTION names only fla).
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}


def _kernel_lines(model: torch.nn.Module, name: str) -> list[str]:
    """Which path the optional fused kernels of a state-space or linear-attention model take.

    transformers wraps each such function in ``use_kernel_func_from_hub_with_fallback`` (integrations/
    hub_kernels.py): the original package (mamba-ssm, causal-conv1d, flash-linear-attention) when it imports,
    otherwise the module's reference torch function, whatever the device (a Hub kernel only when
    ``use_kernels`` is asked for). The wrapper keeps its choice in its closure (``is_new_implementation``), so
    the functions of the model's own modeling modules say what both this simulation and a GPU node without
    those packages run: the torch path, whose intermediates (the whole scan's states, the chunked delta rule's
    blocks) the fused kernels would recompute in their backward instead of keeping."""
    import sys

    torch_path: dict[str, list[str]] = {}
    fused: dict[str, list[str]] = {}
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for value in vars(module).values():
            closure = getattr(value, "__closure__", None)
            if not inspect.isfunction(value) or not closure:
                continue
            try:
                free = dict(zip(value.__code__.co_freevars, (c.cell_contents for c in closure), strict=True))
            except ValueError:  # a cell not yet filled (a closure over a name assigned later): not a wrapper
                continue
            package, func = free.get("package"), free.get("func_name")
            if isinstance(package, str) and isinstance(func, str) and "is_new_implementation" in free:
                dist = _DISTRIBUTIONS.get(package, package)
                (fused if free["is_new_implementation"] else torch_path).setdefault(dist, []).append(func)
    lines = []
    if torch_path:
        funcs = ", ".join(sorted({f for fs in torch_path.values() for f in fs}))
        lines.append(f"{name}: the torch path for {funcs} ({', '.join(sorted(torch_path))} not installed, "
                     "as on a GPU node without them); the fused kernels would use less memory")
    if fused:
        lines.append(f"{name}: the installed {', '.join(sorted(fused))} kernels "
                     f"({', '.join(sorted({f for fs in fused.values() for f in fs}))})")
    return lines


def _text_inputs(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) \
        -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], int | None, int | None, list[str]]:
    """The inputs a text model's training step takes besides the token ids, as a real run feeds them, the
    masked-LM labels' length where the model fixes it, the number of parallel code streams of a model that
    predicts several per position, and the assumption lines that say so.

    - GitForCausalLM: its loss scores the text after the image tokens it prepends (``logits[:, num_image_tokens:
      -1]``), so text alone leaves nothing to score: one image per sequence, of vision_config's num_channels and
      image_size (a video config, ``num_image_with_embedding``, takes that many frames).
    - X-MOD: each sequence's language (``lang_ids``) picks its adapter, and without them or a
      ``default_language`` the model refuses to run: every sequence in the first of ``config.languages``, as
      ``set_default_language(languages[0])`` would.
    - VoxtralRealtime: its text tokens are aligned with the audio, each to ``audio_length_per_tok`` mel frames
      (= the embedder's conv strides x ``downsample_factor``), which its encoder turns into one embedding added
      to the token's: ``input_features`` of (num_mel_bins, seq_len x that) frames, labels as long as the text.
    - PerceiverForMaskedLM: its decoder queries ``max_position_embeddings`` positions whatever the input's
      length (the logits are that long): labels that long.
    - MusicGen's decoder (MusicgenForCausalLM, MusicgenMelodyForCausalLM): each position holds one audio code per
      codebook (``config.num_codebooks`` EnCodec streams), which it embeds and sums, and it predicts each with its
      own head: ``input_ids`` of (batch x num_codebooks, seq) and labels of (batch, seq, num_codebooks), as its
      forward takes them; seq_len counts audio frames.
    """
    name = type(model).__name__
    extra: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    lines: list[str] = []
    label_len = codebooks = None
    if name == "GitForCausalLM":
        vision = config.vision_config
        with given_values("model.config", spec.config, "integers vision_config.num_channels and image_size"):
            c, side = int(vision.num_channels), int(vision.image_size)
        check_image(c, side, side, ("model.config.vision_config.num_channels", c),
                    ("model.config.vision_config.image_size", side))
        frames = getattr(config, "num_image_with_embedding", None)
        shape = (c, side, side) if not frames else (int(frames), c, side, side)
        extra["pixel_values"] = (shape, torch.float32)
        tokens = model.git.encoder.layer[0].attention.self.image_patch_tokens
        what = "one image" if not frames else f"{frames} frames (num_image_with_embedding)"
        lines.append(f"pixel_values: {what} of {list(shape)} per sequence (vision_config's num_channels and "
                     f"image_size): {name}'s loss scores the text after its {tokens} image tokens")
    elif "lang_ids" in inspect.signature(type(model).forward).parameters \
            and getattr(config, "default_language", None) is None:
        languages = list(getattr(config, "languages", ()))
        extra["lang_ids"] = ((), torch.long)
        lines.append(f"lang_ids: every sequence in {languages[0] if languages else 'language 0'} (the first of "
                     "model.config.languages, as set_default_language would; model.config.default_language "
                     "chooses another)")
    elif name == "VoxtralRealtimeForConditionalGeneration":
        if inp.target_seq_len is not None and inp.target_seq_len != seq:
            raise SpecError("input.target_seq_len", inp.target_seq_len,
                            f"{seq} or null (= seq_len: {name}'s labels are its text tokens, aligned with the audio)")
        embedder = model.model.audio_tower.embedder
        stride = 1
        for conv in embedder.modules():
            if isinstance(conv, torch.nn.Conv1d):
                stride *= conv.stride[0]
        per_token, factor = int(config.audio_length_per_tok), int(config.downsample_factor)
        if per_token != stride * factor:
            raise SpecError("model.config.audio_length_per_tok", per_token,
                            f"{stride * factor} (the encoder's conv stride {stride} x downsample_factor {factor}: "
                            "one audio embedding per text token)")
        mels = int(config.audio_config.num_mel_bins)
        extra["input_features"] = ((mels, seq * per_token), torch.float32)
        lines.append(f"input_features: [{mels}, {seq * per_token}] log-mel frames per sequence (audio_config."
                     f"num_mel_bins; audio_length_per_tok {per_token} frames per text token, as {name}'s "
                     "processor aligns audio and text)")
    elif name == "PerceiverForMaskedLM":
        label_len = int(config.max_position_embeddings)
        if label_len != seq:
            lines.append(f"labels: {label_len} positions ({name} decodes max_position_embeddings positions "
                         f"whatever the input's {seq}; those past the input are padding)")
    elif name in _CODEBOOK_LMS:
        with given_values("model.config", spec.config, "an integer num_codebooks >= 1"):
            codebooks = int(config.num_codebooks)
        if codebooks < 1:
            raise SpecError("model.config.num_codebooks", codebooks, "an integer >= 1")
        lines.append(f"input_ids: [batch x {codebooks}, {seq}] audio codes, one row per sequence and codebook "
                     f"(model.config.num_codebooks {codebooks}), labels [batch, {seq}, {codebooks}]: {name} "
                     "embeds and predicts each codebook's stream of EnCodec codes (seq_len: audio frames)")
    return extra, label_len, codebooks, lines


# Causal LMs whose positions hold one token per codebook (config.num_codebooks parallel streams)
_CODEBOOK_LMS = frozenset({"MusicgenForCausalLM", "MusicgenMelodyForCausalLM"})


def _position_key(config: Any) -> str | None:
    """The config key of the model's position table (None: no table to run past)."""
    if hasattr(config, "relative_attention_num_buckets"):
        return None  # T5: relative position buckets
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key
    return None


def _max_positions(config: Any) -> int | None:
    key = _position_key(config)
    return getattr(config, key) if key else None


def max_positions(spec: TransformersModel) -> int | None:
    """The longest seq_len the request's config and the input limit allow (None: no position table)."""
    from transformers import AutoConfig

    raw = _config_dict(spec)
    limit = _max_positions(AutoConfig.for_model(raw.pop("model_type"), **raw))
    return min(limit, MAX_SEQ_LEN) if limit is not None else None


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


def _side(value: Any) -> tuple[int, int] | None:
    """A config's ``image_size``: one side (224) or an [H, W] pair ((224, 224): hiera, pvt_v2, textnet)."""
    if type(value) is int:
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return None


def _image_shape(config: Any, prefix: str = "model.config") -> tuple[int, int, int]:
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


def _image_prompt_input(config: Any, model_class: type, inp: InputSpec) -> tuple[Any, Any, dict[str, Any], list[str]]:
    """ShieldGemma 2: its processor writes a chat prompt per (image, policy) with the image's
    ``mm_tokens_per_image`` placeholder tokens; the forward answers (B, 2) Yes/No logits and computes no loss
    (its ``labels`` would go to the language model), so the classifier is trained with cross-entropy on them."""
    vision = getattr(config, "vision_config", config)
    c, h, w = _image_shape(vision, "model.config.vision_config")
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


def _image_input(config: Any, model_class: type[torch.nn.Module], inp: InputSpec,
                 name: str) -> tuple[Any, Any, dict[str, Any], list[str]]:
    """What an image classifier's forward takes, as its image processor makes it, and its loss: (batch
    factory, loss, resolved input, assumptions).

    Most take ``pixel_values`` (B, C, H, W) of the config's num_channels and image_size, and labels. ImageGPT
    takes the resized image's color-cluster ids (``input_ids``, one per pixel: the config's n_positions);
    Siglip2 takes patches padded to the processor's ``max_num_patches`` (the vision config's num_patches), with
    their mask and grid. A classifier whose forward takes no labels (pp_lcnet) is trained with cross-entropy
    on its output."""
    params = inspect.signature(model_class.forward).parameters
    notes: list[str] = []
    if "pixel_values" not in params and "input_ids" in params:  # ImageGPT
        if inp.image_size is not None:
            raise SpecError("input.image_size", inp.image_size,
                            f"null: {name} takes color-cluster token ids, one per pixel of the image its "
                            "processor resizes (input.seq_len of them), not pixels")
        limit = _max_positions(config)
        seq = inp.seq_len or limit or 1024
        if limit is not None and seq > limit:
            raise SpecError("input.seq_len", seq, f"at most {limit}, {name}'s maximum positions")
        if inp.seq_len is None:
            notes.append(f"input.seq_len not given: {seq} color-cluster ids, the model's maximum positions "
                         f"(a {math.isqrt(seq)} x {math.isqrt(seq)} image)" if math.isqrt(seq) ** 2 == seq else
                         f"input.seq_len not given: {seq} color-cluster ids, the model's maximum positions")
        return tasks.image_tokens(seq), tasks.model_loss, {"seq_len": seq}, notes
    if "pixel_values" in params and "input_ids" in params:  # ShieldGemma 2: a policy prompt and the image
        return _image_prompt_input(config, model_class, inp)
    if "spatial_shapes" in params:  # Siglip2: pre-patchified pixels
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
    c, h, w = _image_shape(config)
    if inp.image_size is not None and inp.image_size != [c, h, w]:
        raise SpecError("input.image_size", inp.image_size,
                        f"[{c}, {h}, {w}] (the config's num_channels and image_size; change them in model.config)")
    if inp.image_size is None:
        notes.append(f"input.image_size not given: [{c}, {h}, {w}] from the config")
    if "labels" in params:
        return tasks.pixels(c, h, w), tasks.model_loss, {"image_size": [c, h, w]}, notes
    notes.append(f"loss: cross-entropy on {model_class.__name__}'s output (its forward takes no labels)")
    return tasks.pixels(c, h, w, labels=False), tasks.head_loss, {"image_size": [c, h, w]}, notes


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
        _check_values(CONFIG_MAPPING[model_type], spec.config)
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
    _check_attn(model_class, spec.attn_implementation)
    _check_experts(model_class, spec.experts_implementation)
    if task != "image-classification":
        _check_trains(model_class, model_type, task)

    def factory():
        # A config's torch_dtype is how the checkpoint is stored; training keeps
        # fp32 master weights (the recipe's precision decides the rest). The explicit None also undoes the
        # previous build's choice, which transformers leaves on the (shared) config.
        ROUTING.set(spec.moe_routing)  # tokens per expert for the eager experts loop (virtual_gpu/moe.py)
        try:
            return make(config, attn_implementation=spec.attn_implementation,
                        experts_implementation=spec.experts_implementation, dtype=torch.float32)
        except ValueError as exc:  # a sub-model class without the named kernel (the top class is checked above)
            found = _NO_KERNEL.match(str(exc))
            if found is None:
                raise
            raise SpecError("model.attn_implementation", spec.attn_implementation,
                            f"eager or null ({found.group(1)}, inside {name}, has no such kernel)") from exc

    name = spec.preset or model_type
    model = probe(factory, "model.config", spec.config)
    assumptions.append(_attention_line(model, spec.attn_implementation))
    assumptions.extend(_experts_lines(model, spec))
    assumptions.extend(_kernel_lines(model, name))
    if task == "image-classification":
        batches, loss, resolved_image, notes = _image_input(config, model_class, inp, name)
        assumptions.extend(notes)
        return BuiltModel(f"transformers:{name}", factory, batches, loss, resolved_image, count_parameters(model),
                          assumptions)
    limit = _max_positions(config)
    seq = inp.seq_len
    if seq is None:
        seq = limit or 512
        if limit:
            key = _position_key(config) or ""
            check_seq_len(limit, (f"model.config.{config.attribute_map.get(key, key)}", limit))
        assumptions.append(f"input.seq_len not given: {seq}, the model's maximum positions" if limit
                           else "input.seq_len not given: 512")
    elif limit is not None and seq > limit:
        raise SpecError("input.seq_len", seq, f"at most {limit}, {name}'s maximum positions")
    resolved: dict[str, Any] = {"seq_len": seq}
    extra, label_len, codebooks, input_lines = _text_inputs(model, config, seq, spec, inp)
    target = None
    if task == "seq2seq-lm":
        target = inp.target_seq_len or seq
        if inp.target_seq_len is None:
            assumptions.append(f"input.target_seq_len not given: {target} (= seq_len)")
        resolved["target_seq_len"] = target
    assumptions.extend(input_lines)
    batches = tasks.text(task, seq, target, extra=extra, label_len=label_len, codebooks=codebooks)
    return BuiltModel(f"transformers:{name}", factory, batches, tasks.model_loss, resolved, count_parameters(model),
                      assumptions)
