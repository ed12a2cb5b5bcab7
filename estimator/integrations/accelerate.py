"""accelerate: ``find_executable_batch_size`` with accelerate's signature, the batch from a simulation.

>>> @find_executable_batch_size(starting_batch_size=512, model=model, sample=(x[:1], y[:1]),
...                             loss_fn=F.cross_entropy, gpu="A100-80GB")              # doctest: +SKIP
... def train(batch_size):
...     loader = DataLoader(data, batch_size=batch_size); ...
>>> train()                                   # called once, with the recommended batch (at most 512)

The wrapped function is called once, with the recommended batch of the step simulated for ``model`` and
batches shaped like ``sample`` (one example, batch dimension 1): ``loss_fn(model(inputs), targets)`` of
``sample = (inputs, targets)``, or, without ``loss_fn``, the loss the model returns from ``model(sample)`` (a
dict: keyword arguments; its output's ``.loss``, ``["loss"]``, or itself). The recipe is the ``Accelerator``'s
when the script made one (its mixed precision, with the outputs converted to fp32 as its prepared model
converts them, and its processes: DDP or FSDP), else ``recipe``. Should the card still run out of memory,
the decorator warns (``OutOfMemoryFallback``) and hands over to accelerate's own search, starting below the
estimated batch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from estimator.integrations.fit import Fit, batch_like, card_for, fit_batch, require

_accelerate = require("accelerate", "estimator.integrations.accelerate")

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DistributedType, convert_to_fp32  # noqa: E402
from accelerate.utils import find_executable_batch_size as accelerates_search  # noqa: E402
from accelerate.utils.memory import should_reduce_batch_size  # noqa: E402

from estimator.errors import SpecError  # noqa: E402
from estimator.gpus import GPU  # noqa: E402
from estimator.models.user import user_model  # noqa: E402
from estimator.simulate.recipe import Distributed, Recipe  # noqa: E402
from estimator.simulate.step import apply_model  # noqa: E402

_PRECISIONS = {"no": "fp32", "bf16": "amp-bf16", "fp16": "amp-fp16"}
_STRATEGIES = {DistributedType.NO: "none", DistributedType.MULTI_GPU: "ddp", DistributedType.MULTI_CPU: "ddp",
               DistributedType.FSDP: "fsdp"}


class OutOfMemoryFallback(UserWarning):
    """The estimated batch ran out of memory for real: accelerate's own search takes over below it."""


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128, *,
                               model: torch.nn.Module, sample: Any, loss_fn: Callable[[Any, Any], Any] | None = None,
                               gpu: str | GPU | None = None, recipe: Recipe | None = None,
                               profile_path: str | Path | None = None) -> Any:
    """accelerate's decorator (module docstring): ``function(batch_size, *args, **kwargs)`` called once with the
    estimated batch, at most ``starting_batch_size``. The estimate runs when the wrapped function is called;
    its answer is then the wrapper's ``fit`` attribute."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size, model=model,
                                 sample=sample, loss_fn=loss_fn, gpu=gpu, recipe=recipe, profile_path=profile_path)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fit = estimate_accelerate(model, sample, loss_fn=loss_fn, gpu=gpu, recipe=recipe,
                                  max_val=starting_batch_size)
        wrapper.fit = fit  # type: ignore[attr-defined]
        if profile_path is not None:
            fit.save_profile(profile_path)
        try:
            return function(fit.batch_size, *args, **kwargs)
        except Exception as exc:
            # accelerate's own test of an out-of-memory error (its messages), and torch's type for CUDA's
            if not (isinstance(exc, torch.OutOfMemoryError) or should_reduce_batch_size(exc)):
                raise
            failed = type(exc).__name__
        # out of the except block: the failed step's tensors (held by its traceback) are free to go
        below = int(fit.batch_size * 0.9)  # accelerate's own first reduction
        warnings.warn(OutOfMemoryFallback(f"batch {fit.batch_size} ran out of memory on the card ({failed}); "
                                          f"accelerate's search takes over from batch {below}"), stacklevel=2)
        return accelerates_search(function, starting_batch_size=below)(*args, **kwargs)

    return wrapper


def estimate_accelerate(model: torch.nn.Module, sample: Any, *, loss_fn: Callable[[Any, Any], Any] | None = None,
                        gpu: str | GPU | None = None, recipe: Recipe | None = None,
                        max_val: int | None = None) -> Fit:
    """The decorator's answer itself: the step of ``model`` on batches like ``sample`` (module docstring)."""
    card = card_for(gpu)
    if card is None:
        raise SpecError("gpu", None, "a catalog name or a GPU: this machine has no CUDA device to read, and the "
                        "batch is fitted to a card")
    recipe = recipe or accelerator_recipe()
    mixed = recipe.autocast_dtype is not None
    if loss_fn is not None:
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise SpecError("sample", type(sample).__name__, "(inputs, targets) with loss_fn, each with batch "
                            "dimension 1")
        criterion = loss_fn

        def step(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            out = apply_model(m, batch[0])
            loss: torch.Tensor = criterion(convert_to_fp32(out) if mixed else out, batch[1])
            return loss
    else:
        def step(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            out = apply_model(m, batch)
            return _own_loss(convert_to_fp32(out) if mixed else out)

    cls = type(model)
    built = user_model(model, batch_like(sample, 1), step_fn=step, name=f"{cls.__module__}:{cls.__qualname__}")
    return fit_batch(built, recipe, card, max_val=max_val)


def accelerator_recipe() -> Recipe:
    """The recipe of the ``Accelerator`` this process made (its mixed precision, its processes), else the default
    one (fp32, AdamW, one GPU)."""
    if not AcceleratorState._shared_state:
        return Recipe()
    state = AcceleratorState()
    precision = _PRECISIONS.get(str(state.mixed_precision))
    if precision is None:
        raise SpecError("mixed_precision", state.mixed_precision, f"one of {', '.join(_PRECISIONS)}")
    strategy = _STRATEGIES.get(state.distributed_type)
    if strategy is None:
        raise SpecError("distributed_type", str(state.distributed_type), "NO, MULTI_GPU, MULTI_CPU or FSDP")
    world = state.num_processes if strategy != "none" else 1
    return Recipe(precision=precision, distributed=Distributed(strategy, world) if strategy != "none" else
                  Distributed())


def _own_loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor):
        loss = out
    if not isinstance(loss, torch.Tensor):
        raise SpecError("loss_fn", None, "a loss_fn(outputs, targets), or a model that returns its loss (a tensor, "
                        "or an output with .loss or ['loss'])")
    return loss
