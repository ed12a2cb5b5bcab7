"""Our engine vs PyTorch's C++ engine, both on fake CPU tensors (docs/DESIGN.md, "Engine parity").

Both runs record the same two SGD training iterations of each zoo model; the
C++ run leaves torch.autograd alone, ours routes backward to ``Engine`` with
``subclass_like=True`` (the C++ engine treats fake tensors as subclasses).
"""

from __future__ import annotations

import pytest

from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim

EXACT = [
    "resnet18", "resnet50", "vit_b_16", "mobilenet_v3_small", "lstm", "gpt2", "bert", "tied", "inplace", "inplace_view",
    "checkpoint", "checkpoint_reentrant",
]


def _runs(name: str):
    mf, bf, lf = ZOO[name]
    recipe = Recipe(optimizer="sgd", optimizer_kwargs={"momentum": 0.9})
    ref = record_training(mf, bf, lf, 2, recipe, None, subclass_like=True, cpp_engine=True)
    ours = record_training(mf, bf, lf, 2, recipe, None, subclass_like=True)
    seq = lambda t: [(a, t.allocations[k].nbytes) for a, k in t.events]  # noqa: E731
    return ref, ours, seq(ref), seq(ours)


@pytest.mark.parametrize("name", EXACT)
def test_same_event_sequence_and_peak(name: str) -> None:
    ref, ours, a, b = _runs(name)
    assert len(a) > 20
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    assert first is None and len(a) == len(b), f"first difference at event {first}"
    assert ref.live_peak()[0] == ours.live_peak()[0]
