"""Image classifiers get what their forward takes, sized from their config, and the loss a user trains.

transformers' image classifiers differ in their inputs: an [H, W] ``image_size`` (hiera, pvt_v2, textnet),
color-cluster ids instead of pixels (ImageGPT), pre-patchified pixels with a mask and a grid (Siglip2), a
prompt with the image's tokens (ShieldGemma 2), no ``labels`` argument (pp_lcnet); the auto class's choice
among several classes when the config names no architecture (deit, levit, perceiver). timm feature encoders
without a head are refused, and so is a model type whose kernels library is missing (dinat).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support import A100_80 as A100
from support import build_request

from estimator.errors import SpecError
from estimator.models import tasks
from estimator.models.allowed import REFUSED_MODEL_TYPES
from estimator.models.meta import build_on_meta
from estimator.request.adapt import recipe_of
from estimator.request.parse import parse_request
from estimator.simulate.record import record_built

pytestmark = pytest.mark.sim



def _request(config: dict, **inp) -> dict:
    return {"model": {"source": "transformers", "config": config, "task": "image-classification"}, "input": inp,
            "batch_size": 2, "gpus": ["A100-80GB"]}


def _built(config: dict, **inp):
    return build_request(parse_request(_request(config, **inp)))


def _simulates(request: dict) -> None:
    parsed = parse_request(request)
    built = build_request(parsed)
    trace = record_built(built, 2, recipe_of(parsed), A100)
    assert trace.events and not built.worst_case  # a step was recorded, from the batch's own values


PVT = {"model_type": "pvt_v2", "hidden_sizes": [8, 16, 24, 32], "depths": [1, 1, 1, 1],
       "num_attention_heads": [1, 1, 1, 1], "mlp_ratios": [1, 1, 1, 1], "sr_ratios": [8, 4, 2, 1], "num_labels": 3}


def test_an_hw_image_size_pair_sets_the_input() -> None:
    built = _built({**PVT, "image_size": [64, 96]})
    assert built.input == {"image_size": [3, 64, 96]}
    inputs, target = built.batch_factory(2, "meta")
    assert inputs["pixel_values"].shape == (2, 3, 64, 96) and target is None
    assert _built({**PVT, "image_size": [64, 96]}, image_size=[3, 64, 96]).input == {"image_size": [3, 64, 96]}
    with pytest.raises(SpecError) as err:
        _built({**PVT, "image_size": [64, 96]}, image_size=[3, 96, 64])
    assert err.value.field == "input.image_size" and "[3, 64, 96]" in err.value.expected
    with pytest.raises(SpecError) as err:
        _built({**PVT, "image_size": [64, 96, 3]})
    assert err.value.field == "model.config.image_size"


def test_an_hw_pair_simulates() -> None:
    _simulates(_request({**PVT, "image_size": [64, 96]}))


def test_textnet_channels_come_from_stem_num_channels() -> None:
    config = {"model_type": "textnet", "image_size": [64, 64], "stem_num_channels": 1}
    assert _built(config).input == {"image_size": [1, 64, 64]}


DEIT = {"model_type": "deit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "image_size": 32, "patch_size": 8}


def test_a_config_without_architectures_builds_the_first_class() -> None:
    # deit maps to (DeiTForImageClassification, ...WithTeacher); transformers iterated config.architectures (None)
    built = _built(DEIT)
    assert type(build_on_meta(built.factory)).__name__ == "DeiTForImageClassification"
    assert built.loss_fn is tasks.model_loss


def test_a_classifier_without_labels_trains_on_its_output() -> None:
    built = _built({"model_type": "pp_lcnet", "num_labels": 5})
    assert built.loss_fn is tasks.head_loss
    inputs, target = built.batch_factory(2, "meta")
    assert set(inputs) == {"pixel_values"} and target.shape == (2,)
    logits = torch.zeros(2, 5, requires_grad=True)
    assert tasks.head_loss(SimpleNamespace(last_hidden_state=logits), torch.zeros(2, dtype=torch.long)).dim() == 0
    with pytest.raises(TypeError, match="logits"):
        tasks.head_loss(SimpleNamespace(last_hidden_state=torch.zeros(2, 5, 4, 4)), torch.zeros(2, dtype=torch.long))


IMAGEGPT = {"model_type": "imagegpt", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}


def test_imagegpt_takes_one_color_cluster_id_per_pixel() -> None:
    built = _built(IMAGEGPT)
    assert built.input == {"seq_len": 64}
    inputs, _ = built.batch_factory(2, "meta")
    assert inputs["input_ids"].shape == (2, 64) and inputs["input_ids"].dtype == torch.long
    assert _built(IMAGEGPT, seq_len=16).input == {"seq_len": 16}
    with pytest.raises(SpecError) as err:
        _built(IMAGEGPT, image_size=[3, 32, 32])
    assert err.value.field == "input.image_size"
    with pytest.raises(SpecError) as err:
        _built(IMAGEGPT, seq_len=65)
    assert err.value.field == "input.seq_len"


SIGLIP2 = {"model_type": "siglip2", "vision_config": {"hidden_size": 32, "intermediate_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                                      "num_patches": 64, "patch_size": 8}}


def test_siglip2_takes_patches_padded_to_the_processors_maximum() -> None:
    built = _built(SIGLIP2)
    assert built.input == {"image_size": [3, 64, 64], "seq_len": 64}
    inputs, _ = built.batch_factory(2, "meta")
    assert inputs["pixel_values"].shape == (2, 64, 3 * 8 * 8)
    assert inputs["pixel_attention_mask"].shape == (2, 64) and inputs["spatial_shapes"].shape == (2, 2)
    wide = _built(SIGLIP2, image_size=[3, 64, 256])  # the processor keeps the aspect within 64 patches: 4 x 16
    real, _ = wide.batch_factory(1, "cpu")
    assert real["spatial_shapes"].tolist() == [[4, 16]] and int(real["pixel_attention_mask"].sum()) == 64
    tall = _built(SIGLIP2, image_size=[3, 256, 64], seq_len=32)
    real, _ = tall.batch_factory(1, "cpu")
    rows, cols = real["spatial_shapes"][0].tolist()
    assert rows > cols and int(real["pixel_attention_mask"].sum()) == rows * cols <= 32


def test_siglip2_simulates() -> None:
    # its position embeddings' resize checks spatial_shapes > 0 with torch._check_tensor_all: a value read
    _simulates(_request(SIGLIP2))


def test_a_timm_feature_encoder_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        build_request(parse_request({"model": {"source": "timm", "name": "mobilenetv5_300m_enc"}}))
    assert err.value.field == "model.name" and "feature encoder" in err.value.expected
    assert "mobilenetv5_300m with model.kwargs num_classes" in err.value.expected


@pytest.mark.skipif("dinat" not in REFUSED_MODEL_TYPES, reason="natten is installed here")
def test_dinat_without_natten_is_refused_by_name() -> None:
    with pytest.raises(SpecError) as err:
        build_request(parse_request(_request({"model_type": "dinat"})))
    assert err.value.field == "model.config.model_type" and "natten" in err.value.expected


SHIELDGEMMA2 = {"model_type": "shieldgemma2", "mm_tokens_per_image": 16,
                "vision_config": {"image_size": 64, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 1, "num_attention_heads": 2},
                "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}}


def test_shieldgemma2_reads_a_prompt_holding_the_images_tokens() -> None:
    built = _built(SHIELDGEMMA2, seq_len=40)
    assert built.input == {"image_size": [3, 64, 64], "seq_len": 40} and built.loss_fn is tasks.head_loss
    inputs, target = built.batch_factory(2, "cpu")
    assert inputs["pixel_values"].shape == (2, 3, 64, 64) and target.shape == (2,)
    image_token = build_on_meta(built.factory).config.image_token_id
    assert (inputs["input_ids"] == image_token).sum(-1).tolist() == [16, 16]
    assert torch.equal(inputs["token_type_ids"], (inputs["input_ids"] == image_token).long())
    with pytest.raises(SpecError) as err:
        _built(SHIELDGEMMA2, seq_len=17)
    assert err.value.field == "input.seq_len" and "at least 18" in err.value.expected
    with pytest.raises(SpecError) as err:
        _built(SHIELDGEMMA2, image_size=[3, 32, 32])
    assert err.value.field == "input.image_size"
