"""Later iterations' forward and backward written from the first's (estimator/simulate/iterations.py): the trace is
the one a simulation of every iteration records, allocation for allocation, or every iteration is simulated."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from support import A100_80 as A100

from estimator.models import build
from estimator.request.adapt import job_of
from estimator.request.parse import parse_request
from estimator.simulate.iterations import Repeat
from estimator.simulate.recipe import Distributed, Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO, _ce

pytestmark = pytest.mark.sim

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "num_hidden_layers": 2}
CAUSAL = {"source": "transformers", "task": "causal-lm", "config": LLAMA}
LORA = {"method": "lora", "r": 4, "target_modules": "all-linear"}


def _request(model: dict, training: dict) -> tuple:
    job = job_of(parse_request({"model": model, "input": {"seq_len": 32}, "training": training}))
    built = build(job.model, job.input)
    return (built.factory, built.batch_factory, built.loss_fn), job.recipe


def _zoo(name: str, **recipe) -> tuple:
    return ZOO[name], Recipe(**recipe)


# name -> ((model factory, batch factory, loss), recipe), each written from the first iteration
WRITTEN = {
    "mlp adamw": lambda: _zoo("mlp"),
    "resnet18 batch norm, cuDNN workspaces": lambda: _zoo("resnet18"),
    "gpt2 amp-fp16 GradScaler (its scale made once)": lambda: _zoo("gpt2", precision="amp-fp16"),
    "gpt2 checkpointing, three iterations": lambda: _zoo("gpt2", gradient_checkpointing=True, iterations=3),
    "bert pure bf16, sgd": lambda: _zoo("bert", precision="bf16", optimizer="sgd"),
    "lstm": lambda: _zoo("lstm"),
    "llama amp-bf16 selective checkpointing": lambda: _request(CAUSAL, {"precision": "amp-bf16",
                                                                        "gradient_checkpointing": "selective"}),
    "llama lora": lambda: _request({**CAUSAL, "peft": LORA}, {"precision": "amp-bf16"}),
    "llama qlora paged 8-bit adamw": lambda: _request(
        {**CAUSAL, "peft": LORA, "quantization": {"method": "bnb-4bit"}},
        {"precision": "amp-bf16", "optimizer": {"name": "paged_adamw8bit"}}),
    "llama adafactor": lambda: _request(CAUSAL, {"optimizer": {"name": "adafactor"}}),
    # the first all-gather makes each block's unsharded parameters with empty, later ones refill them by resize_
    "llama fsdp over 2": lambda: _request(CAUSAL, {"precision": "amp-bf16",
                                                   "distributed": {"strategy": "fsdp", "world_size": 2}}),
    "llama fsdp over 3 (uneven shards), bf16 parameters": lambda: _request(CAUSAL, {
        "precision": "fp32", "distributed": {"strategy": "fsdp", "world_size": 3, "fsdp": {"param_dtype": "bf16"}}}),
}


class _Spy:
    """Counts the iterations ``Repeat.copy`` wrote and refused."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written = self.refused = 0
        copy = Repeat.copy

        def counted(repeat, rec, iteration, kept):
            done = copy(repeat, rec, iteration, kept)
            self.written += done
            self.refused += not done
            return done

        monkeypatch.setattr(Repeat, "copy", counted)


def _both(model: tuple, recipe: Recipe, batch: int = 2, gpu=A100):
    mf, bf, lf = model
    return (record_training(mf, bf, lf, batch, recipe, gpu, every_iteration=True),
            record_training(mf, bf, lf, batch, recipe, gpu))


def _same(full, written) -> None:
    assert written.events == full.events
    assert written.allocations == full.allocations
    assert written.flops == full.flops
    assert (written.assumptions, written.unsupported, written.sdpa_calls, written.card_queries,
            written.capability_thresholds) == (full.assumptions, full.unsupported, full.sdpa_calls,
                                               full.card_queries, full.capability_thresholds)


@pytest.mark.parametrize("name", list(WRITTEN))
def test_a_written_iteration_is_the_simulated_one_allocation_for_allocation(name: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model, recipe = WRITTEN[name]()
    spy = _Spy(monkeypatch)
    full, written = _both(model, recipe)
    assert (spy.written, spy.refused) == (recipe.iterations - 1, 0)  # every later iteration written
    _same(full, written)
    assert max(a.iteration for a in written.allocations) == recipe.iterations - 1


def test_the_cpu_target_writes_its_iterations_too(monkeypatch: pytest.MonkeyPatch) -> None:
    model, recipe = _zoo("resnet18")
    spy = _Spy(monkeypatch)
    full, written = _both(model, recipe, gpu=None)
    assert spy.written == 1
    _same(full, written)


# loops whose first iteration is not the later ones' program: never tried
NOT_TRIED = {
    "zero_grad after the forward": ("mlp", {"zero_grad_at": "after-forward"}),
    "gradients kept (set_to_none false)": ("mlp", {"zero_grad_set_to_none": False}),
    "accumulation": ("mlp", {"grad_accumulation_steps": 2}),
    # the first call of each shape searches its plans and empties the cache, later calls do not
    "cudnn.benchmark": ("conv", {"cudnn_benchmark": True}),
}


@pytest.mark.parametrize("name", list(NOT_TRIED))
def test_other_loops_simulate_every_iteration(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo, recipe = NOT_TRIED[name]
    model, recipe = _zoo(zoo, **recipe)
    spy = _Spy(monkeypatch)
    full, written = _both(model, recipe)
    assert (spy.written, spy.refused) == (0, 0)
    _same(full, written)


def test_ddp_simulates_every_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP rebuilds its gradient buckets after the first iteration: the second's forward allocates others."""
    model, recipe = _zoo("resnet18", distributed=Distributed("ddp", 2))
    spy = _Spy(monkeypatch)
    full, written = _both(model, recipe)
    assert (spy.written, spy.refused) == (0, 0)
    _same(full, written)
    forward = [[a.nbytes for a in full.allocations if a.category == "communication" and a.iteration == it
                and a.phase == "forward"] for it in (0, 1)]
    assert forward[0] == [] and forward[1] != []  # why: the second iteration's forward is another program


class KeepsLast(nn.Module):
    """Keeps a tensor of each forward until the next replaces it (a cache a module fills): the second
    iteration frees the first's, which the first iteration cannot show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 10)
        self.last: torch.Tensor | None = None

    def forward(self, x):
        self.last = x.detach() * 2  # (B, 256) fp32, freed when the next forward replaces it
        return self.fc(x)


class FreesOlder(nn.Module):
    """Frees at its first forward a buffer made before the loop: the first iteration frees something older
    than itself, which no later iteration does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 10)
        self.register_buffer("scratch", torch.zeros(1024))

    def forward(self, x):
        if self.scratch is not None:
            self.scratch = None  # 4 KiB freed once
        return self.fc(x)


class EmptiesCache(nn.Module):
    """Calls ``torch.cuda.empty_cache()`` in its forward, as cudnn.benchmark's first search of a shape does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        torch.cuda.empty_cache()
        return self.fc(x)


class KeepsInput(nn.Module):
    """Keeps its input until its next forward replaces it: the old batch is freed there, not as the input is
    replaced (a module attribute holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 10)
        self.seen: torch.Tensor | None = None

    def forward(self, x):
        self.seen = x
        return self.fc(x)


class KeepsView(KeepsInput):
    """Keeps a view of its input (a tensor sharing the batch's storage)."""

    def forward(self, x):
        self.rows = [x[0]]  # in a list: no tensor attribute, a second user of the storage
        return self.fc(x)


@pytest.mark.parametrize("module", [KeepsLast, FreesOlder, EmptiesCache, KeepsInput, KeepsView])
def test_what_the_first_iteration_leaves_or_frees_otherwise_is_simulated(module, monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    full, written = _both((module, ZOO["mlp"][1], _ce), Recipe())
    assert (spy.written, spy.refused) == (0, 1)
    _same(full, written)


def test_what_selective_checkpointing_under_fsdp_keeps_is_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The causal mask and rotary tables of each forward outlive the step there (no later event frees them), and
    the second forward makes its own: the first iteration cannot tell them from a cache made once."""
    model, recipe = _request(CAUSAL, {"precision": "fp32", "gradient_checkpointing": "selective",
                                      "distributed": {"strategy": "fsdp", "world_size": 2,
                                                      "fsdp": {"param_dtype": "bf16"}}})
    spy = _Spy(monkeypatch)
    full, written = _both(model, recipe, batch=1)
    assert (spy.written, spy.refused) == (0, 1)
    _same(full, written)
    made = [sorted(a.op for a in full.allocations if a.module == "model.rotary_emb" and a.iteration == it)
            for it in (0, 1)]
    assert made[0] == made[1] and made[0]  # each forward makes them again


class FreesInPlace(nn.Module):
    """Frees a temporary's storage by ``resize_(0)`` in each forward: each iteration makes its own storage (by
    ``mul``, not refilled by ``resize_`` as FSDP2's gathered parameters are)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        y = x * 2  # (B, 256) fp32
        total = y.sum()
        y.untyped_storage().resize_(0)
        return self.fc(x) + total


def test_a_storage_resized_away_within_the_iteration_is_made_again_by_its_op(monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    full, written = _both((FreesInPlace, ZOO["mlp"][1], _ce), Recipe())
    assert spy.written == 1
    _same(full, written)
    assert [a.op for a in written.allocations if a.iteration == 1 and a.module == "FreesInPlace"][:1] == ["mul"]


class KeepsGradients(torch.optim.SGD):
    """An optimizer of the user's that keeps each ``p.grad`` in its state: zero_grad frees none of them."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["last"] = p.grad
        return super().step(closure)


def test_a_users_optimizer_or_set_up_simulates_every_iteration(monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    mf, bf, lf = ZOO["mlp"]
    full = record_training(mf, bf, lf, 4, Recipe(), A100, every_iteration=True,
                           optimizer_fn=lambda m: KeepsGradients(m.parameters(), lr=0.1))
    written = record_training(mf, bf, lf, 4, Recipe(), A100,
                              optimizer_fn=lambda m: KeepsGradients(m.parameters(), lr=0.1))
    assert (spy.written, spy.refused) == (0, 0)
    _same(full, written)


def test_an_lstm_with_dropout_is_the_simulated_step() -> None:
    """cuDNN's dropout state is made once and kept: the first iteration shows it, so every iteration is
    simulated; the traces agree either way."""
    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.lstm = nn.LSTM(32, 32, num_layers=2, dropout=0.1, batch_first=True)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.lstm(self.embed(x))[0][:, -1])

    def batches(b, device):
        return torch.zeros(b, 12, dtype=torch.long, device=device), torch.zeros(b, dtype=torch.long, device=device)

    _same(*_both((Dropped, batches, _ce), Recipe()))


def test_a_simulated_second_iteration_would_differ_where_refused() -> None:
    """What the refusal guards: ``KeepsLast``'s second iteration frees the first one's cached tensor, an event
    a copy of the first iteration would not have."""
    full = record_training(KeepsLast, ZOO["mlp"][1], _ce, 4, Recipe(), A100, every_iteration=True)
    cached = [k for k, a in enumerate(full.allocations) if a.op == "mul" and a.iteration == 0]
    frees = [i for i, (alloc, k) in enumerate(full.events) if not alloc and k in cached]
    iteration_1 = min(i for i, (alloc, k) in enumerate(full.events) if alloc and full.allocations[k].iteration == 1)
    assert cached and all(i > iteration_1 for i in frees)  # freed by iteration 1's forward

