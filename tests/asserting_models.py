"""Code with ``assert`` statements for tests/test_data_dependent.py, outside a test module: pytest rewrites the
asserts of test modules into ``if not ...: raise``, which are no longer the ``assert`` bytecode a model's are."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 64


class Checked(nn.Module):
    """Asserts about its data, as ProphetNet's ``_shift_right`` and I-BERT's ``QuantAct`` do, then a branch on a
    value that is no assert (the worst-case policy reads it False: the ``* 2`` never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3 * 16 * 16, WIDTH)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))
        assert torch.all(h.abs() >= 0).item(), "no negative magnitudes"  # .item(), then the assert's jump
        assert h.isnan().sum() == 0 and h.isinf().sum() == 0, "NaN or inf"  # bool(), both sides of an `and`
        if (h > 0).any():
            h = h * 2
        return self.head(h)


def make_checked() -> nn.Module:
    return Checked()


def assert_item(x: torch.Tensor) -> None:
    assert x.item(), "message"


def assert_and(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x and y


def branch(x: torch.Tensor) -> bool:
    if x.item():
        return True
    return bool(x)
