"""``gradient_checkpointing: "selective"``: torchtitan's per-op SAC, measured and simulated.

The policy (``estimator.simulate.checkpointing.selective_policy``) saves the outputs of
matmuls, attention and communication ops, recomputes every second ``mm`` of a block and
every other op. Its dispatch modes sit above the virtual GPU's, so the recorder sees
what the forward keeps and what the backward recomputes.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from estimator.errors import SpecError
from estimator.measure.cpu import real_cpu_peak
from estimator.pipeline import estimate_memory
from estimator.replay.report import MemoryReport
from estimator.request.adapt import recipe_of
from estimator.request.parse import parse_request
from estimator.simulate.checkpointing import _op_name, enable_checkpointing, sac_save_ops, selective_policy
from estimator.simulate.recipe import Recipe
from estimator.testing.zoo import ZOO
from estimator.trace import Category, Phase, Trace

pytestmark = pytest.mark.sim

MODES: tuple[bool | str, ...] = (False, "selective", True)
# At batch 4 the step's peak is the weights, gradients and Adam states (selective and full
# checkpointing peak alike); at 32 the activations set it.
TRUTH_BATCH = 32
GPU_BATCH = 64


# --- CPU truth: the real CPU step with torch's SAC vs the CPU-target prediction -----------------

@pytest.mark.parametrize("name", ["gpt2", "minigpt"])
def test_selective_cpu_prediction_matches_profiler(name: str) -> None:
    recipe = Recipe(optimizer="adamw", gradient_checkpointing="selective")
    mf, bf, lf = ZOO[name]
    predicted = estimate_memory(mf, bf, lf, TRUTH_BATCH, recipe=recipe, gpu=None).allocated_peak_bytes
    measured = real_cpu_peak(name, recipe, TRUTH_BATCH)
    # What the prediction leaves out: non-reentrant checkpoint's CPU RNG snapshot per block call
    # (torch.get_rng_state(), 5,056 B made outside the dispatcher), host memory a GPU never holds.
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    none = real_cpu_peak(name, Recipe(optimizer="adamw"), TRUTH_BATCH)
    full = real_cpu_peak(name, Recipe(optimizer="adamw", gradient_checkpointing=True), TRUTH_BATCH)
    assert none > measured > full, (none, measured, full)


# --- the GPU target: order of the peaks, what is kept, what is recomputed ----------------------

def _reports(name: str) -> dict[bool | str, MemoryReport]:
    mf, bf, lf = ZOO[name]
    return {mode: estimate_memory(mf, bf, lf, GPU_BATCH, recipe=Recipe(gradient_checkpointing=mode), gpu="A100-80GB")
            for mode in MODES}


def _trace(report: MemoryReport) -> Trace:
    assert report.trace is not None
    return report.trace


def _count(trace: Trace, phase: Phase, op: str, module_prefix: str = "") -> int:
    """Outputs of ``op`` recorded in ``phase`` of the steady iteration (each op makes one output here)."""
    return sum(1 for a in trace.allocations if a.iteration == 1 and a.phase == phase and a.op == op
               and a.module.startswith(module_prefix))


@pytest.fixture(scope="module")
def minigpt_reports() -> dict[bool | str, MemoryReport]:
    return _reports("minigpt")


@pytest.fixture(scope="module")
def gpt2_reports() -> dict[bool | str, MemoryReport]:
    return _reports("gpt2")


@pytest.fixture
def minigpt(minigpt_reports: dict[bool | str, MemoryReport]) -> dict[bool | str, Trace]:
    return {m: _trace(r) for m, r in minigpt_reports.items()}


@pytest.fixture
def gpt2(gpt2_reports: dict[bool | str, MemoryReport]) -> dict[bool | str, Trace]:
    return {m: _trace(r) for m, r in gpt2_reports.items()}


@pytest.mark.parametrize("name", ["minigpt", "gpt2"])
def test_peaks_are_ordered_none_selective_full(name: str, request: pytest.FixtureRequest) -> None:
    reports = request.getfixturevalue(f"{name}_reports")
    traces = {m: _trace(r) for m, r in reports.items()}
    peaks = [reports[m].allocated_peak_bytes for m in MODES]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    acts = [sum(a.nbytes for a in traces[m].allocations if a.iteration == 1 and a.category == Category.ACTIVATION)
            for m in MODES]
    assert acts[0] > acts[1] > acts[2], acts
    assert any(line.startswith("gradient checkpointing: selective") and "2 blocks" in line
               for line in traces["selective"].assumptions)


def test_every_second_mm_is_recomputed(minigpt: dict[bool | str, Trace]) -> None:
    """MiniGPT: 2 blocks of 4 bias-free Linears (qkv, proj, fc, out), each one ``aten.mm`` in the forward.

    torchtitan saves the 1st and 3rd mm of a block (qkv, fc) and recomputes the 2nd and
    4th (proj, out); the recompute runs the whole block (no early stop), so the backward
    runs 2 mms a block more than without checkpointing: 4 of the forward's 8. Full
    checkpointing (early stop: the last mm's output is needed by nothing) recomputes 3 a block.
    """
    forward = _count(minigpt["selective"], Phase.FORWARD, "mm", "blocks.")
    assert forward == 8
    assert _count(minigpt[False], Phase.FORWARD, "mm", "blocks.") == forward
    backward = {m: _count(minigpt[m], Phase.BACKWARD, "mm") for m in MODES}
    assert backward["selective"] - backward[False] == forward // 2
    assert backward[True] - backward[False] == 6


def test_saved_outputs_are_kept_and_nothing_else(minigpt: dict[bool | str, Trace]) -> None:
    """Alive when backward starts, inside the blocks: the saved ops' outputs and the blocks' outputs only."""
    def kept(mode: bool | str) -> collections.Counter[str]:
        return collections.Counter(a.op for a in minigpt[mode].allocations if a.iteration == 1
                                   and a.category == Category.ACTIVATION and a.module.startswith("blocks."))
    saved_names = {_op_name(op) for op in sac_save_ops()}
    selective = kept("selective")
    assert set(selective) - saved_names == {"add"}, selective  # add: a block's output, the next one's input
    assert selective["add"] == 2
    assert selective["mm"] == 4
    # the 1st and 3rd mm of each block
    assert {a.module for a in minigpt["selective"].allocations if a.iteration == 1 and a.op == "mm"
            and a.category == Category.ACTIVATION} == {f"blocks.{i}.{m}" for i in (0, 1) for m in ("qkv", "fc")}
    assert selective["_scaled_dot_product_efficient_attention"] > 0  # fp32 on sm80: the efficient kernel
    assert {"native_layer_norm", "gelu"} <= set(kept(False))  # without checkpointing autograd keeps them
    assert set(kept(True)) == {"add"}


def test_saved_outputs_are_not_recomputed(gpt2: dict[bool | str, Trace]) -> None:
    """transformers' GPT-2: its Conv1D is addmm, eager attention bmm: all saved, none run again in backward."""
    for op in ("addmm", "bmm"):
        assert _count(gpt2["selective"], Phase.BACKWARD, op) == _count(gpt2[False], Phase.BACKWARD, op), op
    assert _count(gpt2[True], Phase.BACKWARD, "addmm") > 0  # full checkpointing recomputes them


# --- the policy itself ------------------------------------------------------------------------

def test_policy_alternates_mm_and_saves_the_rest_of_the_list() -> None:
    policy = selective_policy()
    ctx = SelectiveCheckpointContext(is_recompute=False)
    x, w = torch.zeros(2, 3), torch.zeros(3, 4)
    mm, addmm, relu = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.relu.default
    got = [policy(ctx, mm, x, w) for _ in range(4)]
    assert got == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2
    assert policy(ctx, addmm, torch.zeros(4), x, w) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, relu, x) == CheckpointPolicy.PREFER_RECOMPUTE
    # a forced-recompute shape is recomputed and not counted: the next mm is still the 5th
    forced = selective_policy(frozenset({(3, 4)}))
    assert forced(ctx, mm, x, w) == CheckpointPolicy.PREFER_RECOMPUTE
    assert forced(ctx, mm, x, torch.zeros(3, 5)) == CheckpointPolicy.MUST_SAVE
    assert {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "max", "topk", "linear"} <= {_op_name(op) for op in sac_save_ops()}


def test_selective_needs_blocks() -> None:
    with pytest.raises(SpecError) as info:
        enable_checkpointing(nn.Linear(2, 2), "selective")
    assert info.value.field == "training.gradient_checkpointing"


# --- the request path -------------------------------------------------------------------------

REQUEST = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["A100-80GB"]}


def test_request_accepts_selective() -> None:
    request = parse_request({**REQUEST, "training": {"gradient_checkpointing": "selective"}})
    assert recipe_of(request).gradient_checkpointing == "selective"


@pytest.mark.parametrize("value", ["sac", "Selective"])
def test_unknown_checkpointing_names_its_field(value: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_request({**REQUEST, "training": {"gradient_checkpointing": value}})
    assert info.value.field == "training.gradient_checkpointing"
    assert "selective" in info.value.expected
    with pytest.raises(SpecError) as info:
        Recipe(gradient_checkpointing=value)
    assert info.value.field == "training.gradient_checkpointing" and "selective" in info.value.expected
