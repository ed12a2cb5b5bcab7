"""The planner: affine traces, the max batch per card, confirmed by full simulations."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import A100_80 as A100
from support import build_request

from estimator.gpus import MIB, custom_gpu, get_gpu
from estimator.models import BuiltModel
from estimator.options import DEFAULT_HEADROOM, DEFAULT_RESERVE_BYTES
from estimator.pipeline import estimate
from estimator.plan.affine import fit
from estimator.plan.results import Search, SearchMethod, WarningCode
from estimator.plan.search import headroom_capacity, recommended
from estimator.plan.steps import Steps
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.simulate.source import Simulator
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim



@pytest.mark.zoo  # a sweep over models: the zoo tier
@pytest.mark.parametrize("name", sorted(ZOO))
def test_synthesized_trace_equals_a_fresh_one(name: str) -> None:
    mf, bf, lf = ZOO[name]
    recipe = Recipe(optimizer="adamw")
    target = A100
    # the fit the planner makes: through batches 1 and 2, or 2 and 3 when batch 1 takes other paths
    profile = Steps(Simulator(BuiltModel(name, mf, bf, lf, {}, 0), recipe)).fit(1, target)
    assert profile is not None
    rng = random.Random(name)
    for b in rng.sample(range(4, 200), 3):
        fresh = record_training(mf, bf, lf, b, recipe, target)
        assert profile.matches(fresh, b), f"batch {b}"


class BatchDependent(nn.Module):
    """Takes a different path for batches above 4 (as some samplers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 10)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] > 4:
            h = torch.cat([h, h], dim=0)[: x.shape[0]]  # an extra (2B, 64) temporary
        return self.b(torch.relu(h))


def _batch_dependent() -> BuiltModel:
    def batch(b, device):
        return torch.empty(b, 64, device=device), torch.zeros(b, dtype=torch.long, device=device)
    return BuiltModel("test:batch-dependent", BatchDependent, batch, F.cross_entropy, {}, 64 * 64 + 64 + 64 * 10 + 10)


def test_ops_that_change_with_the_batch_fall_back_to_full_simulations() -> None:
    built = _batch_dependent()
    t2, t3, t9 = (record_training(built.factory, built.batch_factory, built.loss_fn, b, Recipe(), A100)
                  for b in (2, 3, 9))
    assert fit([(2, t2), (3, t3)]) is not None          # batches 2 and 3 take the same path...
    assert fit([(2, t2), (3, t3)], check=(9, t9)) is None  # ... batch 9 does not: the check catches it
    tiny = {"name": "tiny", "memory_bytes": 600 * MIB, "compute_capability": "8.0", "context_bytes": 300 * MIB}
    request = parse_request({"model": {"source": "custom", "factory": "x:y"}, "gpus": [tiny]}, allow_local_code=True)
    response = estimate(request, built=built, reserve_bytes=0)
    (result,) = response.results
    assert result.search == Search(SearchMethod.FULL)
    assert WarningCode.CHECK_DIFFERS in [w.code for w in response.warnings]  # the check at the top caught it
    card = custom_gpu("tiny", 600 * MIB, "8.0", 300 * MIB)

    def fits(b: int) -> bool:
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, b, Recipe(), card)
        return report_from_trace(trace, b, card).fits
    assert fits(result.max_batch_size) and not fits(result.max_batch_size + 1)


CONFIRM = [
    ({"source": "torchvision", "name": "resnet18"}, {}),
    ({"source": "torchvision", "name": "mobilenet_v3_small"}, {}),
    ({"source": "torchvision", "name": "efficientnet_b0"}, {}),
    ({"source": "torchvision", "name": "fcn_resnet50"}, {"image_size": [3, 256, 256]}),
    ({"source": "timm", "name": "convnext_atto"}, {}),
    ({"source": "timm", "name": "deit_tiny_patch16_224"}, {}),
    ({"source": "transformers", "preset": "gpt2"}, {"seq_len": 256}),
    ({"source": "transformers", "preset": "bert-base-uncased", "task": "sequence-classification"}, {"seq_len": 128}),
    ({"source": "transformers", "preset": "t5-small"}, {"seq_len": 128}),
    ({"source": "transformers", "preset": "distilbert-base-uncased"}, {"seq_len": 128}),
]


@pytest.mark.zoo  # a sweep over models: the zoo tier
@pytest.mark.parametrize("model, inp", CONFIRM, ids=[m.get("name") or m.get("preset") for m, _ in CONFIRM])
def test_max_fits_and_max_plus_one_does_not(model, inp) -> None:
    """Independent full simulations on two cards: the answer fits, one more does not."""
    request = parse_request({"model": model, "input": inp, "gpus": ["T4-16GB", "A100-40GB"],
                             "training": {"precision": "amp-bf16" if "preset" in model else "fp32"}})
    response = estimate(request)
    built = build_request(request)
    recipe = Recipe(precision=request.training.precision)
    for result in response.results:
        card = get_gpu(result.gpu)
        best = result.max_batch_size
        assert best is not None and result.search.method == SearchMethod.AFFINE_CHECKED
        assert result.search.checked_batch > best  # the check lies past every card's answer

        def report(b: int, on=card):
            trace = record_training(built.factory, built.batch_factory, built.loss_fn, b, recipe, on)
            return report_from_trace(trace, b, on, reserve_bytes=DEFAULT_RESERVE_BYTES)
        assert report(best).fits, f"{result.gpu}: {best} should fit"
        assert not report(best + 1).fits, f"{result.gpu}: {best + 1} should not fit"
        # the recommendation fits with the allocator held to the headroom, on a fresh simulation too
        rec = result.recommended_batch_size
        assert rec <= best
        usable = card.usable_bytes(DEFAULT_RESERVE_BYTES)
        held = dataclasses.replace(card, memory_bytes=headroom_capacity(usable, card.context_bytes, DEFAULT_HEADROOM)
                                   + card.context_bytes + DEFAULT_RESERVE_BYTES)
        fresh = report(rec, held)
        assert fresh.fits and fresh.device_peak_bytes == result.recommended_memory.device_peak_bytes
        assert fresh.device_peak_bytes <= (1 - DEFAULT_HEADROOM) * usable


def test_a_bigger_card_never_gets_a_smaller_max() -> None:
    sizes = [8, 12, 16, 24, 40, 48, 80, 141]
    gpus = [{"name": f"c{g}", "memory_bytes": g * 2**30, "compute_capability": "8.0"} for g in sizes]
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": gpus})
    maxes = [r.max_batch_size for r in estimate(request, confirm="none").results]
    assert all(m is not None for m in maxes)
    assert maxes == sorted(maxes) and len(set(maxes)) == len(maxes)


def test_model_that_does_not_fit_at_batch_1_returns_null() -> None:
    # gpt2 in fp32 with AdamW: 124,439,808 parameters x 16 B (weights, grads, 2 states) = 1.99 GB > 1.5 GiB
    card = {"name": "small", "memory_bytes": 3 * 2**29, "compute_capability": "7.5"}
    # (suggestions off: checking them is tests/test_distributed.py's, and costs ~30 simulations here)
    request = parse_request({"model": {"source": "transformers", "preset": "gpt2"}, "input": {"seq_len": 64},
                             "gpus": [card], "planner": {"suggestions": False}})
    (result,) = estimate(request).results
    assert result.max_batch_size is None and result.recommended_batch_size is None
    assert result.memory.batch_size == 1 and not result.memory.fits
    assert result.memory.allocated_peak_bytes > 16 * 124_439_808 > card["memory_bytes"]


def test_card_with_no_headroom() -> None:
    # 400 MiB of memory and a 450 MiB CUDA context: nothing can be allocated at all
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                             "gpus": [{"name": "full", "memory_bytes": 400 * MIB, "compute_capability": "8.0"}],
                             "planner": {"suggestions": False}})
    (result,) = estimate(request).results
    assert result.max_batch_size is None and not result.memory.fits


@pytest.mark.parametrize("max_size, expected", [
    (None, None), (1, 1), (7, 7), (8, 8),
    (9, 9),        # 8 would give up 1/9 = 11%
    (10, 10),      # 8 would give up 20%
    (17, 16),      # 1/17 = 5.9%
    (85, 80), (681, 680), (1023, 1016),
])
def test_recommended_rounds_to_8_when_cheap(max_size, expected) -> None:
    assert recommended(max_size) == expected
    assert recommended(max_size, align=False) == max_size


class ChangesAbove(nn.Module):
    """Takes another path for batches above ``at``: unseen by batches 1, 2 and 9."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 10)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] > self.at:
            h = torch.cat([h, h, h, h], dim=1)[:, :256]  # an extra (B, 1024) temporary
        return self.b(torch.relu(h))


def test_the_top_check_catches_a_path_change_between_the_fit_and_the_answers() -> None:
    def batch(b, device):
        return torch.empty(b, 256, device=device), torch.zeros(b, dtype=torch.long, device=device)

    built = BuiltModel("test:changes-above", lambda: ChangesAbove(300), batch, F.cross_entropy, {}, 256 * 266 + 266)
    card = custom_gpu("small", 360 * MIB, "8.0", 300 * MIB)
    request = parse_request({"model": {"source": "custom", "factory": "x:y"},
                             "gpus": [{"name": "small", "memory_bytes": 360 * MIB, "compute_capability": "8.0",
                                       "context_bytes": 300 * MIB}]}, allow_local_code=True)
    response = estimate(request, built=built, reserve_bytes=0)
    (result,) = response.results
    assert result.search == Search(SearchMethod.FULL)
    assert WarningCode.CHECK_DIFFERS in [w.code for w in response.warnings]

    def fits(b: int) -> bool:
        trace = record_training(built.factory, built.batch_factory, built.loss_fn, b, Recipe(), card)
        return report_from_trace(trace, b, card).fits
    best = result.max_batch_size
    assert best > 300 and fits(best) and not fits(best + 1)


def test_every_card_confirmation_agrees_with_the_top_check() -> None:
    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                             "gpus": ["T4-16GB", "A100-40GB", "H100-80GB"]})
    top = estimate(request)
    every = estimate(request, confirm="every-card")
    assert [r.max_batch_size for r in top.results] == [r.max_batch_size for r in every.results]
    assert all(r.search == Search(SearchMethod.AFFINE_CONFIRMED) for r in every.results)
    # one trace serves the sm80 and sm90 cards (the cuBLAS workspace is substituted per card):
    # batches 1 and 2, and one check past the largest answer
    assert top.provenance.simulations == 3
    assert every.provenance.simulations > top.provenance.simulations


@pytest.mark.parametrize("name", ["mlp", "conv", "gpt2", "inplace_view"])
def test_live_bound_is_the_fresh_traces_peak_of_requested_bytes(name: str) -> None:
    mf, bf, lf = ZOO[name]
    t1, t2 = (record_training(mf, bf, lf, b, Recipe(), A100) for b in (2, 3))
    profile = fit([(2, t1), (3, t2)])
    for b in (5, 17, 64):
        fresh = record_training(mf, bf, lf, b, Recipe(), A100)
        assert profile.live_at(b, A100.cublas_workspace_bytes) == fresh.live_peak(hard_only=True)[0]
    live_64 = profile.live_at(64, A100.cublas_workspace_bytes)
    bound = profile.live_bound(live_64, A100.cublas_workspace_bytes, 2**20)
    assert bound >= 64 and profile.live_at(bound + 1, A100.cublas_workspace_bytes) > live_64
