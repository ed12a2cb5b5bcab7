"""Models built on the meta device (estimator/models/meta.py): torch.nn.init's initializers skip meta tensors while a
model is built, initialize every other tensor as always, and are torch's own again afterwards."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torchvision

from estimator.models import meta
from estimator.models.meta import build_on_meta

pytestmark = pytest.mark.unit


class HalfOnCpu(nn.Module):
    """A Linear (meta under the build) and a CPU table its constructor fills with torch.nn.init."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.table = torch.nn.init.constant_(torch.empty(3, device="cpu"), 7.0)  # not a parameter: stays on the CPU


def test_meta_tensors_skip_their_initializers_and_others_are_initialized() -> None:
    calls: list[str] = []
    original = torch.nn.init.kaiming_uniform_

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.device.type)
        return original(tensor, *args, **kwargs)

    torch.nn.init.kaiming_uniform_ = counted
    try:
        model = build_on_meta(HalfOnCpu)
        assert torch.nn.init.kaiming_uniform_ is counted  # what was installed before the build is back
    finally:
        torch.nn.init.kaiming_uniform_ = original
    assert calls == []  # the Linear's weight is on meta: its initializer never ran
    assert model.fc.weight.device.type == "meta" and model.fc.weight.shape == (4, 16)
    assert model.table.tolist() == [7.0, 7.0, 7.0]  # a CPU tensor is initialized as always


def test_the_same_model_is_built_with_and_without_the_initializers() -> None:
    def shapes(model: nn.Module) -> list:
        return [(n, t.shape, t.dtype, t.device.type, t.requires_grad)
                for n, t in [*model.named_parameters(), *model.named_buffers()]]

    fast = build_on_meta(torchvision.models.resnet50)
    with torch.device("meta"):
        slow = torchvision.models.resnet50()  # every initializer run
    assert shapes(fast) == shapes(slow)
    assert not any(_skipping(name) for name in meta._INITIALIZERS)  # torch's own again


def _skipping(name: str) -> bool:
    """torch.nn.init's ``name`` is the build's wrapper (functools.wraps sets ``__wrapped__``)."""
    return hasattr(getattr(torch.nn.init, name), "__wrapped__")


def test_builds_in_threads_restore_the_initializers_when_the_last_ends() -> None:
    started, release = threading.Barrier(3), threading.Event()

    def slow_factory() -> nn.Module:
        started.wait()
        release.wait(timeout=30)
        return nn.Linear(8, 8)

    threads = [threading.Thread(target=build_on_meta, args=(slow_factory,)) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()  # both builds are inside the skip
    assert all(_skipping(name) for name in meta._INITIALIZERS) and meta._init_users == 2
    release.set()
    for t in threads:
        t.join()
    assert meta._init_users == 0 and not any(_skipping(name) for name in meta._INITIALIZERS)
