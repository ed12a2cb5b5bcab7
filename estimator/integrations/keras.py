"""Keras 3 on the torch backend: ``estimate_keras``, a compiled model's ``train_step`` simulated as the torch ops
Keras runs.

>>> import os; os.environ["KERAS_BACKEND"] = "torch"          # before keras is imported   # doctest: +SKIP
>>> fit = estimate_keras(model, x_train, y_train, gpu="T4-16GB")
>>> model.fit(x_train, y_train, batch_size=fit.batch_size)

With ``KERAS_BACKEND=torch`` a Keras model is a ``torch.nn.Module`` whose variables are torch parameters, and its
``train_step`` (keras/src/backend/torch/trainer.py) is torch code: the forward (``model(x, training=True)``),
``zero_grad`` on the module, the compiled loss and the loss tracker, ``optimizer.scale_loss``, ``backward``, then
``optimizer.apply`` (Keras's own optimizers, written with ``torch._foreach_*`` ops) and the metrics. batchfit runs
exactly that, step by step, on a copy of the model rebuilt from its config on the meta device (``from_config``:
the model untouched, no weight copied anywhere) and compiled again from its compile config, so its optimizer's
state, its dtype policy (``mixed_float16``: Keras casts itself, with its ``LossScaleOptimizer``) and its layers'
kernels are Keras's. The batches are shaped like ``x`` and ``y`` (arrays or tensors with the samples first).

The TensorFlow backend is not modelled: batchfit simulates PyTorch's dispatcher, autograd engine and CUDA
caching allocator; under TensorFlow the same model runs other kernels (XLA fusions, ``tf.function`` graphs) and
allocates through TensorFlow's BFC allocator, none of which this simulation sees. A model that trains under
TensorFlow can be estimated under ``KERAS_BACKEND=torch`` as the same layers, but its TensorFlow run's memory
is not what batchfit predicts.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from estimator.errors import MissingExtraError, SpecError
from estimator.integrations.fit import EXTRA, Fit, batch_like, card_for, fit_batch


def _torch_keras() -> Any:
    """keras, imported, on the torch backend (module docstring); else why not."""
    try:
        import keras
    except ImportError as exc:
        if getattr(exc, "name", None) == "keras":
            raise MissingExtraError(EXTRA, "estimator.integrations.keras", str(exc)) from exc
        raise SpecError("KERAS_BACKEND", os.environ.get("KERAS_BACKEND"), "torch, set before keras is imported "
                        f"(batchfit simulates the torch backend; keras failed to import this one: {exc})") from exc
    if keras.backend.backend() != "torch":
        raise SpecError("KERAS_BACKEND", keras.backend.backend(), "torch, set before keras is imported: the "
                        "TensorFlow and JAX backends are not modelled")
    return keras


keras = _torch_keras()

import torch  # noqa: E402
from keras.src.backend.torch.core import device_scope  # noqa: E402

from estimator.gpus import GPU  # noqa: E402
from estimator.models.user import user_model  # noqa: E402
from estimator.simulate.recipe import OPTIMIZERS, Recipe  # noqa: E402


def estimate_keras(model: Any, x: Any, y: Any, *, gpu: str | GPU | None = None, batch_size: int | None = None,
                   profile_path: str | Path | None = None) -> Fit:
    """The step of the compiled ``model`` on batches like ``x``, ``y`` (module docstring): on ``gpu`` (None: the
    CUDA device torch sees, else the CPU target), the recommended batch (``batch_size`` given: the memory
    there); on the CPU target, the step at ``batch_size``."""
    if not getattr(model, "compiled", False):
        raise SpecError("model", getattr(model, "name", type(model).__name__), "a compiled Keras model "
                        "(model.compile(optimizer=..., loss=...))")
    if model.jit_compile:
        raise SpecError("jit_compile", True, "False (torch.compile's graphs are not simulated)")
    step = KerasStep(model)
    data = _tensors((x, y))
    samples = next(t for t in torch.utils._pytree.tree_leaves(data) if isinstance(t, torch.Tensor)).shape[0]
    built = user_model(step.factory, batch_like(data, samples), step_fn=step, optimizer_fn=step.optimizer,
                       on_device=step.on_device, name=f"keras:{model.name}")
    recipe = Recipe(optimizer=step.optimizer_name, zero_grad_at="after-forward")
    built.assumptions.append("Keras's train_step on the torch backend, its metrics' updates included; "
                             "the model rebuilt from its config and compiled again from its compile config")
    fit = fit_batch(built, recipe, card_for(gpu), batch_size=batch_size)
    if profile_path is not None:
        fit.save_profile(profile_path)
    return fit


def _tensors(data: Any) -> Any:
    """Arrays as CPU tensors (``torch.as_tensor``: no copy of a NumPy array)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v if isinstance(v, torch.Tensor) or not hasattr(v, "__array__") else
                    torch.as_tensor(v), data)


class KerasStep:
    """Keras's ``train_step`` cut where batchfit's loop (estimator/simulate/step.py) cuts a step: this object
    is the step function (forward, ``zero_grad``, loss, loss tracker, loss scaling), ``optimizer(model)`` the
    optimizer whose ``step`` is ``optimizer.apply`` and the metrics. The model is rebuilt by ``factory`` on the
    meta device; ``on_device`` points its variables at the parameters the simulation placed and compiles it."""

    def __init__(self, model: Any) -> None:
        self.cls, self.config = type(model), model.get_config()
        self.compile_config = model.get_compile_config()
        optimizer = model.optimizer
        name = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__.lower()
        self.optimizer_name = name if name in OPTIMIZERS else "adamw"  # a label: Keras's own optimizer runs
        self.learning_rate = float(optimizer.learning_rate)
        self.device = "cpu"
        self.pending: tuple[Any, Any, Any] | None = None  # x, y, y_pred: alive until the metrics, as in train_step
        try:
            self.factory()
        except Exception as exc:
            raise SpecError("model", model.name, "a model Keras rebuilds from its config (Functional, Sequential, "
                            f"or a subclass with get_config and from_config): {type(exc).__name__}: {exc}") from exc

    def factory(self) -> torch.nn.Module:
        with device_scope("meta"):
            rebuilt: torch.nn.Module = self.cls.from_config(copy.deepcopy(self.config))
        return rebuilt

    def on_device(self, model: Any) -> None:
        self.device = str(next(iter(model.parameters())).device)
        params = model._torch_params  # every variable of the model, by path
        for variable in model.variables:
            variable._value = params[variable.path]
        with device_scope(self.device):
            model.compile_from_config(copy.deepcopy(self.compile_config))

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        with device_scope(self.device):
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            model.zero_grad()  # torch.nn.Module's: the previous step's gradients go before the loss
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=None, training=True)
            model._loss_tracker.update_state(loss, sample_weight=_rows(x))
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        self.pending = (x, y, y_pred)
        result: torch.Tensor = loss
        return result

    def optimizer(self, model: Any) -> Any:
        return KerasOptimizer(model, self)


class KerasOptimizer:
    """What batchfit's loop asks of an optimizer, answered by the Keras model's: ``step`` is ``train_step``'s
    ``optimizer.apply`` (under ``no_grad``) then ``compute_metrics``; ``state`` its variables."""

    def __init__(self, model: Any, step: KerasStep) -> None:
        self.model, self.train_step = model, step
        self.trainable = list(model.trainable_weights)
        self.param_groups = [{"params": [v.value for v in self.trainable], "lr": step.learning_rate}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        with device_scope(self.train_step.device):
            with torch.no_grad():
                self.model.optimizer.apply([v.value.grad for v in self.trainable], self.trainable)
            pending, self.train_step.pending = self.train_step.pending, None
            if pending is not None:
                self.model.compute_metrics(*pending, sample_weight=None)
            del pending

    @property
    def state(self) -> dict[int, torch.Tensor]:
        return {i: v.value for i, v in enumerate(self.model.optimizer.variables)}


def _rows(x: Any) -> int:
    first = next(t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor))
    return int(first.shape[0])
