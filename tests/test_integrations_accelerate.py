"""accelerate's drop-in: ``find_executable_batch_size`` calls the function once, with the estimated batch, and
hands over to accelerate's own search only after a real out-of-memory error."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402

from estimator.errors import SpecError  # noqa: E402
from estimator.integrations.accelerate import (  # noqa: E402
    OutOfMemoryFallback,
    accelerator_recipe,
    estimate_accelerate,
    find_executable_batch_size,
)
from estimator.simulate.recipe import Recipe  # noqa: E402

pytestmark = pytest.mark.sim


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


SAMPLE = (torch.rand(1, 3, 64, 64), torch.zeros(1, dtype=torch.long))


def test_the_function_is_called_once_with_the_estimated_batch() -> None:
    calls = []

    @find_executable_batch_size(starting_batch_size=100_000, model=_model(), sample=SAMPLE, loss_fn=F.cross_entropy,
                                gpu="A100-80GB")
    def train(batch_size: int, tag: str) -> int:
        calls.append((batch_size, tag))
        return batch_size

    assert train("run") == train.fit.batch_size
    assert calls == [(train.fit.batch_size, "run")]
    assert train.fit.batch_size == train.fit.result.recommended_batch_size < 100_000
    assert train.__name__ == "train"


def test_starting_batch_size_caps_the_batch() -> None:
    calls = []

    @find_executable_batch_size(starting_batch_size=16, model=_model(), sample=SAMPLE, loss_fn=F.cross_entropy,
                                gpu="A100-80GB")
    def train(batch_size: int) -> None:
        calls.append(batch_size)

    train()
    assert calls == [16] and train.fit.result.recommended_batch_size > 16


def test_a_real_out_of_memory_error_falls_back_to_accelerates_search() -> None:
    fit = estimate_accelerate(_model(), SAMPLE, loss_fn=F.cross_entropy, gpu="T4-16GB")
    fits_below = fit.batch_size // 2  # the card this run is on has half the memory the estimate assumed
    calls = []

    @find_executable_batch_size(starting_batch_size=100_000, model=_model(), sample=SAMPLE, loss_fn=F.cross_entropy,
                                gpu="T4-16GB")
    def train(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > fits_below:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    with pytest.warns(OutOfMemoryFallback):
        got = train()
    # the estimate first, then accelerate's search from 0.9 of it, down by 0.9 until one fits
    expected, batch = [fit.batch_size], fit.batch_size
    while batch > fits_below:
        batch = int(batch * 0.9)
        expected.append(batch)
    assert calls == expected and got == calls[-1] <= fits_below


def test_other_errors_propagate() -> None:
    @find_executable_batch_size(model=_model(), sample=SAMPLE, loss_fn=F.cross_entropy, gpu="T4-16GB")
    def train(batch_size: int) -> None:
        raise ValueError("not a memory error")

    with pytest.raises(ValueError, match="not a memory error"):
        train()


def test_the_models_own_loss_and_the_accelerators_recipe() -> None:
    class Scored(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).square().mean()}

    plain = estimate_accelerate(Scored(), torch.rand(1, 3, 64, 64), gpu="A100-80GB")
    assert plain.recipe == Recipe()
    try:
        Accelerator(cpu=True, mixed_precision="bf16")
        assert accelerator_recipe() == Recipe(precision="amp-bf16")
        mixed = estimate_accelerate(Scored(), torch.rand(1, 3, 64, 64), gpu="A100-80GB")
        assert mixed.recipe.precision == "amp-bf16"
        assert mixed.result.max_batch_size > plain.result.max_batch_size  # bf16 activations
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    with pytest.raises(SpecError) as info:
        estimate_accelerate(_model(), SAMPLE[0], loss_fn=F.cross_entropy, gpu="A100-80GB")
    assert info.value.field == "sample"
