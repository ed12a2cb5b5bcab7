"""Every builder's models build on meta, simulate a training step at batch 1,
and have exactly the parameters of the same model built for real.

Real builds run on the CPU. transformers presets are built with
``no_init_weights`` (random init changes no parameter; gpt2-xl's takes 40 s
here) and then tied as ``from_config`` ties them; the 7B presets are too large
to build here, so their counts are derived from the config below.
"""

from __future__ import annotations

import json

import pytest
import torch
import torchvision.models as tvm
from support import A100_80 as A100
from support import build_request

from estimator.errors import BatchTooSmallError
from estimator.models.meta import build_on_meta
from estimator.models.sources.transformers.build import AUTO_CLASSES, presets
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training

pytestmark = pytest.mark.zoo


BLOCK = 512  # the caching allocator rounds every request up to 512 B ...
MIB = 2**20  # ... and hands a large-pool block out whole when less than 1 MiB would remain


def simulate_batch_1(built) -> None:
    """One simulated step at batch 1; every parameter lives on the virtual GPU.

    Models whose batch norm sees 1x1 maps (or a flat (1, C) input) cannot
    train at batch 1 at all: PyTorch raises on a real step too, which is
    checked on the CPU, and they are simulated at batch 2 instead.
    """
    tensors = list(build_on_meta(built.factory).parameters())
    batch = 1
    try:
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, 1, Recipe(), A100,
                                worst_case=built.worst_case)
    except BatchTooSmallError:
        real = built.factory().train()
        inputs, _ = built.batch_factory(1, "cpu")
        with torch.no_grad(), pytest.raises(ValueError):
            real(*inputs) if isinstance(inputs, tuple) else real(inputs)
        del real
        batch = 2
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, 2, Recipe(), A100,
                                worst_case=built.worst_case)
    report = report_from_trace(trace, batch, A100)
    fp32 = 4 * built.parameter_count
    slack = sum(BLOCK if 4 * t.numel() <= MIB else MIB + BLOCK for t in tensors)
    assert fp32 <= report.breakdown.parameters <= fp32 + slack
    # AdamW: parameters, gradients and two states at least, somewhere in the step
    assert trace.live_peak()[0] >= 3 * fp32


def _request(model: dict, **inp) -> dict:
    return {"model": model, "input": inp, "gpus": ["A100-80GB"]}


# --- torchvision ----------------------------------------------------------

@pytest.mark.parametrize("name", tvm.list_models(module=tvm))
def test_torchvision_classification(name: str) -> None:
    built = build_request(parse_request(_request({"source": "torchvision", "name": name})))
    kwargs = {"init_weights": False} if name in ("googlenet", "inception_v3") else {}
    real = tvm.get_model(name, weights=None, **kwargs)
    assert built.parameter_count == sum(p.numel() for p in real.parameters())
    del real
    simulate_batch_1(built)


@pytest.mark.parametrize("name", tvm.list_models(module=tvm.segmentation) + tvm.list_models(module=tvm.video))
def test_torchvision_segmentation_and_video(name: str) -> None:
    built = build_request(parse_request(_request({"source": "torchvision", "name": name})))
    extra = {"weights_backbone": None} if name in tvm.list_models(module=tvm.segmentation) else {}
    real = tvm.get_model(name, weights=None, **extra)
    assert built.parameter_count == sum(p.numel() for p in real.parameters())
    del real
    simulate_batch_1(built)


@pytest.mark.parametrize("name", tvm.list_models(module=tvm.detection))
def test_torchvision_detection(name: str) -> None:
    built = build_request(parse_request(_request({"source": "torchvision", "name": name})))
    assert built.worst_case  # proposals and NMS survivors at their maximum: an upper bound
    real = tvm.get_model(name, weights=None, weights_backbone=None)
    assert built.parameter_count == sum(p.numel() for p in real.parameters())
    del real
    simulate_batch_1(built)


def test_detection_samplers_keep_their_size() -> None:
    """Faster R-CNN samples 512 proposals per image for the box head: a mask with at most
    512 ones, which the worst-case policy counts instead of taking all ~2000 proposals."""
    built = build_request(parse_request(_request({"source": "torchvision", "name": "fasterrcnn_resnet50_fpn"},
                                         image_size=[3, 800, 800])))
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, 2, Recipe(), A100, worst_case=True)
    pooled = [a.nbytes for a in trace.allocations if a.op == "roi_align" and a.phase == "forward"]
    # MultiScaleRoIAlign output: 2 images x 512 proposals x 256 channels x 7 x 7 x 4 B = 51,380,224
    assert max(pooled) == 2 * 512 * 256 * 7 * 7 * 4


# --- timm: 44 models across families ----------------------------------------

TIMM = [
    # ResNet family
    "resnet18", "resnet50", "resnext50_32x4d", "seresnet50", "resnetv2_50", "wide_resnet50_2",
    # EfficientNet family
    "efficientnet_b0", "efficientnet_b3", "efficientnetv2_rw_s", "tf_efficientnet_b0", "efficientnet_lite0",
    # RegNet
    "regnetx_002", "regnety_016", "regnety_040", "regnetz_b16",
    # ConvNeXt
    "convnext_atto", "convnext_tiny", "convnextv2_atto", "convnext_small",
    # ViT
    "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_base_patch32_224",
    # DeiT
    "deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_distilled_patch16_224", "deit3_small_patch16_224",
    # Swin
    "swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224", "swinv2_tiny_window8_256",
    # MLP-Mixer and relatives
    "mixer_s16_224", "mixer_b16_224", "resmlp_12_224", "gmlp_s16_224",
    # MobileNet
    "mobilenetv2_100", "mobilenetv3_large_100", "mobilenetv3_small_100", "mobilenetv4_conv_small",
    # others
    "densenet121", "inception_v3", "xception41", "dla34", "ghostnet_100", "levit_128",
]


@pytest.mark.parametrize("name", TIMM)
def test_timm(name: str) -> None:
    import timm

    built = build_request(parse_request(_request({"source": "timm", "name": name})))
    real = timm.create_model(name, pretrained=False)
    assert built.parameter_count == sum(p.numel() for p in real.parameters())
    del real
    simulate_batch_1(built)


def test_timm_list_is_wide_enough() -> None:
    assert len(TIMM) >= 40


# --- transformers presets ---------------------------------------------------

# Derived from the preset configs (all without biases except Qwen2's q/k/v):
# llama-2-7b: V=32000, d=4096, L=32, ffn=11008, 32 kv heads (k, v are d x d)
#   layer = 4*d*d (q,k,v,o) 67,108,864 + 3*d*ffn 135,266,304 + 2 norms 8,192 = 202,383,360
#   32 layers 6,476,267,520 + embed V*d 131,072,000 + lm_head 131,072,000 + norm 4,096 = 6,738,415,616
# llama-3-8b: V=128256, ffn=14336, 8 kv heads of 128 (k, v are d x 1024)
#   layer = 2*d*d 33,554,432 + 2*d*1024 8,388,608 + 3*d*ffn 176,160,768 + 8,192 = 218,112,000
#   32 layers 6,979,584,000 + 2*V*d 1,050,673,152 + 4,096 = 8,030,261,248
# mistral-7b: layers as llama-3-8b (6,979,584,000) + 2*32000*4096 262,144,000 + 4,096 = 7,241,732,096
# qwen2.5-7b: V=152064, d=3584, L=28, ffn=18944, 4 kv heads of 128 (k, v are d x 512), q/k/v biases
#   layer = q d*d+d 12,848,640 + k,v 2*(d*512+512) 3,671,040 + o d*d 12,845,056
#           + 3*d*ffn 203,685,888 + 2 norms 7,168 = 233,057,792
#   28 layers 6,525,618,176 + 2*V*d 1,089,994,752 + norm 3,584 = 7,615,616,512
# tinyllama-1.1b: V=32000, d=2048, L=22, ffn=5632, 4 kv heads of 64 (k, v are d x 256)
#   layer = q, o 2*d*d 8,388,608 + k, v 2*d*256 1,048,576 + 3*d*ffn 34,603,008 + 2 norms 4,096 = 44,044,288
#   22 layers 968,974,336 + 2*V*d 131,072,000 + norm 2,048 = 1,100,048,384
# phi-2: V=51200, d=2560, L=32, ffn=10240, biases on every linear, LayerNorms with biases
#   layer = q, k, v, dense 4*(d*d+d) 26,224,640 + fc1 d*ffn+ffn 26,224,640 + fc2 ffn*d+d 26,216,960 + ln 2*d 5,120
#           = 78,671,360; 32 layers 2,517,483,520 + embed V*d 131,072,000 + head V*d+V 131,123,200 + ln 5,120
#   = 2,779,683,840
# gemma-2b: V=256000, d=2048, L=18, ffn=16384, 8 heads of 256 (q, o are d x 2048), 1 kv head (k, v d x 256), tied head
#   layer = q, o 2*d*2048 8,388,608 + k, v 2*d*256 1,048,576 + 3*d*ffn 100,663,296 + 2 norms 4,096 = 110,104,576
#   18 layers 1,981,882,368 + V*d 524,288,000 + norm 2,048 = 2,506,172,416
DERIVED = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "tinyllama-1.1b": 1_100_048_384,
    "phi-2": 2_779_683_840,
    "gemma-2b": 2_506_172_416,
}


def _real_count(preset: str, task: str) -> int:
    import transformers
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    cfg = dict(presets()[preset])
    cfg.pop("_source")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with no_init_weights():
        model = getattr(transformers, AUTO_CLASSES[task]).from_config(config, dtype=torch.float32)
    model.tie_weights()
    return sum(p.numel() for p in model.parameters())


def test_every_required_preset_is_shipped() -> None:
    required = {"bert-base-uncased", "bert-large-uncased", "roberta-base", "distilbert-base-uncased", "gpt2",
                "gpt2-medium", "gpt2-large", "gpt2-xl", "t5-small", "t5-base", "llama-2-7b", "llama-3-8b",
                "mistral-7b", "qwen2.5-7b", "vit-base-patch16-224", "tinyllama-1.1b", "phi-2", "gemma-2b"}
    assert required <= set(presets())
    for name, cfg in presets().items():
        assert cfg["_source"].startswith("huggingface.co/"), name
        json.dumps(cfg)


@pytest.mark.parametrize("preset", sorted(presets()))
def test_preset(preset: str) -> None:
    inp = {} if preset.startswith("vit") else {"seq_len": 64}
    built = build_request(parse_request(_request({"source": "transformers", "preset": preset}, **inp)))
    arch = presets()[preset]["architectures"][0]
    task = next(t for suffix, t in (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
                                    ("ForMaskedLM", "masked-lm"), ("ForConditionalGeneration", "seq2seq-lm"),
                                    ("ForImageClassification", "image-classification")) if arch.endswith(suffix))
    expected = DERIVED.get(preset) or _real_count(preset, task)
    assert built.parameter_count == expected
    simulate_batch_1(built)


@pytest.mark.parametrize("preset, task", [
    ("bert-base-uncased", "sequence-classification"),
    ("gpt2", "sequence-classification"),
    ("t5-small", "seq2seq-lm"),
    ("roberta-base", "masked-lm"),
])
def test_preset_tasks(preset: str, task: str) -> None:
    built = build_request(parse_request(_request({"source": "transformers", "preset": preset, "task": task},
                                                 seq_len=32)))
    assert built.parameter_count == _real_count(preset, task)
    simulate_batch_1(built)


def test_inline_config_overrides_a_preset_and_stands_alone() -> None:
    small = {"n_layer": 2, "n_embd": 128, "n_head": 4}
    over = build_request(parse_request(_request({"source": "transformers", "preset": "gpt2", "config": small},
                                                seq_len=16)))
    alone = build_request(parse_request(_request(
        {"source": "transformers", "config": {"model_type": "gpt2", **small}, "task": "causal-lm"}, seq_len=16)))
    # gpt2 with 2 layers of 128: wte 50257*128 6,432,896 + wpe 1024*128 131,072
    #   + per layer (ln 2*256 + attn 128*384+384 + 128*128+128 + mlp 128*512+512 + 512*128+128) 2*198,272
    #   + ln_f 256 = 6,960,768
    assert over.parameter_count == alone.parameter_count == 6_960_768
    simulate_batch_1(over)


def test_attn_implementation_selects_the_kernel() -> None:
    def peak(attn: str) -> int:
        built = build_request(parse_request(_request(
            {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 2}, "attn_implementation": attn},
            seq_len=512)))
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, 4, Recipe(), A100)
        return report_from_trace(trace, 4, A100).allocated_peak_bytes
    # eager keeps (B, H, S, S) fp32 probabilities per layer; flash attention (sdpa on an A100) does not:
    # 2 layers x (softmax out + dropout out 4*12*512*512*4 = 50,331,648 each + bool mask 12,582,912)
    assert peak("eager") - peak("sdpa") >= 2 * 50_331_648
