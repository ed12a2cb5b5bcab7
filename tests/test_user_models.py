"""The user's own model and step: ``estimate_memory`` of an ``nn.Module`` instance (a meta copy, the instance
untouched) and of a ``step_fn(model, batch) -> loss``; the pieces every drop-in shares
(estimator/integrations/fit.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from estimator.errors import SpecError
from estimator.gpus import get_gpu
from estimator.integrations.fit import batch_like, card_for, fit_batch, request_of
from estimator.measure.cpu import real_cpu_peak
from estimator.models.meta import meta_copy
from estimator.models.user import user_model
from estimator.pipeline import estimate_memory
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Distributed, Recipe
from estimator.trace import Category, Phase

pytestmark = pytest.mark.sim


class AutoEncoder(nn.Module):
    """An encoder with two heads (classes and a reconstruction) and a buffer (the input's mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(784, 256)
        self.classify = nn.Linear(256, 10)
        self.decode = nn.Linear(256, 784)
        self.register_buffer("mean", torch.full((784,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.encode(x - self.mean))  # (B, 256)


def _batch(b: int, device: torch.device):
    return torch.rand(b, 784, device=device), torch.zeros(b, dtype=torch.long, device=device)


def two_losses(model: nn.Module, batch) -> torch.Tensor:
    """A loss that is not ``loss_fn(model(x), y)``: two heads on one encoding."""
    x, y = batch
    z = model(x)
    return F.cross_entropy(model.classify(z), y) + F.mse_loss(model.decode(z), x)


def test_an_instance_is_simulated_through_a_meta_copy() -> None:
    model = AutoEncoder()
    weight = model.encode.weight.detach().clone()
    copied = meta_copy(model)
    assert copied is not model and copied.encode.weight.device.type == "meta"
    assert copied.mean.device.type == "meta" and copied.encode.weight.shape == (256, 784)
    assert model.encode.weight.device.type == "cpu" and torch.equal(model.encode.weight, weight)
    # the same step from the instance as from a factory of the class, to the byte
    from_instance = estimate_memory(model, _batch, batch_size=32, step_fn=two_losses)
    from_factory = estimate_memory(AutoEncoder, _batch, batch_size=32, step_fn=two_losses)
    assert from_instance.allocated_peak_bytes == from_factory.allocated_peak_bytes
    assert from_instance.reserved_peak_bytes == from_factory.reserved_peak_bytes
    assert torch.equal(model.encode.weight, weight) and model.encode.weight.grad is None


def test_tied_weights_stay_tied_in_the_copy() -> None:
    shared = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    shared[1].weight = shared[0].weight
    copied = meta_copy(shared)
    assert copied[1].weight is copied[0].weight
    report = estimate_memory(shared, lambda b, d: (torch.rand(b, 64, device=d), torch.rand(b, 64, device=d)),
                             F.mse_loss, 8, gpu=None)
    # one 64 x 64 fp32 weight (tied once) and two biases: 16,384 + 2 x 256 bytes of parameters
    params = sum(a.nbytes for a in report.trace.allocations if a.category == Category.PARAMETER)
    assert params == 64 * 64 * 4 + 2 * 64 * 4


def test_step_fn_matches_the_profiler_on_the_cpu() -> None:
    model = AutoEncoder()
    predicted = estimate_memory(model, _batch, batch_size=16, step_fn=two_losses, gpu=None).allocated_peak_bytes
    measured = real_cpu_peak("autoencoder", Recipe(), 16, (lambda: copy.deepcopy(model), _batch, None),
                             step_fn=two_losses)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_a_step_needs_exactly_one_loss() -> None:
    with pytest.raises(SpecError) as info:
        estimate_memory(AutoEncoder(), _batch, F.cross_entropy, 8, step_fn=two_losses)
    assert info.value.field == "step_fn"
    with pytest.raises(SpecError) as info:
        estimate_memory(AutoEncoder(), _batch, batch_size=8)
    assert info.value.field == "step_fn"
    with pytest.raises(SpecError) as info:
        estimate_memory(AutoEncoder(), _batch, step_fn=two_losses)
    assert info.value.field == "batch_size"
    with pytest.raises(SpecError) as info:
        user_model(42, _batch, step_fn=two_losses)
    assert info.value.field == "model"


def test_the_models_own_optimizer_replaces_the_recipes() -> None:
    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)  # no state: no optimizer bytes

    own = user_model(AutoEncoder(), _batch, step_fn=two_losses, optimizer_fn=sgd)
    fit = fit_batch(own, Recipe(optimizer="adamw"), None, batch_size=8)
    assert sum(a.nbytes for a in fit.report.trace.allocations if a.category == Category.OPTIMIZER_STATE) == 0
    assert any("the model's own, SGD (1 parameter group; lr=0.1" in line for line in fit.report.assumptions)
    with pytest.raises(SpecError) as info:  # ZeroRedundancyOptimizer wraps a class, not an optimizer
        fit_batch(own, Recipe(distributed=Distributed("zero1", 2)), get_gpu("A100-80GB"))
    assert info.value.field == "training.distributed.strategy"


def test_batches_shaped_like_an_example() -> None:
    ids = torch.arange(6).reshape(2, 3)
    example = {"input_ids": ids, "labels": ids, "mask": torch.ones(2, 3), "scale": torch.tensor(2.0), "name": "x"}
    batch = batch_like(example)(5, torch.device("cpu"))
    assert batch["input_ids"].shape == (5, 3) and batch["mask"].shape == (5, 3)
    assert torch.equal(batch["input_ids"][2], ids[0])  # the example's rows again
    assert batch["labels"] is batch["input_ids"]  # one tensor in the example, one in each batch
    assert batch["scale"].shape == () and batch["name"] == "x"
    with pytest.raises(SpecError) as info:
        batch_like({"name": "no tensors"})
    assert info.value.field == "batch"


def test_the_card() -> None:
    assert card_for("A100-80GB").name == "A100-80GB"
    assert card_for("NVIDIA A100-SXM4-80GB").name == "A100-80GB"  # nvidia-smi's name
    assert card_for(None, torch.device("cpu")) is None  # a run on the CPU: the CPU target
    if not torch.cuda.is_available():
        assert card_for(None) is None


def test_a_profiles_request_is_the_recipe_in_the_requests_words() -> None:
    recipe = Recipe(precision="amp-bf16", optimizer="sgd", optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
                    grad_accumulation_steps=4, zero_grad_at="after-forward", distributed=Distributed("fsdp", 8))
    doc = request_of("mypkg.models:Net", recipe)
    request = parse_request({**doc, "gpus": ["A100-80GB"]}, allow_local_code=True)
    t = request.training
    assert (t.precision, t.optimizer.name, t.optimizer.momentum, t.grad_accumulation_steps, t.zero_grad_at) == (
        "amp-bf16", "sgd", 0.9, 4, "after-forward")
    assert (t.distributed.strategy, t.distributed.world_size) == ("fsdp", 8)
    assert doc["model"]["factory"] == "mypkg.models:Net" and request.planner.suggestions is False


def test_the_recorded_steps_phases_for_a_step_fn() -> None:
    """The user's step is the forward (and its loss) in one phase; backward and the optimizer follow."""
    report = estimate_memory(AutoEncoder(), _batch, batch_size=4, step_fn=two_losses, gpu=None)
    phases = {a.phase for a in report.trace.allocations}
    assert {Phase.INPUT, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER} <= phases and Phase.LOSS not in phases


def test_a_plain_pytorch_step_answers_like_the_frameworks_and_writes_a_profile(tmp_path) -> None:
    import json

    from estimator.integrations.fit import fit_step
    from estimator.pipeline import estimate_from_profile
    from estimator.portable.profile import PortableProfile

    fit = fit_step(AutoEncoder(), _batch, step_fn=two_losses, gpu="T4-16GB")
    assert fit.batch_size == fit.result.recommended_batch_size and fit.result.gpu == "T4-16GB"
    path = tmp_path / "step.json"
    fit.save_profile(path)
    again = estimate_from_profile(PortableProfile.from_json(json.loads(path.read_text())), gpus=["T4-16GB"])
    assert again.results[0].max_batch_size == fit.result.max_batch_size
    assert again.results[0].recommended_batch_size == fit.result.recommended_batch_size
