"""Data-dependent ops in any model's forward: the worst-case policy of the detection models
(estimator/simulate/virtual_gpu/worst_case.py) applies to every model whose step needs it, and the answer
names each such op and the module that ran it, so a data-dependent size never makes a request fail."""

from __future__ import annotations

import asserting_models
import pytest
import torch
from support import build_request
from torch import nn

from estimator import estimate, parse_request
from estimator.request.adapt import recipe_of
from estimator.simulate.record import record_built
from estimator.trace import Phase

pytestmark = pytest.mark.sim
WIDTH = 64


class Gate(nn.Module):
    """Keeps the positive activations (a boolean mask: its size depends on the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        kept = h[h > 0]  # aten.index with a bool mask: worst case, every element kept
        return h + kept.sum()


class Routed(nn.Module):
    """A model that reads a value (``.item()``), finds rows (``nonzero``) and masks (``h[h > 0]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3 * 16 * 16, WIDTH)
        self.gate = Gate()
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))
        rows = (h.sum(1) > 0).nonzero()  # worst case: every row
        h = h + rows.numel() * 0.0
        if h.mean().item() > 1e9:  # never on real data; the policy reads 0
            h = h * 2
        return self.head(self.gate(h))


def make() -> nn.Module:
    return Routed()


REQUEST = {"model": {"source": "custom", "factory": "test_data_dependent:make"}, "input": {"image_size": [3, 16, 16]},
           "gpus": ["A100-80GB"], "planner": {"curve_points": 0}}


def test_a_data_dependent_model_is_answered_at_its_worst_case() -> None:
    request = parse_request(REQUEST, allow_local_code=True)
    response = estimate(request)
    assert response.results[0].max_batch_size is not None and response.results[0].max_batch_size > 1000
    line = next(a for a in response.assumptions if a.startswith("data-dependent ops at their worst case: "))
    assert "aten.nonzero in Routed" in line and ".item() in Routed" in line and "aten.index in gate" in line


def test_the_masked_rows_are_every_element() -> None:
    """At batch B, ``h[h > 0]`` in gate keeps B x 64 fp32 values: B x 256 bytes, and nonzero's rows in the
    top module are B x 1 int64 (8 B each): what the trace records in the forward."""
    request = parse_request(REQUEST, allow_local_code=True)
    built = build_request(request)
    batch = 32
    trace = record_built(built, batch, recipe_of(request), None)
    assert built.worst_case  # marked: the next simulations apply the policy at once
    forward = [a for a in trace.allocations if a.phase == Phase.FORWARD]
    assert any(a.nbytes == batch * WIDTH * 4 and a.module == "gate" and a.op == "index" for a in forward)
    assert any(a.nbytes == batch * 8 and a.op == "nonzero" for a in forward)


def test_a_models_asserts_hold_under_the_worst_case() -> None:
    """Every read in an assert answers True (a real run that trains passes its checks); the other read False.
    The model lives in tests/asserting_models.py: pytest rewrites the asserts of test modules into ifs."""
    request = parse_request({**REQUEST, "model": {"source": "custom", "factory": "asserting_models:make_checked"}},
                            allow_local_code=True)
    built = build_request(request)
    trace = record_built(built, 8, recipe_of(request), None)
    line = next(a for a in trace.assumptions if a.startswith("data-dependent ops at their worst case: "))
    assert line == "data-dependent ops at their worst case: assert (holds) in Checked; bool() in Checked"
    # the branch not taken: no (8, 64) fp32 output of ``h * 2`` in the forward
    assert not any(a.op == "mul" and a.nbytes == 8 * WIDTH * 4 for a in trace.allocations if a.phase == Phase.FORWARD)


@pytest.mark.parametrize("fn, reads, expected", [
    (asserting_models.assert_item, "item", True),  # the call, then POP_JUMP_IF_TRUE to LOAD_ASSERTION_ERROR
    (asserting_models.assert_and, "first", True),  # POP_JUMP_IF_FALSE to LOAD_ASSERTION_ERROR
    (asserting_models.assert_and, "second", True),  # POP_JUMP_IF_TRUE, as a lone assert
    (asserting_models.branch, "item", False),  # an if: its false branch is no assertion error
])
def test_which_reads_are_asserts(fn, reads: str, expected: bool) -> None:
    import dis

    from estimator.simulate.virtual_gpu.worst_case import _asserts_at

    ops = list(dis.get_instructions(fn.__code__))
    if reads == "item":
        offset = next(i.offset for i in ops if i.opname.startswith("CALL"))
    else:
        jumps = [i.offset for i in ops if i.opname.startswith("POP_JUMP")]
        offset = jumps[0] if reads == "first" else jumps[1]
    assert _asserts_at(fn.__code__, offset) is expected


SEQ = 12


class Patcher(nn.Module):
    """BLT's entropy patcher in miniature: each row's patch starts (where a score passes a threshold) padded to
    the row's length by ``cat([starts, ~starts])`` as many sentinels, then cut to the most patches of a row."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (B, SEQ, WIDTH)
        starts = h.mean(-1) > 0  # (B, SEQ)
        b, s = starts.shape
        idx = torch.arange(s, device=h.device).expand(b, -1)
        padded = torch.cat([idx, torch.full_like(idx, s - 1)], 1)[torch.cat([starts, ~starts], 1)].reshape(b, s)
        most = starts.sum(dim=1).max()  # the worst case: every position starts a patch
        patches = h.gather(1, padded[:, :most].unsqueeze(-1).expand(-1, -1, WIDTH))  # (B, most, WIDTH)
        return patches.sum(1)


def _sequences(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(b, SEQ, WIDTH, device=device), torch.zeros(b, dtype=torch.long, device=device)


def test_a_masks_count_reads_its_largest_and_a_padded_mask_its_exact_count() -> None:
    """``cat([m, ~m])`` holds exactly ``m.numel()`` trues (so the reshape holds), and ``m.sum(1).max()`` reads
    SEQ, every element true as for the masks themselves: the gather keeps B x SEQ x WIDTH fp32 values."""
    from estimator.gpus import get_gpu
    from estimator.simulate.recipe import Recipe
    from estimator.simulate.record import record_training

    batch = 4
    trace = record_training(Patcher, _sequences, nn.functional.cross_entropy, batch, Recipe(), get_gpu("A100-80GB"),
                            worst_case=True)
    forward = [a for a in trace.allocations if a.phase == Phase.FORWARD]
    assert any(a.op == "gather" and a.nbytes == batch * SEQ * WIDTH * 4 for a in forward)
    line = next(a for a in trace.assumptions if a.startswith("data-dependent ops at their worst case: "))
    assert line.endswith("aten.index in Patcher; .item() (a mask's count: all true) in Patcher")


class Sampled(nn.Module):
    """Builds a torch.distributions.Categorical and scores the targets (validation on, torch's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)  # (B, WIDTH)
        dist = torch.distributions.Categorical(logits=logits)  # checks the logits: a value read
        return logits + (dist.entropy() + dist.log_prob(torch.zeros(x.shape[0], dtype=torch.long,
                                                                    device=x.device))).unsqueeze(-1)


@pytest.mark.parametrize("worst_case", [False, True])
def test_a_distributions_validation_holds_and_its_check_is_recorded(worst_case: bool, monkeypatch) -> None:
    """The argument and sample checks pass, as in a real run that trains, under either policy; the logits'
    check (``value == value``: a B x WIDTH bool mask) is allocated as on the card; torch's default is kept.
    (Validation on, torch's default: a process where torch._dynamo has run has it off, as TorchPatcher sets.)"""
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)
    from estimator.gpus import get_gpu
    from estimator.simulate.recipe import Recipe
    from estimator.simulate.record import record_training

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(b, WIDTH, device=device), torch.zeros(b, dtype=torch.long, device=device)

    b = 8
    trace = record_training(Sampled, batch, nn.functional.cross_entropy, b, Recipe(), get_gpu("A100-80GB"),
                            worst_case=worst_case)
    assert any(a.op == "eq" and a.nbytes == b * WIDTH for a in trace.allocations if a.phase == Phase.FORWARD)
    assert torch.distributions.Distribution._validate_args


def test_worst_case_bounds_forget_writes_through_views_and_count_repeated_parts() -> None:
    """A zeros mask written through a slice (``mask[:, :n] = 1``) is no longer known to be empty: ``nonzero``
    may find every element. ``cat([m, ~m, m])`` holds m.numel() + bound(m) trues, not m.numel()."""
    from estimator.gpus import get_gpu
    from estimator.simulate.virtual_gpu import VirtualGPU
    from estimator.simulate.virtual_gpu.worst_case import WorstCase

    with VirtualGPU(get_gpu("A100-80GB"), worst_case=WorstCase()):
        empty = torch.zeros(4, 8, dtype=torch.bool, device="cuda")
        assert empty.nonzero().shape == (0, 2)  # made as zeros: known empty
        written = torch.zeros(4, 8, dtype=torch.bool, device="cuda")
        written[:, :3] = True  # through a view: the base's version moves on
        assert written.nonzero().shape == (32, 2)
        m = torch.empty(4, 8, device="cuda") > 0
        assert torch.cat([m, ~m]).nonzero().shape == (32, 2)  # exactly m.numel()
        assert torch.cat([m, ~m, m]).nonzero().shape == (64, 2)  # the second m adds its own bound
        assert torch.cat([~m, ~m, m]).nonzero().shape == (64, 2)  # one ~m paired, the other unbounded
