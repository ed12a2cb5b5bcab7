"""cuDNN convolution workspaces (estimator/simulate/virtual_gpu/cudnn.py) and their replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import A100_80 as A100
from support import T4

from estimator.gpus import MIB
from estimator.pipeline import estimate, estimate_memory
from estimator.replay.allocator import AllocatorConfig, replay_sized
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe

pytestmark = pytest.mark.sim


B = 8


class OneConv(nn.Module):
    def __init__(self, depthwise: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 1)  # makes the second conv's input require grad: backward-data runs too
        self.conv = nn.Conv2d(64, 64 if depthwise else 128, 3, padding=1, groups=64 if depthwise else 1)

    def forward(self, x):
        return self.conv(self.stem(x)).mean(dim=(2, 3))  # (B, C): logits


def _batch(b, device):
    return torch.empty(b, 3, 32, 32, device=device), torch.zeros(b, dtype=torch.long, device=device)


def _step(gpu, recipe=None, depthwise=False):
    recipe = recipe or Recipe()
    return estimate_memory(lambda: OneConv(depthwise), _batch, F.cross_entropy, B, recipe=recipe, gpu=gpu)


def _workspaces(report, iteration=1):
    return [(a.phase, a.op, a.nbytes) for a in report.trace.allocations
            if a.category == "conv_workspace" and a.iteration == iteration]


# The 3x3 conv's im2col matrix: (C_in 64 x 3 x 3 kernel) x (N 8 x 32 x 32 output pixels) fp32
COL_3x3 = 64 * 3 * 3 * 8 * 32 * 32 * 4  # = 18,874,368 B
# The 1x1 stem's: (3 x 1 x 1) x (8 x 32 x 32) fp32 = 98,304 B
COL_STEM = 3 * 1 * 1 * 8 * 32 * 32 * 4


def test_one_workspace_per_convolution_call_sized_as_the_im2col_matrix() -> None:
    report = _step(A100)
    assert _workspaces(report) == [
        ("forward", "workspace[convolution]", COL_STEM),
        ("forward", "workspace[convolution]", COL_3x3),
        ("backward", "workspace[convolution_backward]", COL_3x3),  # backward-data
        ("backward", "workspace[convolution_backward]", COL_3x3),  # backward-weight
        ("backward", "workspace[convolution_backward]", COL_STEM),  # the stem: weight only (x needs none)
    ]
    assert COL_3x3 == 18_874_368
    # transient: nothing is allocated between a workspace and its free (the call returns; a burst of
    # frees is kept in allocation order, so other frees may come first)
    events = report.trace.events
    for i, (alloc, k) in enumerate(events):
        if alloc and report.trace.allocations[k].category == "conv_workspace":
            j = events.index((False, k), i)
            assert not any(a for a, _ in events[i + 1:j])
    assert any("im2col" in line for line in report.assumptions)


def test_workspaces_show_in_the_breakdown_and_the_peak() -> None:
    report = _step(A100)
    # the backward of the 3x3 conv: its workspace is live at the allocated peak
    assert report.peak_phase == "backward"
    # 18 MiB request -> an 18 MiB block (large pool, rounded to 2 MiB)
    assert report.breakdown.workspace == 18 * MIB
    without = estimate_memory(lambda: OneConv(), _batch, F.cross_entropy, B, gpu=None)  # the CPU target has none
    assert not [a for a in without.trace.allocations if a.category == "conv_workspace"]


HALF = [COL_STEM // 2, COL_3x3 // 2, COL_3x3 // 2, COL_3x3 // 2, COL_STEM // 2]  # 2-byte elements


@pytest.mark.parametrize("gpu, precision, depthwise, expected", [
    # depthwise, contiguous, fp32: _conv_depthwise2d, no cuDNN; the 1x1 stem still reaches it
    (A100, "fp32", True, [COL_STEM, COL_STEM]),
    (A100, "bf16", False, HALF),      # bf16 on sm80: cuDNN v8
    (T4, "bf16", False, []),          # bf16 before sm80: the slow im2col kernels, no cuDNN workspace (below)
    (T4, "amp-fp16", False, HALF),    # autocast casts the conv's inputs to fp16: cuDNN on sm75
])
def test_which_convolutions_reach_cudnn(gpu, precision, depthwise, expected) -> None:
    report = _step(gpu, Recipe(precision=precision), depthwise)
    assert [n for _, _, n in _workspaces(report)] == expected


def test_a_workspace_that_cannot_be_had_is_skipped_not_an_oom() -> None:
    # 10 MiB live, then a 30 MiB workspace on a 32 MiB card: cuDNN takes a plan without one
    events = [(True, 0), (True, 1), (False, 1), (True, 2), (False, 2), (False, 0)]
    sizes = [10 * MIB, 30 * MIB, 4 * MIB]
    capped = replay_sized(events, sizes, ["activation", "conv_workspace", "temporary"], AllocatorConfig(32 * MIB))
    assert capped.fits and capped.failed_mallocs > 0
    assert capped.allocated_peak == 14 * MIB  # 10 + the 4 MiB temporary; no workspace
    hard = replay_sized(events, sizes, ["activation", "temporary", "temporary"], AllocatorConfig(32 * MIB))
    assert not hard.fits and hard.oom_event == 1


def test_empty_cache_releases_every_cached_whole_segment() -> None:
    # a 30 MiB block freed into the cache, emptyCache, then 4 MiB: reserved drops from 30 to 0, then 20 MiB
    events = [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2)]
    sizes = [30 * MIB, 0, 4 * MIB]
    r = replay_sized(events, sizes, ["temporary", "empty_cache", "temporary"], AllocatorConfig())
    assert r.reserved == [30 * MIB, 30 * MIB, 0, 0, 20 * MIB]  # 4 MiB: a kLargeBuffer (20 MiB) segment
    kept = replay_sized(events, sizes, ["temporary", "temporary", "temporary"], AllocatorConfig())
    # without it the 4 MiB request splits the cached 30 MiB block; the 0 B request took a 2 MiB small segment
    assert kept.reserved[-1] == 30 * MIB + 2 * MIB


def test_benchmark_searches_each_shape_once_then_empties_the_cache() -> None:
    report = _step(A100, Recipe(cudnn_benchmark=True))
    first = [(a.category, a.nbytes) for a in report.trace.allocations
             if a.iteration == 0 and a.category in ("conv_workspace", "empty_cache")]
    # forward stem, forward 3x3, backward-data 3x3, backward-weight 3x3, backward-weight stem:
    # each a search buffer, emptyCache, then the chosen plan's workspace
    expected = []
    for size in (COL_STEM, COL_3x3, COL_3x3, COL_3x3, COL_STEM):
        expected += [("conv_workspace", size), ("empty_cache", 0), ("conv_workspace", size)]
    assert first == expected
    # the second step runs the cached plans: one workspace per call, as without benchmark
    assert _workspaces(report) == _workspaces(_step(A100))
    assert any("cudnn.benchmark" in line for line in report.assumptions)


def test_cudnn_benchmark_in_the_request() -> None:
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
            "gpus": ["A100-40GB"], "batch_size": 32, "planner": {"confirm": "none", "curve_points": 0}}
    plain = estimate(parse_request(body))
    bench = estimate(parse_request({**body, "training": {"cudnn_benchmark": True}}))
    assert not any("cudnn.benchmark" in line for line in plain.assumptions)
    assert any("cudnn.benchmark" in line for line in bench.assumptions)
    assert any("im2col" in line for line in plain.assumptions)
    assert plain.results[0].memory.fits and bench.results[0].memory.fits


def test_cards_on_either_side_of_sm80_do_not_share_a_bf16_conv_trace() -> None:
    """bf16 convolutions reach cuDNN (and its workspaces) from sm80 on: a V100 and an A100 trace apart."""
    body = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
            "training": {"precision": "bf16"}, "batch_size": 32, "planner": {"curve_points": 0}}
    mixed = estimate(parse_request({**body, "gpus": ["V100-16GB", "A100-40GB"]}))
    alone = estimate(parse_request({**body, "gpus": ["A100-40GB"]}))
    assert mixed.results[1].memory == alone.results[0].memory
    assert mixed.results[1].max_batch_size == alone.results[0].max_batch_size
    assert mixed.results[0].memory != mixed.results[1].memory  # no workspaces on the V100


def test_a_profile_keeps_the_capability_thresholds(tmp_path) -> None:
    from estimator.pipeline import estimate_from_profile, make_profile
    from estimator.portable.profile import PortableProfile

    body = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
            "training": {"precision": "bf16"}, "gpus": ["A100-40GB"]}
    profile = make_profile(parse_request(body))
    assert profile.capability_thresholds == [(8, 0)]
    assert sorted(profile.steps) == [";sm8.0+", ";sm8.0-"]  # no SDPA; either side of sm80
    again = PortableProfile.from_json(profile.to_json())
    from_profile = estimate_from_profile(again, gpus=["V100-16GB", "A100-40GB"], batch_size=32)
    direct = estimate(parse_request({**body, "gpus": ["V100-16GB", "A100-40GB"], "batch_size": 32,
                                     "planner": {"confirm": "none"}}))
    assert [r.max_batch_size for r in from_profile.results] == [r.max_batch_size for r in direct.results]


def test_expandable_segments_with_workspaces_and_empty_cache() -> None:
    """The soft workspace is refused without unmapping anything, and emptyCache keeps the pages mapped:
    the replay's reserved bytes never drop below what is allocated."""
    cfg = AllocatorConfig(capacity=32 * MIB, expandable_segments=True)
    events = [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2), (True, 3), (False, 3), (True, 4)]
    sizes = [30 * MIB, 0, 10 * MIB, 30 * MIB, 12 * MIB]
    cats = ["temporary", "empty_cache", "activation", "conv_workspace", "activation"]
    r = replay_sized(events, sizes, cats, cfg)
    assert r.fits and r.failed_mallocs == 1  # the 30 MiB workspace beside 10 MiB on a 32 MiB card
    assert all(res >= alloc for res, alloc in zip(r.reserved, r.allocated, strict=True))
    # 30 MiB mapped for the first request, reused by 10 + 12 MiB: nothing more mapped, nothing unmapped
    assert r.reserved == [30 * MIB] * len(events)
    assert r.allocated[-1] == 22 * MIB  # and the workspace never was


def test_bf16_before_sm80_takes_the_slow_kernels_with_one_samples_columns() -> None:
    """ConvolutionMM2d.cu: columns = (C_in x kH x kW) x (H_out x W_out) for one sample, reused over the batch;
    an ordinary allocation (no fallback), freed when the call returns."""
    report = _step(T4, Recipe(precision="bf16"))
    columns = [(a.phase, a.op, a.nbytes, a.category) for a in report.trace.allocations
               if a.op.startswith("columns") and a.iteration == 1]
    assert columns == [
        # the 1x1 stem's forward needs none (requires_columns is false); the 3x3 conv's: 64 x 9 x 32 x 32 bf16
        ("forward", "columns[convolution]", 64 * 9 * 32 * 32 * 2, "temporary"),
        ("backward", "columns[convolution_backward]", 64 * 9 * 32 * 32 * 2, "temporary"),  # data + weight
        ("backward", "columns[convolution_backward]", 3 * 1 * 32 * 32 * 2, "temporary"),  # the stem's weight
    ]
