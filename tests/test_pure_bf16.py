"""Pure bf16 (``training.precision: "bf16"``) for every source and task.

Weights, gradients and optimizer states are bf16; floating inputs reach the
forward as bf16 copies (Lightning's ``bf16-true``: ``convert_input`` casts
every floating tensor, nested ones too), token ids and labels stay integers,
and torchvision's detection targets stay fp32 (its ``check_targets`` refuses
bf16 boxes). Before, every image model failed with "Input type (float) and
bias type (c10::BFloat16) should be the same".
"""

from __future__ import annotations

import pytest
import torch
from support import build_request

from estimator.gpus import get_gpu
from estimator.pipeline import estimate
from estimator.request.adapt import recipe_of
from estimator.request.parse import parse_request
from estimator.simulate.record import record_training

pytestmark = pytest.mark.sim

BATCH = 2
QUICK = {"confirm": "none", "curve_points": 0}

# (request model + input, bytes of one sample's floating input as the forward gets it in bf16)
CASES = {
    "torchvision classification": (
        {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]}},
        3 * 64 * 64 * 2),  # (3, 64, 64) bf16
    "torchvision segmentation": (
        {"model": {"source": "torchvision", "name": "lraspp_mobilenet_v3_large"},
         "input": {"image_size": [3, 64, 64]}},
        3 * 64 * 64 * 2),
    "torchvision video": (
        {"model": {"source": "torchvision", "name": "r3d_18"}, "input": {"image_size": [3, 32, 32], "num_frames": 4}},
        3 * 4 * 32 * 32 * 2),  # (C, T, H, W) bf16
    "torchvision detection": (
        {"model": {"source": "torchvision", "name": "fasterrcnn_mobilenet_v3_large_320_fpn"}},
        3 * 320 * 320 * 2),  # each image of the list, cast; boxes stay fp32
    "timm": (
        {"model": {"source": "timm", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]}},
        3 * 64 * 64 * 2),
    "transformers image-classification": (
        {"model": {"source": "transformers", "preset": "vit-base-patch16-224", "task": "image-classification",
                   "config": {"num_hidden_layers": 2}}},
        3 * 224 * 224 * 2),
    "transformers text": (
        {"model": {"source": "transformers", "preset": "gpt2", "config": {"n_layer": 2}}, "input": {"seq_len": 64}},
        None),  # token ids only: nothing floating to cast
}


def _request(case: str):
    body, _ = CASES[case]
    return parse_request({**body, "training": {"precision": "bf16"}, "gpus": ["A100-40GB"], "planner": QUICK})


@pytest.mark.parametrize("case", list(CASES))
def test_pure_bf16_simulates_with_bf16_weights_and_inputs(case: str) -> None:
    request = _request(case)
    built = build_request(request)
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, BATCH, recipe_of(request),
                            get_gpu("A100-40GB"), worst_case=built.worst_case)
    params = [a for a in trace.allocations if a.category == "parameter"]
    # 2 bytes a parameter: bf16 weights (tied weights are one storage, counted once by parameter_count too)
    assert sum(a.nbytes for a in params) == 2 * built.parameter_count
    grads = [a for a in trace.allocations if a.category == "gradient" and a.iteration == 1]
    assert sum(a.nbytes for a in grads) == 2 * built.parameter_count  # bf16 gradients
    _, sample_bytes = CASES[case]
    casts = [a for a in trace.allocations if a.phase == "forward" and a.op == "_to_copy" and a.iteration == 1]
    if sample_bytes is None:
        # token ids, attention mask and labels: (B, 64) int64 each, nothing floating to cast
        assert {a.nbytes for a in trace.allocations if a.category == "input"} == {BATCH * 64 * 8}
    elif built.worst_case:
        # detection: one (3, H, W) copy per image, first in the forward
        assert [a.nbytes for a in casts[:BATCH]] == [sample_bytes] * BATCH
    else:
        assert casts[0].nbytes == BATCH * sample_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c != "torchvision detection"])
def test_pure_bf16_request_answers(case: str) -> None:
    """Through the request path (detection's full search is too slow here: its single step is tested above)."""
    response = estimate(_request(case))
    result = response.results[0]
    assert result.max_batch_size is not None and result.max_batch_size > BATCH
    assert result.memory.fits


def test_pure_bf16_holds_fewer_bytes_than_fp32() -> None:
    """The same resnet18 step: bf16 weights, grads, AdamW states and activations are half of fp32's."""
    body, _ = CASES["torchvision classification"]
    peaks = {}
    for precision in ("fp32", "bf16"):
        request = parse_request({**body, "training": {"precision": precision}, "gpus": ["A100-40GB"],
                                 "batch_size": 16, "planner": QUICK})
        peaks[precision] = estimate(request).results[0].memory.allocated_peak_bytes
    assert 0.45 < peaks["bf16"] / peaks["fp32"] < 0.6, peaks


def test_forward_inputs_keeps_integers_and_named_positions() -> None:
    from estimator.simulate.recipe import Recipe

    x, ids = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    out = Recipe(precision="bf16").forward_inputs((x, {"ids": ids, "boxes": x}), keep=(1,))
    assert out[0].dtype == torch.bfloat16 and out[1]["boxes"].dtype == torch.float32
    assert out[1]["ids"].dtype == torch.long
    assert Recipe(precision="amp-bf16").forward_inputs(x) is x  # autocast casts per op, not the batch
