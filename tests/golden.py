"""Recorded answers for 20 requests: what a refactor must leave byte for byte as it was.

    python tests/golden.py          # re-record tests/golden.json (only when an answer is meant to change)

Each request runs through ``estimate`` on three cards (sm75, sm80, sm90);
per card the max and recommended batch, how the max was found, and the
allocated, reserved and device peaks at the max (tests/golden.json). The
rest of each response's numbers (tests/golden_details.json): per card the
memory at the max and at the recommendation, and a 4-point memory curve;
per request the per-sample and fixed bytes, FLOPs per sample, parameter
count and the breakdown. Both were recorded before the search's refactor
(commit 0cbca65), and the refactored code reproduces them byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PATH = Path(__file__).with_name("golden.json")
DETAILS = Path(__file__).with_name("golden_details.json")
MEMORY = ("batch_size", "allocated_peak_bytes", "reserved_peak_bytes", "device_peak_bytes", "fits", "peak_phase",
          "peak_module")
BREAKDOWN = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "buffers",
             "workspace", "batch_size")
CARDS = ["T4-16GB", "A100-40GB", "H100-80GB"]
TV = lambda name, **k: {"source": "torchvision", "name": name, **k}  # noqa: E731
TIMM = lambda name: {"source": "timm", "name": name}  # noqa: E731
HF = lambda preset, **k: {"source": "transformers", "preset": preset, **k}  # noqa: E731
SMALL = {"image_size": [3, 64, 64]}
LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}

# name -> (model, input, training)
REQUESTS: dict[str, tuple[dict, dict, dict]] = {
    "resnet18 fp32": (TV("resnet18"), {}, {}),
    "resnet50 amp-bf16": (TV("resnet50"), {}, {"precision": "amp-bf16"}),
    "resnet50 amp-fp16 sgd": (TV("resnet50"), SMALL, {"precision": "amp-fp16", "optimizer": {"name": "sgd"}}),
    "resnet18 bf16": (TV("resnet18"), SMALL, {"precision": "bf16"}),
    "resnet18 cudnn.benchmark": (TV("resnet18"), SMALL, {"cudnn_benchmark": True}),
    "mobilenet_v3_small fp32": (TV("mobilenet_v3_small"), {}, {}),
    "efficientnet_b0 amp-bf16": (TV("efficientnet_b0"), SMALL, {"precision": "amp-bf16"}),
    "vit_b_16 zero_grad after-forward": (TV("vit_b_16"), {}, {"precision": "amp-bf16",
                                                             "zero_grad_at": "after-forward"}),
    "fcn_resnet50 fp32": (TV("fcn_resnet50"), {"image_size": [3, 128, 128]}, {}),
    "r3d_18 amp-bf16": (TV("r3d_18"), {"image_size": [3, 64, 64], "num_frames": 8}, {"precision": "amp-bf16"}),
    "timm resnet18 accumulation": (TIMM("resnet18"), SMALL, {"grad_accumulation_steps": 2}),
    "timm convnext_atto amp-bf16": (TIMM("convnext_atto"), SMALL, {"precision": "amp-bf16"}),
    "timm deit_tiny checkpointing": (TIMM("deit_tiny_patch16_224"), {}, {"gradient_checkpointing": True}),
    "gpt2 s256 amp-bf16": (HF("gpt2"), {"seq_len": 256}, {"precision": "amp-bf16"}),
    "gpt2 s256 eager fp32": (HF("gpt2", attn_implementation="eager"), {"seq_len": 256}, {}),
    "bert-base seq-cls s128": (HF("bert-base-uncased", task="sequence-classification"), {"seq_len": 128},
                               {"precision": "amp-fp16"}),
    "distilbert s128 adam": (HF("distilbert-base-uncased"), {"seq_len": 128}, {"optimizer": {"name": "adam"}}),
    "t5-small s128": (HF("t5-small"), {"seq_len": 128}, {"precision": "amp-bf16"}),
    "vit preset 4 layers bf16": (HF("vit-base-patch16-224", task="image-classification",
                                    config={"num_hidden_layers": 4}), {}, {"precision": "bf16"}),
    "llama 4 layers s512 ckpt": ({"source": "transformers", "config": LLAMA, "task": "causal-lm"},
                                 {"seq_len": 512}, {"precision": "amp-fp16", "gradient_checkpointing": True}),
}


def _spelled(search) -> str:
    """A ``Search`` as the recording spells it (before ``search`` was a structured field)."""
    from estimator.plan.results import SearchMethod

    return {SearchMethod.AFFINE_CHECKED: f"affine, checked at batch {search.checked_batch}",
            SearchMethod.AFFINE_CONFIRMED: "affine, confirmed", SearchMethod.AFFINE: "affine",
            SearchMethod.FULL: "full"}[search.method]


def _memory(m) -> dict | None:
    return None if m is None else {k: getattr(m, k) for k in MEMORY}


def answers(name: str) -> tuple[list[dict], dict]:
    """(the answers per card, the response's other numbers) for request ``name``: one estimate."""
    from estimator.pipeline import estimate
    from estimator.request.parse import parse_request

    model, inp, training = REQUESTS[name]
    request = parse_request({"model": model, "input": inp, "training": training, "gpus": CARDS,
                             "planner": {"curve_points": 4}})
    r = estimate(request)
    cards = [{"gpu": g.gpu, "max": g.max_batch_size, "recommended": g.recommended_batch_size,
              "search": _spelled(g.search),
              "allocated": g.memory.allocated_peak_bytes, "reserved": g.memory.reserved_peak_bytes,
              "device": g.memory.device_peak_bytes} for g in r.results]
    details = {
        "per_sample_bytes": r.per_sample_bytes, "fixed_bytes": r.fixed_bytes, "flops_per_sample": r.flops_per_sample,
        "parameter_count": r.parameter_count, "breakdown": {k: getattr(r.breakdown, k) for k in BREAKDOWN},
        "results": [{"memory": _memory(g.memory), "max_memory": _memory(g.max_memory),
                     "recommended_memory": _memory(g.recommended_memory),
                     "curve": [[c.batch_size, c.device_peak_bytes] for c in g.curve]} for g in r.results],
    }
    return cards, details


if __name__ == "__main__":
    recorded, details = {}, {}
    for name in REQUESTS:
        recorded[name], details[name] = answers(name)
        print(name, [(a["gpu"], a["max"], a["recommended"]) for a in recorded[name]], file=sys.stderr)
    PATH.write_text(json.dumps(recorded, indent=1) + "\n")
    DETAILS.write_text(json.dumps(details, indent=1, sort_keys=True) + "\n")
