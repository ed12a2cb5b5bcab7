"""The inputs and labels of transformers text models whose training step takes more than token ids:
what a real run feeds them, and the assumption line that says so (estimator/models/transformers_models.py,
``_text_inputs``; estimator/models/tasks.py, ``text``). Tiny configs, batch 1 or 2, so each build takes seconds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import A100_40 as A100
from support import build_request

from estimator.errors import SpecError
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built
from estimator.testing import coverage

pytestmark = pytest.mark.sim

S = 16

TEXT = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "vocab_size": 1000, "max_position_embeddings": 256}
GIT = {"model_type": "git", **TEXT,
       "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "image_size": 32, "patch_size": 16}}
XMOD = {"model_type": "xmod", **TEXT, "languages": ["de_DE", "en_XX"]}
VOXTRAL = {"model_type": "voxtral_realtime",
           "audio_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "head_dim": 16, "num_mel_bins": 32},
           "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}}
PERCEIVER = {"model_type": "perceiver", "num_latents": 16, "d_latents": 64, "d_model": 64, "num_blocks": 1,
             "num_self_attends_per_block": 1, "num_self_attention_heads": 2, "num_cross_attention_heads": 1,
             "max_position_embeddings": 128}


def _built(config: dict[str, Any], task: str, **inp: Any) -> Any:
    return build_request(parse_request({"model": {"source": "transformers", "config": config, "task": task},
                                "input": {"seq_len": S, **inp}, "gpus": ["A100-40GB"]}))


def _batch(built: Any, b: int = 2) -> dict[str, torch.Tensor]:
    inputs, targets = built.batch_factory(b, torch.device("meta"))
    assert targets is None  # transformers compute their own loss from the labels
    return inputs


def _line(built: Any, prefix: str) -> str:
    return next(a for a in built.assumptions if a.startswith(prefix))


def _simulates(built: Any, b: int = 1) -> Any:
    """One simulated step, as a request runs it (under the worst-case policy where the model needs it)."""
    return record_built(built, b, Recipe(), A100)


def test_git_trains_on_an_image_per_sequence() -> None:
    """GIT scores the text after its image tokens ((32 / 16)^2 + 1 = 5): without pixel_values none are left."""
    built = _built(GIT, "causal-lm")
    batch = _batch(built)
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].shape == batch["input_ids"].shape == (2, S)
    assert _line(built, "pixel_values: ") == (
        "pixel_values: one image of [3, 32, 32] per sequence (vision_config's num_channels and image_size): "
        "GitForCausalLM's loss scores the text after its 5 image tokens")
    _simulates(built)


def test_git_video_config_takes_its_frames() -> None:
    assert _batch(_built({**GIT, "num_image_with_embedding": 3}, "causal-lm"))["pixel_values"].shape == \
        (2, 3, 3, 32, 32)


@pytest.mark.parametrize("task", ["causal-lm", "masked-lm"])
def test_xmod_sequences_are_in_the_first_language(task: str) -> None:
    built = _built(XMOD, task)
    lang_ids = _batch(built)["lang_ids"]
    assert lang_ids.shape == (2,) and lang_ids.dtype == torch.long  # one language per sequence, index 0
    assert _line(built, "lang_ids: ").startswith("lang_ids: every sequence in de_DE (the first of model.config."
                                                 "languages")
    _simulates(built)


def test_xmod_default_language_is_the_models_own() -> None:
    built = _built({**XMOD, "default_language": "en_XX"}, "masked-lm")
    assert "lang_ids" not in _batch(built)
    assert not [a for a in built.assumptions if a.startswith("lang_ids")]


def test_xmod_every_adapter_may_get_every_row() -> None:
    """Under the worst-case policy (``hidden_states[lang_ids == i]``) the placeholder lang_ids are not the data:
    every language's adapter may get all 2 x 16 rows (a (32, 32) fp32 output of its dense1), an upper bound."""
    built = _built(XMOD, "masked-lm")
    trace = record_built(built, 2, Recipe(), A100)
    adapters = {a.module.split(".")[-2] for a in trace.allocations
                if a.iteration == 0 and ".adapter_modules." in a.module and a.op == "addmm"}
    assert adapters == {"de_DE", "en_XX"}
    for language in adapters:
        dense1 = [a.nbytes for a in trace.allocations if a.iteration == 0 and a.phase == "forward"
                  and a.module.endswith(f"layer.0.output.adapter_modules.{language}.dense1") and a.op == "addmm"]
        assert dense1 == [2 * S * 32 * 4], language


def test_voxtral_realtime_audio_is_aligned_with_the_text() -> None:
    """audio_length_per_tok (8) frames per token: conv2's stride 2 x downsample_factor 4 make one embedding."""
    built = _built(VOXTRAL, "seq2seq-lm")
    batch = _batch(built)
    assert batch["input_features"].shape == (2, 32, S * 8)
    assert batch["labels"].shape == (2, S)
    assert _line(built, "input_features: ").startswith("input_features: [32, 128] log-mel frames per sequence")
    _simulates(built)


def test_voxtral_realtime_labels_are_the_texts_length() -> None:
    with pytest.raises(SpecError) as err:
        _built(VOXTRAL, "seq2seq-lm", target_seq_len=2 * S)
    assert err.value.field == "input.target_seq_len"
    with pytest.raises(SpecError) as err:
        _built({**VOXTRAL, "audio_length_per_tok": 4}, "seq2seq-lm")
    assert err.value.field == "model.config.audio_length_per_tok" and err.value.expected.startswith("8 ")


def test_perceiver_labels_are_as_long_as_its_decoder() -> None:
    built = _built(PERCEIVER, "masked-lm")
    batch = _batch(built)
    assert batch["input_ids"].shape == (2, S) and batch["labels"].shape == (2, 128)
    assert _line(built, "labels: ").startswith("labels: 128 positions (PerceiverForMaskedLM decodes")
    _simulates(built)


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_a_draft_model_without_a_loss_is_the_requests_error(model_type: str) -> None:
    with pytest.raises(SpecError) as err:
        build_request(parse_request(coverage.transformers_request("causal-lm", model_type)))
    assert err.value.field == "model.config.model_type" and err.value.value == model_type
    assert "takes no labels and computes no loss" in err.value.expected
    assert "shared_kv_states" in err.value.expected


MUSICGEN_DECODER = {"num_hidden_layers": 1, "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4,
                    "vocab_size": 128, "pad_token_id": 128, "bos_token_id": 128, "num_codebooks": 3}


@pytest.mark.parametrize(("model_type", "name"), [("musicgen", "MusicgenForCausalLM"),
                                                  ("musicgen_melody", "MusicgenMelodyForCausalLM")])
def test_musicgen_decoder_takes_one_row_per_codebook(model_type: str, name: str) -> None:
    """MusicGen's decoder sums one embedding per codebook and predicts each with its own head: input_ids of
    (batch x num_codebooks, seq), the mask (batch, seq), labels (batch, seq, num_codebooks); 3, not the class's 4."""
    built = _built({"model_type": model_type, "decoder": MUSICGEN_DECODER}, "causal-lm")
    batch = _batch(built)
    assert batch["input_ids"].shape == (2 * 3, S) and batch["attention_mask"].shape == (2, S)
    assert batch["labels"].shape == (2, S, 3) and batch["labels"].dtype == torch.long
    assert _line(built, "input_ids: ") == (
        f"input_ids: [batch x 3, {S}] audio codes, one row per sequence and codebook (model.config.num_codebooks "
        f"3), labels [batch, {S}, 3]: {name} embeds and predicts each codebook's stream of EnCodec codes "
        "(seq_len: audio frames)")
    _simulates(built, 2)
