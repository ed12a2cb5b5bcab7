"""Gradient accumulation costs three micro-steps' simulation, not N (estimator/simulate/accumulation.py).

What these tests found, and why it holds:

- The simulated program repeats from the second micro-step on. The first makes the gradients
  (``zero_grad`` set them to None); every later one adds into them in place, and hands the next
  one nothing but its batch, which is freed when the next batch is made. So the third micro-step
  records the events of the second, allocation for allocation, and so would every later one: the
  simulation stops there and the trace repeats the third for the rest
  (``test_the_trace_stands_for_every_micro_step``). With ``zero_grad_set_to_none: false`` the
  gradients outlive the step, and from the second iteration on the first micro-step already repeats.
- The caching allocator does not settle as early. Its replay of micro-steps 3, 4, ... starts
  from another block pool than that of micro-step 2 (the second batch sits where the first did
  not), so two micro-steps under-report resnet18 at batch 48 by 1.5 MiB; under memory pressure
  (a card between the allocated and the reserved peak) its peaks settle from the 5th micro-step;
  with expandable segments the reserved peak alternates with N's parity for good (two batches
  alternate between two places, and the optimizer step finds the one or the other free)
  (``test_two_micro_steps_are_not_enough``). So the trace holds ``REPLAYED`` = 6 micro-steps, 7
  for an odd N, and every replay of it gives what the replay of all N gives
  (``test_the_allocator_settles_within_the_trace``).
- FLOPs are the same in every micro-step (the loss division and the in-place gradient additions
  have no FLOP formula): a step's FLOPs are the first micro-step's plus N - 1 times the steady one's.
- Real runs (estimator/validate.py, the CPU truth) run every micro-step: only the simulation
  stands for them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from support import A100_80 as A100

from estimator.gpus import custom_gpu, get_gpu
from estimator.replay.allocator import AllocatorConfig
from estimator.replay.report import report_from_trace
from estimator.simulate import accumulation
from estimator.simulate.accumulation import REPLAYED, micro_steps_in_trace
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.simulate.step import prepare, run_steps
from estimator.testing.zoo import ZOO, _ce, _image_batch

pytestmark = pytest.mark.sim

MIB = 2**20


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))  # (B, 16, 16, 16) -> (B, 4096) -> (B, 10)


BN_CNN = (BatchNormCNN, _image_batch(3, 16, 10), _ce)

# name -> (model, batch factory, loss), recipe: the loop's variants
VARIANTS = {
    "mlp adamw": (ZOO["mlp"], {}),
    "bn-cnn adamw": (BN_CNN, {}),
    "gpt2 adamw": (ZOO["gpt2"], {}),
    "gpt2 amp-fp16 GradScaler": (ZOO["gpt2"], {"precision": "amp-fp16"}),
    "bn-cnn amp-bf16": (BN_CNN, {"precision": "amp-bf16"}),
    "bn-cnn pure bf16 cudnn.benchmark": (BN_CNN, {"precision": "bf16", "cudnn_benchmark": True}),
    "gpt2 zero_grad after-forward": (ZOO["gpt2"], {"zero_grad_at": "after-forward"}),
    "mlp zero_grad after-forward": (ZOO["mlp"], {"zero_grad_at": "after-forward"}),
    "mlp gradients kept (set_to_none false)": (ZOO["mlp"], {"zero_grad_set_to_none": False}),
    "gpt2 gradient checkpointing": (ZOO["gpt2"], {"gradient_checkpointing": True}),
    "reentrant checkpoint blocks": (ZOO["checkpoint_reentrant"], {}),
    "mlp fused adamw": (ZOO["mlp"], {"optimizer_kwargs": {"fused": True}}),
    "mlp foreach adamw": (ZOO["mlp"], {"optimizer_kwargs": {"foreach": True}}),
    "bn-cnn sgd momentum": (BN_CNN, {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.9}}),
}


class CountedBatches:
    """A batch factory that counts its calls and refuses more than ``limit`` (a loop over all N micro-steps
    fails at once instead of running for minutes)."""

    def __init__(self, make, limit: int = 2 * (REPLAYED + 2)) -> None:
        self.make, self.limit, self.calls = make, limit, 0

    def __call__(self, b, device):
        self.calls += 1
        if self.calls > self.limit:
            raise RuntimeError(f"batch {self.calls}: more micro-steps simulated than {self.limit}")
        return self.make(b, device)


def _record(name: str, n: int, batch: int = 4, *, full: bool = False, gpu=A100, batches=None):
    (mf, bf, lf), kwargs = VARIANTS[name] if name in VARIANTS else (ZOO[name], {})
    recipe = Recipe(grad_accumulation_steps=n, **kwargs)
    extra = {"every_micro_step": True} if full else {}
    return record_training(mf, batches or bf, lf, batch, recipe, gpu, **extra)


def _numbers(report) -> object:
    """Every number of a report that does not scale with N (the assumptions name N)."""
    return dataclasses.replace(report, trace=None, assumptions=[])


def _inputs(trace) -> int:
    """Micro-steps in a trace: one input batch each (an image or token tensor and its targets)."""
    return sum(1 for a in trace.allocations if a.phase == "input")


# --- the simulation ---------------------------------------------------------------------------------------


def test_a_long_accumulation_simulates_three_micro_steps() -> None:
    assert [micro_steps_in_trace(n) for n in (256, 4095, 4096)] == [REPLAYED, REPLAYED + 1, REPLAYED]
    batches = CountedBatches(ZOO["mlp"][1])
    trace = _record("mlp", 4096, batches=batches)
    assert batches.calls == 2 * 3  # two iterations of three micro-steps
    assert _inputs(trace) == 2 * 2 * REPLAYED  # the trace: two iterations of 6 micro-steps, 2 tensors a batch
    assert ("grad accumulation: 3 of 4096 micro-steps simulated (the last repeated the one before); memory "
            "from 6 of them, FLOPs from all 4096") in trace.assumptions


def test_kept_gradients_repeat_from_the_first_micro_step() -> None:
    batches = CountedBatches(ZOO["mlp"][1])
    _record("mlp gradients kept (set_to_none false)", 256, batches=batches)
    assert batches.calls == 3 + 2  # iteration 1 finds the gradients made: its first micro-step repeats


@pytest.mark.parametrize("name", VARIANTS)
def test_the_trace_stands_for_every_micro_step(name: str) -> None:
    """The trace of N micro-steps, three of them simulated, is the full simulation's, allocation for
    allocation; N = 4096 is the full simulation of 6 (its steady state) with the FLOPs of all 4096."""
    five, full_five = _record(name, 5), _record(name, 5, full=True)
    assert (five.events, five.allocations) == (full_five.events, full_five.allocations)
    assert five.flops == full_five.flops

    batches = CountedBatches(VARIANTS[name][0][1])
    long, full_six = _record(name, 4096, batches=batches), _record(name, REPLAYED, full=True)
    assert batches.calls <= 2 * 3
    assert (long.events, long.allocations) == (full_six.events, full_six.allocations)
    steady = full_six.flops - full_five.flops  # one more micro-step
    first = full_five.flops - 4 * steady
    assert steady > 0 and first == steady  # every micro-step the same FLOPs
    assert long.flops == first + 4095 * steady
    assert _numbers(report_from_trace(long, 4, A100)) == _numbers(report_from_trace(full_six, 4, A100))


class Hoarder(nn.Module):
    """Keeps every forward's hidden state: each micro-step leaves something that no later one frees."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ZOO["mlp"][0]()
        self.kept: list[torch.Tensor] = []

    def forward(self, x):
        h = self.net.net[0](x)
        self.kept.append(h.detach())
        return self.net.net[2](self.net.net[1](h))


def test_micro_steps_that_leave_something_behind_are_all_simulated() -> None:
    _, bf, lf = ZOO["mlp"]
    batches = CountedBatches(bf)
    trace = record_training(Hoarder, batches, lf, 4, Recipe(grad_accumulation_steps=5), A100)
    full = record_training(Hoarder, bf, lf, 4, Recipe(grad_accumulation_steps=5), A100, every_micro_step=True)
    assert batches.calls == 2 * 5
    assert (trace.events, trace.allocations) == (full.events, full.allocations)
    assert not any("grad accumulation" in a for a in trace.assumptions)


def test_real_runs_run_every_micro_step() -> None:
    mf, bf, lf = ZOO["mlp"]
    batches = CountedBatches(bf, limit=100)
    recipe = Recipe(grad_accumulation_steps=5, optimizer="sgd")
    run_steps(prepare(mf(), recipe, torch.device("cpu")), batches, lf, 4, recipe, torch.device("cpu"))
    assert batches.calls == 2 * 5


# --- the allocator ----------------------------------------------------------------------------------------


@pytest.fixture
def long_traces(monkeypatch):
    """Traces that hold every micro-step (the repetition a full simulation would record, as shown above)."""
    monkeypatch.setattr(accumulation, "REPLAYED", 64)


def _cards(trace, batch: int) -> dict[str, tuple]:
    """Cards and allocator settings to replay on: the A100 with each allocator setting, and cards whose
    capacity lies between the step's allocated and reserved peaks (the allocator frees its cache and retries)."""
    ref = report_from_trace(trace, batch, A100)
    lo, hi = ref.allocated_peak_bytes, ref.reserved_peak_bytes
    cards = {"A100": (A100, None), "A100 expandable": (A100, AllocatorConfig(expandable_segments=True)),
             "A100 max_split 64 MiB": (A100, AllocatorConfig(max_split_size=64 * MIB))}
    for eighth in range(0, 9, 2):
        cap = -(-(lo + (hi - lo) * eighth // 8) // (2 * MIB)) * 2 * MIB
        card = custom_gpu(f"tight {eighth} of 8", cap + A100.context_bytes, "8.0", A100.context_bytes)
        cards[f"tight {eighth}/8"] = (card, None)
        cards[f"tight {eighth}/8 expandable"] = (card, AllocatorConfig(expandable_segments=True))
    return cards


@pytest.mark.parametrize("name, batch", [
    ("resnet18", 48),  # settles from the 5th micro-step on the tight cards
    ("resnet18", 160),
    ("bn-cnn adamw", 48),  # alternates with N's parity with expandable segments
    ("gpt2 adamw", 16),
    ("gpt2 amp-fp16 GradScaler", 48),
    ("mlp zero_grad after-forward", 64),
])
def test_the_allocator_settles_within_the_trace(name: str, batch: int, long_traces) -> None:
    """Up to N = 12: the replay of N micro-steps gives what the replay of 6 or 7 (N's parity) does."""
    top = 12
    traces = {n: _record(name, n, batch) for n in range(2, top + 1)}
    assert _inputs(traces[top]) == _inputs(traces[2]) * top // 2
    for card, (gpu, config) in _cards(traces[top], batch).items():
        numbers = {n: _numbers(report_from_trace(t, batch, gpu, config)) for n, t in traces.items()}
        for n in range(REPLAYED, top + 1):
            assert numbers[n] == numbers[REPLAYED + (n - REPLAYED) % 2], (card, n)


# (name, batch, allocator, peak) -> that peak of the replay for N = 2, 3, 4, 5, 6
NOT_ENOUGH = [
    # the 2nd micro-step's block pool is not the 3rd's: 1,572,864 B more from N = 3 on
    ("resnet18", 48, None, "allocated_peak_bytes", [303_527_424] + [305_100_288] * 4),
    # two batches alternate between two places: the optimizer step finds 2 MiB more to map after an odd N
    ("bn-cnn adamw", 48, AllocatorConfig(expandable_segments=True), "reserved_peak_bytes",
     [31_457_280, 33_554_432] * 2 + [31_457_280]),
]


@pytest.mark.parametrize("name, batch, config, peak, expected", NOT_ENOUGH)
def test_two_micro_steps_are_not_enough(name, batch, config, peak, expected, long_traces) -> None:
    got = [getattr(report_from_trace(_record(name, n, batch), batch, A100, config), peak) for n in range(2, 7)]
    assert got == expected


# --- the estimate -----------------------------------------------------------------------------------------


class PerBatch:
    """A batch factory that refuses more than ``limit`` calls at one batch size (one simulation's worth)."""

    def __init__(self, make, limit: int = 2 * 3) -> None:
        self.make, self.limit, self.calls = make, limit, {}

    def __call__(self, b, device):
        self.calls[b] = self.calls.get(b, 0) + 1
        if self.calls[b] > self.limit:
            raise RuntimeError(f"batch {b}: more micro-steps simulated than {self.limit}")
        return self.make(b, device)


def _timed_fields(data: dict) -> dict:
    """A response's JSON without what scales with N (FLOPs, step and epoch time, the global batch) or says N
    (assumptions)."""
    data = {k: copy.deepcopy(v) for k, v in data.items() if k not in ("flops_per_sample", "assumptions", "provenance")}
    for result in data["results"]:
        result.pop("step_seconds")
        result.pop("global_batch_size")
        for point in result["curve"]:
            point.pop("step_seconds")
    return data


def test_an_estimate_of_4096_micro_steps_answers_as_one_of_6(monkeypatch) -> None:
    from support import build_request

    from estimator.pipeline import estimate
    from estimator.plan.results import to_json
    from estimator.request.parse import parse_request

    monkeypatch.setenv("BATCHFIT_PARALLEL", "0")  # every simulation in this process, where it is counted

    def answer(n: int):
        request = parse_request({"model": {"source": "timm", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
                                 "training": {"grad_accumulation_steps": n}, "gpus": ["T4-16GB", "H100-80GB"]})
        built = build_request(request)
        return to_json(estimate(request, built=dataclasses.replace(built, batch_factory=PerBatch(built.batch_factory))))

    long, six = answer(4096), answer(REPLAYED)
    assert _timed_fields(long) == _timed_fields(six)
    assert long["flops_per_sample"] * 6 == six["flops_per_sample"] * 4096  # the same in every micro-step
    for a, b in zip(long["results"], six["results"], strict=True):
        assert a["step_seconds"] == pytest.approx(b["step_seconds"] * 4096 / 6)
        assert a["global_batch_size"] == a["recommended_batch_size"] * 4096
    assert any(line.startswith("grad accumulation: 3 of 4096 micro-steps simulated") for line in long["assumptions"])


# --- detection: num_objects -------------------------------------------------------------------------------


def test_detection_objects_do_not_lengthen_the_step() -> None:
    """1024 annotated objects a image simulate the same ops as 16 (boxes are one (N, 4) tensor a image, and
    torchvision matches them to anchors in whole-tensor ops), so an estimate at the limit costs what one at
    16 does; what makes a detection estimate slow is its simulations at a large batch (torchvision loops over
    the images: the growing trace, estimator/plan/growing.py, still checks one just past the largest max)."""
    from support import build_request

    from estimator.request.adapt import recipe_of
    from estimator.request.parse import parse_request

    def step(objects: int):
        request = parse_request({"model": {"source": "torchvision", "name": "fasterrcnn_mobilenet_v3_large_320_fpn"},
                                 "input": {"num_objects": objects}, "gpus": ["T4-16GB"]})
        built = build_request(request)
        return record_training(built.factory, built.batch_factory, built.loss_fn, 2, recipe_of(request),
                               get_gpu("T4-16GB"), worst_case=True)

    few, many = step(16), step(1024)
    assert [(a, few.allocations[k].op) for a, k in few.events] == [(a, many.allocations[k].op) for a, k in many.events]
    boxes = [a.nbytes for a in many.allocations if a.phase == "input" and a.op == "zeros"]
    assert 1024 * 4 * 4 in boxes  # (1024, 4) fp32 boxes: the objects are there
