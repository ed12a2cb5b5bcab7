"""What a transformers text model's step takes besides its token ids, per architecture, as a real run feeds it.

>>> TEXT_INPUTS.find(type("PerceiverForMaskedLM", (), {}), None).name
'perceiver-decoder-labels'

Each rule is an entry of ``TEXT_INPUTS`` (``estimator/models/rules.py``): its name, the classes it matches,
and what it adds (``TextInputs``: extra inputs, the labels' length where the model fixes it, parallel code
streams, and the assumption lines that say so). A class no rule matches takes the common inputs
(``tasks.text``). Also here: the model's position table, which bounds ``input.seq_len``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from estimator.errors import SpecError
from estimator.models.building import check_image, given_values
from estimator.models.rules import Rules, named

if TYPE_CHECKING:
    from estimator.models.sources.transformers import TransformersModel
    from estimator.models.spec import InputSpec


@dataclass
class TextInputs:
    """``extra``: input name -> (per-sample shape, dtype); ``label_len``: the labels' length where the model
    fixes it; ``codebooks``: parallel code streams per position; ``lines``: the assumption lines."""

    extra: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    label_len: int | None = None
    codebooks: int | None = None
    lines: list[str] = field(default_factory=list)


TEXT_INPUTS = Rules("transformers text inputs")


def text_inputs(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """The inputs of the rule that matches ``model``'s class, or the common inputs alone."""
    rule = TEXT_INPUTS.find(type(model), config)
    return rule.apply(model, config, seq, spec, inp) if rule is not None else TextInputs()


@TEXT_INPUTS.register("git-image-per-sequence", named("GitForCausalLM"))
def _git(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """GIT's loss scores the text after the image tokens it prepends (``logits[:, num_image_tokens:-1]``), so
    text alone leaves nothing to score: one image per sequence, of vision_config's num_channels and image_size
    (a video config, ``num_image_with_embedding``, takes that many frames)."""
    vision = config.vision_config
    with given_values("model.config", spec.config, "integers vision_config.num_channels and image_size"):
        c, side = int(vision.num_channels), int(vision.image_size)
    check_image(c, side, side, ("model.config.vision_config.num_channels", c),
                ("model.config.vision_config.image_size", side))
    frames = getattr(config, "num_image_with_embedding", None)
    shape = (c, side, side) if not frames else (int(frames), c, side, side)
    tokens = model.git.encoder.layer[0].attention.self.image_patch_tokens
    what = "one image" if not frames else f"{frames} frames (num_image_with_embedding)"
    return TextInputs({"pixel_values": (shape, torch.float32)}, lines=[
        f"pixel_values: {what} of {list(shape)} per sequence (vision_config's num_channels and image_size): "
        f"{type(model).__name__}'s loss scores the text after its {tokens} image tokens"])


def _takes_lang_ids(model_class: type[Any], config: Any) -> bool:
    return "lang_ids" in inspect.signature(model_class.forward).parameters \
        and getattr(config, "default_language", None) is None


@TEXT_INPUTS.register("xmod-language", _takes_lang_ids)
def _xmod(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """X-MOD: each sequence's language (``lang_ids``) picks its adapter, and without them or a
    ``default_language`` the model refuses to run: every sequence in the first of ``config.languages``, as
    ``set_default_language(languages[0])`` would."""
    languages = list(getattr(config, "languages", ()))
    return TextInputs({"lang_ids": ((), torch.long)}, lines=[
        f"lang_ids: every sequence in {languages[0] if languages else 'language 0'} (the first of "
        "model.config.languages, as set_default_language would; model.config.default_language chooses another)"])


@TEXT_INPUTS.register("voxtral-aligned-audio", named("VoxtralRealtimeForConditionalGeneration"))
def _voxtral(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """VoxtralRealtime: its text tokens are aligned with the audio, each to ``audio_length_per_tok`` mel frames
    (= the embedder's conv strides x ``downsample_factor``), which its encoder turns into one embedding added to
    the token's: ``input_features`` of (num_mel_bins, seq_len x that) frames, labels as long as the text."""
    name = type(model).__name__
    if inp.target_seq_len is not None and inp.target_seq_len != seq:
        raise SpecError("input.target_seq_len", inp.target_seq_len,
                        f"{seq} or null (= seq_len: {name}'s labels are its text tokens, aligned with the audio)")
    stride = 1
    for conv in model.model.audio_tower.embedder.modules():
        if isinstance(conv, torch.nn.Conv1d):
            stride *= conv.stride[0]
    per_token, factor = int(config.audio_length_per_tok), int(config.downsample_factor)
    if per_token != stride * factor:
        raise SpecError("model.config.audio_length_per_tok", per_token,
                        f"{stride * factor} (the encoder's conv stride {stride} x downsample_factor {factor}: "
                        "one audio embedding per text token)")
    mels = int(config.audio_config.num_mel_bins)
    return TextInputs({"input_features": ((mels, seq * per_token), torch.float32)}, lines=[
        f"input_features: [{mels}, {seq * per_token}] log-mel frames per sequence (audio_config.num_mel_bins; "
        f"audio_length_per_tok {per_token} frames per text token, as {name}'s processor aligns audio and text)"])


@TEXT_INPUTS.register("perceiver-decoder-labels", named("PerceiverForMaskedLM"))
def _perceiver(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """PerceiverForMaskedLM: its decoder queries ``max_position_embeddings`` positions whatever the input's
    length (the logits are that long): labels that long."""
    label_len = int(config.max_position_embeddings)
    lines = [] if label_len == seq else [
        f"labels: {label_len} positions ({type(model).__name__} decodes max_position_embeddings positions "
        f"whatever the input's {seq}; those past the input are padding)"]
    return TextInputs(label_len=label_len, lines=lines)


@TEXT_INPUTS.register("musicgen-codebooks", named("MusicgenForCausalLM", "MusicgenMelodyForCausalLM"))
def _codebooks(model: Any, config: Any, seq: int, spec: TransformersModel, inp: InputSpec) -> TextInputs:
    """MusicGen's decoder: each position holds one audio code per codebook (``config.num_codebooks`` EnCodec
    streams), which it embeds and sums, and it predicts each with its own head: ``input_ids`` of (batch x
    num_codebooks, seq) and labels of (batch, seq, num_codebooks), as its forward takes them; seq_len counts
    audio frames."""
    with given_values("model.config", spec.config, "an integer num_codebooks >= 1"):
        codebooks = int(config.num_codebooks)
    if codebooks < 1:
        raise SpecError("model.config.num_codebooks", codebooks, "an integer >= 1")
    return TextInputs(codebooks=codebooks, lines=[
        f"input_ids: [batch x {codebooks}, {seq}] audio codes, one row per sequence and codebook "
        f"(model.config.num_codebooks {codebooks}), labels [batch, {seq}, {codebooks}]: {type(model).__name__} "
        "embeds and predicts each codebook's stream of EnCodec codes (seq_len: audio frames)"])


def position_key(config: Any) -> str | None:
    """The config key of the model's position table (None: no table to run past)."""
    if hasattr(config, "relative_attention_num_buckets"):
        return None  # T5: relative position buckets
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key
    return None


def max_positions(config: Any) -> int | None:
    """The length of the model's position table (None: it has none)."""
    key = position_key(config)
    return getattr(config, key) if key else None
