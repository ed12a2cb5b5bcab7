"""Byte counts derived by hand for small models on the CPU target (raw bytes, no rounding)."""

from __future__ import annotations

import pytest

from estimator.gpus import get_gpu
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim


def totals(trace, iteration=None):
    out: dict[str, int] = {}
    for a in trace.allocations:
        if iteration is None or a.iteration == iteration:
            out[a.category] = out.get(a.category, 0) + a.nbytes
    return out


def test_mlp_bytes() -> None:
    mf, bf, lf = ZOO["mlp"]
    trace = record_training(mf, bf, lf, 32, Recipe(optimizer="adam"), None)
    t = totals(trace)
    # Linear(256, 512): 256*512*4 + 512*4 = 524,288 + 2,048; Linear(512, 10): 20,480 + 40
    params = 524_288 + 2_048 + 20_480 + 40
    assert t["parameter"] == params == 546_856
    # one gradient per parameter, made once in iteration 0 and freed by zero_grad(set_to_none)
    # then made again in iteration 1: 2 x params
    assert t["gradient"] == 2 * params
    # Adam: exp_avg + exp_avg_sq per parameter, plus a 4-byte fp32 CPU step counter each (4 params)
    assert t["optimizer_state"] == 2 * params + 4 * 4
    it1 = totals(trace, iteration=1)
    # saved for backward: ReLU's output (32*512*4 = 65,536), log_softmax's output (32*10*4 = 1,280),
    # nll_loss's total_weight (4) and the loss itself (4)
    assert it1["activation"] == 65_536 + 1_280 + 4 + 4
    # the batch: x (32*256*4 = 32,768) and int64 targets (32*8 = 256)
    assert it1["input"] == 32_768 + 256


def test_conv_bytes() -> None:
    mf, bf, lf = ZOO["conv"]
    trace = record_training(mf, bf, lf, 4, Recipe(optimizer="sgd", optimizer_kwargs={"momentum": 0.9}), None)
    t = totals(trace)
    # Conv2d(3, 8, 3): 8*3*3*3*4 = 864 + bias 32; Linear(2048, 10): 81,920 + 40
    params = 864 + 32 + 81_920 + 40
    assert t["parameter"] == params
    assert t["gradient"] == 2 * params
    # SGD momentum: one momentum buffer per parameter, made in the first step
    assert t["optimizer_state"] == params
    it1 = totals(trace, iteration=1)
    # conv output (4*8*16*16*4 = 32,768) saved by Linear through its flattened view,
    # log_softmax output (4*10*4 = 160), total_weight (4), loss (4)
    assert it1["activation"] == 32_768 + 160 + 4 + 4
    # images 4*3*16*16*4 = 12,288 and targets 4*8 = 32
    assert it1["input"] == 12_288 + 32


# The MLP's parameters: W1 512x256 (131,072 elements), b1 512, W2 10x512 (5,120), b2 10.
MLP_ELEMENTS = 131_072 + 512 + 5_120 + 10  # 136,714
# Adafactor factors a 2-D weight's second moment into a row and a column
# vector and keeps 1-D ones whole: W1 512 + 256, W2 10 + 512, b1 512, b2 10.
ADAFACTOR_ELEMENTS = 512 + 256 + 10 + 512 + 512 + 10  # 1,812


@pytest.mark.parametrize("optimizer, kwargs, state_elements, device_steps", [
    ("sgd", {}, 0, 0),                                                   # no state
    ("sgd", {"momentum": 0.9}, MLP_ELEMENTS, 0),                         # momentum_buffer
    ("sgd", {"momentum": 0.9, "nesterov": True}, MLP_ELEMENTS, 0),
    ("adam", {}, 2 * MLP_ELEMENTS, 0),                                   # exp_avg, exp_avg_sq
    ("adam", {"amsgrad": True}, 3 * MLP_ELEMENTS, 0),                    # + max_exp_avg_sq
    ("adamw", {"foreach": False}, 2 * MLP_ELEMENTS, 0),
    ("adamw", {"fused": True}, 2 * MLP_ELEMENTS, 4),                     # fused keeps `step` on the GPU
    ("adagrad", {}, MLP_ELEMENTS, 0),                                    # sum
    ("rmsprop", {}, MLP_ELEMENTS, 0),                                    # square_avg
    ("rmsprop", {"momentum": 0.9, "centered": True}, 3 * MLP_ELEMENTS, 0),  # + momentum_buffer, grad_avg
    ("adafactor", {}, ADAFACTOR_ELEMENTS, 0),
])
@pytest.mark.parametrize("precision, element_bytes", [("fp32", 4), ("bf16", 2)])
def test_optimizer_state_bytes_on_gpu(optimizer, kwargs, state_elements, device_steps, precision, element_bytes):
    mf, bf, lf = ZOO["mlp"]
    recipe = Recipe(optimizer=optimizer, optimizer_kwargs=kwargs, precision=precision)
    t = totals(record_training(mf, bf, lf, 32, recipe, get_gpu("A100-80GB")))
    assert t["parameter"] == MLP_ELEMENTS * element_bytes
    # a gradient per parameter in each of the two iterations (zero_grad sets them to None)
    assert t["gradient"] == 2 * MLP_ELEMENTS * element_bytes
    # states take the parameter's dtype; `step` counters are fp32 scalars, on the CPU
    # (not GPU memory) except for fused optimizers
    assert t.get("optimizer_state", 0) == state_elements * element_bytes + device_steps * 4


@pytest.mark.parametrize("recipe_kwargs, gradient_allocations", [
    ({}, 2),                                  # set to None by zero_grad, made again each iteration
    ({"zero_grad_set_to_none": False}, 1),    # made once, zeroed in place afterwards
    ({"grad_accumulation_steps": 3}, 2),      # made by the first micro-batch, later ones add in place
])
def test_gradient_lifetimes(recipe_kwargs, gradient_allocations) -> None:
    mf, bf, lf = ZOO["mlp"]
    recipe = Recipe(optimizer="sgd", **recipe_kwargs)
    t = totals(record_training(mf, bf, lf, 32, recipe, get_gpu("A100-80GB")))
    assert t["gradient"] == gradient_allocations * MLP_ELEMENTS * 4

