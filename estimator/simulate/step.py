"""The training loop, written once: the simulation, a real CUDA step and a real CPU step all run it.

Per iteration: zero_grad -> (input -> forward -> loss -> backward) x
accumulation steps -> optimizer step (GradScaler for amp-fp16); a
simulation runs only the micro-steps it needs (``StepHooks.micro_step``). Model
outputs are released once the loss is computed, and the loss once
backward has run, as in the Hugging Face Trainer and Lightning loops. A step
the user wrote (``step_fn(model, batch) -> loss``: a Lightning module's
``training_step``, Keras's ``train_step``) stands for forward and loss; its
optimizer may be the model's own (``optimizer_fn``).

>>> training = prepare(model, recipe, torch.device("cuda"))                # doctest: +SKIP
>>> run_steps(training, batch_factory, loss_fn, 8, recipe, torch.device("cuda"))

What differs between a simulation and a measurement is only what watches
the loop: ``StepHooks``. Its defaults run the loop for real (torch.autocast,
no translation of errors); the recorder's hooks (``estimator.simulate.record``)
mark categories, switch phases and drive the virtual GPU's autocast.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from estimator.errors import SimulationError, SpecError
from estimator.models import BatchFactory, LossFn, OptimizerFn, StepFn
from estimator.simulate.checkpointing import enable_checkpointing
from estimator.simulate.optimizers import build_optimizer
from estimator.simulate.recipe import Recipe
from estimator.trace import Phase

T = TypeVar("T")


class StepHooks:
    """What a caller of ``run_steps`` sees of the loop. The defaults run it as a real training script."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def phase(self, phase: Phase, iteration: int) -> None:
        """The loop enters ``phase`` of ``iteration``."""

    def micro_step(self, iteration: int, micro: int) -> bool:
        """Accumulation micro-step ``micro`` of ``iteration`` starts; False ends the accumulation there.
        A real run runs every one; a simulation stands for the rest once they repeat
        (``estimator.simulate.accumulation``)."""
        return True

    def repeats_first(self, iteration: int, training: Training, batch: Any) -> bool:
        """Whether ``iteration`` (after the first) skips zero_grad and its micro-steps, the watcher having
        written them from the first iteration's (``estimator.simulate.iterations``); ``batch``: the one the loop
        holds. A real run runs them."""
        return False

    def call(self, phase: Phase, fn: Callable[[], T]) -> T:
        """Run one part of the step (input, forward, loss, backward, optimizer)."""
        return fn()

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
        """The forward and loss run inside this (mixed precision when ``dtype`` is set)."""
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def optimizer_step(self) -> contextlib.AbstractContextManager[Any]:
        """The optimizer step runs inside this."""
        return contextlib.nullcontext()

    def backward_starts(self) -> None:
        """A backward is about to run: what the forward left alive is the activations."""

    def after_backward(self, params: list[torch.nn.Parameter]) -> None:
        """A backward has run: ``params`` hold gradients."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step has run: its state exists."""

    def iteration_end(self, iteration: int) -> None:
        """An iteration (one optimizer step) is done."""


@dataclass
class Training:
    """A model ready to train: its trainable parameters, optimizer and (amp-fp16) GradScaler."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    notes: list[str]


def cast_model(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """The model in the recipe's parameter dtype (pure bf16 casts it; the simulation does so on meta)."""
    return model.to(torch.bfloat16) if recipe.precision == "bf16" else model


def prepare(model: torch.nn.Module, recipe: Recipe, device: torch.device, simulated: bool = False, *,
            optimizer_fn: OptimizerFn | None = None) -> Training:
    """Train mode, checkpointing, DDP, the optimizer and the GradScaler (for ``device``), as every run sets
    them up. FSDP's ``fully_shard`` is applied before (``estimator.simulate.distributed.shard``: a simulation
    shards the model on the meta device). ``simulated``: the step runs on the virtual GPU (DDP's Reducer is
    then ``SimulatedDDP``). ``optimizer_fn(model)``: the model's own optimizer, built from the model before DDP
    wraps it (as Lightning calls ``configure_optimizers``), instead of the recipe's."""
    model.train()
    notes = []
    if recipe.gradient_checkpointing:
        notes.append(enable_checkpointing(model, recipe.gradient_checkpointing))
    own = optimizer_fn(model) if optimizer_fn is not None else None
    if recipe.distributed.uses_ddp:
        from estimator.simulate.distributed import replicate

        model, how = replicate(model, recipe.distributed, simulated)
        notes.append(how)
    params = [p for p in model.parameters() if p.requires_grad]
    if own is not None:
        if recipe.distributed.strategy == "zero1":
            raise SpecError("training.distributed.strategy", "zero1", "ddp or fsdp with the model's own optimizer "
                            "(ZeroRedundancyOptimizer wraps an optimizer class, not an optimizer)")
        optimizer = own
        notes.append(f"optimizer: the model's own, {_described(own)}")
    else:
        optimizer = build_optimizer(recipe, params)
    scaler = torch.amp.GradScaler(device.type) if recipe.uses_grad_scaler else None
    return Training(model, params, optimizer, scaler, notes)


def _described(optimizer: torch.optim.Optimizer) -> str:
    """``AdamW (2 parameter groups; lr=0.001, weight_decay=0.01)``: the class and the first group's options."""
    groups = optimizer.param_groups
    first = groups[0] if groups else {}
    options = ", ".join(f"{k}={v}" for k, v in first.items() if k in _SHOWN and v is not None)
    return f"{type(optimizer).__name__} ({len(groups)} parameter group{'s' * (len(groups) != 1)}; {options})"


_SHOWN = ("lr", "betas", "momentum", "weight_decay", "foreach", "fused")


def apply_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(inputs)``: a dict as keyword arguments, a tuple or list as positional ones."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def run_steps(training: Training, batch_factory: BatchFactory, loss_fn: LossFn | None, batch_size: int,
              recipe: Recipe, device: torch.device, *, hooks: StepHooks | None = None,
              step_fn: StepFn | None = None) -> None:
    """``recipe.iterations`` optimizer steps of ``training`` on batches from ``batch_factory``: the loss is
    ``loss_fn(model(inputs), targets)`` of the batch's ``(inputs, targets)``, or ``step_fn(model, batch)`` of
    the whole batch."""
    hooks = hooks or StepHooks(device)
    model, params, optimizer, scaler = training.model, training.params, training.optimizer, training.scaler
    keep = getattr(batch_factory, "keep_dtype", ())
    accumulation = recipe.grad_accumulation_steps
    batch = None
    for it in range(recipe.iterations):
        written = it > 0 and hooks.repeats_first(it, training, batch)  # then none of its micro-steps runs
        if recipe.zero_grad_at == "step-start" and not written:
            hooks.phase(Phase.ZERO_GRAD, it)
            optimizer.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
        for micro in range(0 if written else accumulation):
            if not hooks.micro_step(it, micro):
                break  # the loss below is still divided by all of them
            hooks.phase(Phase.INPUT, it)
            batch = hooks.call(Phase.INPUT, lambda: batch_factory(batch_size, device))
            if step_fn is not None:
                loss = _own_step(hooks, model, batch, step_fn, recipe, keep=keep, it=it)
            else:
                assert loss_fn is not None  # one of the two (estimator.models.user)
                inputs, targets = batch
                loss = _forward(hooks, model, inputs, targets, loss_fn, recipe, keep=keep, it=it)
                del inputs, targets
            if micro == 0 and recipe.zero_grad_at == "after-forward":
                hooks.phase(Phase.ZERO_GRAD, it)
                optimizer.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
            hooks.phase(Phase.BACKWARD, it)
            hooks.backward_starts()
            if accumulation > 1:
                loss = loss / accumulation
            if scaler is not None:
                loss = scaler.scale(loss)
            hooks.call(Phase.BACKWARD, loss.backward)
            hooks.after_backward(params)
            del loss
        hooks.phase(Phase.OPTIMIZER, it)
        with hooks.optimizer_step():
            if scaler is not None:
                hooks.call(Phase.OPTIMIZER, lambda: scaler.step(optimizer))
                scaler.update()
            else:
                hooks.call(Phase.OPTIMIZER, optimizer.step)
        hooks.after_step(optimizer)
        hooks.iteration_end(it)
    hooks.phase(Phase.TEARDOWN, recipe.iterations - 1)
    del batch


def _forward(hooks: StepHooks, model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, recipe: Recipe, *,
             keep: tuple[int | str, ...] = (), it: int = 0) -> torch.Tensor:
    with hooks.autocast(recipe.autocast_dtype):
        hooks.phase(Phase.FORWARD, it)
        # pure bf16: the copy lives as long as the forward (and what autograd saves of it), as in Fabric
        out = hooks.call(Phase.FORWARD, lambda: apply_model(model, recipe.forward_inputs(inputs, keep)))
        hooks.phase(Phase.LOSS, it)
        loss = hooks.call(Phase.LOSS, functools.partial(loss_fn, out, targets))
        del out
    return _checked(loss)


def _own_step(hooks: StepHooks, model: torch.nn.Module, batch: Any, step_fn: StepFn, recipe: Recipe, *,
              keep: tuple[int | str, ...] = (), it: int = 0) -> torch.Tensor:
    """``step_fn(model, batch)``: forward and loss in one, under autocast, the batch as the forward gets it
    (pure bf16 casts its floating tensors, as Lightning's ``bf16-true`` casts the whole batch)."""
    with hooks.autocast(recipe.autocast_dtype):
        hooks.phase(Phase.FORWARD, it)
        loss = hooks.call(Phase.FORWARD, lambda: step_fn(model, recipe.forward_inputs(batch, keep)))
    return _checked(loss)


def _checked(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SimulationError("the loss must be a tensor with one element", Phase.LOSS)
    return loss
