"""Lightning: ``BatchSizeEstimator``, a callback that stands where ``BatchSizeFinder`` stands, with no OOM trial.

>>> trainer = Trainer(max_epochs=3, callbacks=[BatchSizeEstimator(gpu="A100-80GB")])   # doctest: +SKIP
>>> trainer.fit(module, datamodule)          # datamodule.batch_size: the recommended batch, set before training

At ``setup`` (stage fit) it copies the module's structure onto the meta device, before the strategy moves,
casts or wraps it (the module untouched, no weight copied to any device); at ``on_fit_start``, where
``BatchSizeFinder`` searches (the module's own ``setup`` has made its datasets, the train dataloader is not made
yet), it simulates that copy's step as Lightning's automatic optimization runs it: ``training_step`` (under the
precision's autocast; the batch cast for ``bf16-true``), ``zero_grad`` after it, backward, the optimizer
``configure_optimizers`` builds. Layers a ``configure_model`` hook adds after setup are not in the copy. The
Trainer's precision (``32-true``, ``16-mixed``, ``bf16-mixed``, ``bf16-true``), ``accumulate_grad_batches`` and
strategy (DDP, FSDP: one rank of ``world_size``) are read into batchfit's recipe (``recipe_of``). The batch is
shaped like the train dataloader's first one. Then the recommended batch (at most ``max_val``) is set with
``lightning_setattr`` on the module or its datamodule, as ``BatchSizeFinder`` does, and with
``target_global_batch`` the accumulation too. In a job already launched over several processes, rank 0
simulates (the job's process group set aside meanwhile, the other ranks waiting) and broadcasts the answer.

Not modelled: ``on_before_batch_transfer``/``on_after_batch_transfer`` (the batch goes to the device as it
is), gradient clipping's norms, ``self.log`` (a no-op in the simulation), manual optimization, other
strategies (DeepSpeed, model parallel, XLA: refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from estimator.integrations.fit import Fit, batch_like, card_for, fit_batch, require

_pl = require("lightning.pytorch", "estimator.integrations.lightning")

import torch  # noqa: E402  (after the check: without lightning the import above names the extra)
from lightning.pytorch.callbacks import BatchSizeFinder  # noqa: E402
from lightning.pytorch.core.optimizer import _configure_optimizers  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy  # noqa: E402
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr  # noqa: E402

from estimator.errors import BatchfitError, SpecError  # noqa: E402
from estimator.gpus import GPU  # noqa: E402
from estimator.models import BuiltModel  # noqa: E402
from estimator.models.user import user_model  # noqa: E402
from estimator.simulate.recipe import Distributed, Recipe  # noqa: E402

# Trainer(precision=...) -> batchfit's precision
PRECISIONS = {"32-true": "fp32", "16-mixed": "amp-fp16", "bf16-mixed": "amp-bf16", "bf16-true": "bf16"}
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # FSDP1's sharding strategy -> fully_shard's
_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw",
               torch.optim.Adagrad: "adagrad", torch.optim.RMSprop: "rmsprop", torch.optim.Adafactor: "adafactor"}
FSDP_ASSUMPTION = ("Lightning's FSDPStrategy (FSDP1: a FlatParameter per wrapped module) simulated as FSDP2's "
                   "fully_shard per block: the same parameter, gradient and optimizer-state shards per rank; the "
                   "units gathered for compute are batchfit's blocks, not the auto_wrap_policy's")


class BatchSizeEstimator(BatchSizeFinder):
    """Where ``BatchSizeFinder`` stands: the batch from a simulation (module docstring), no trial.

    ``gpu``: a catalog name or a ``GPU`` (``estimator.gpus.custom_gpu``); None: the card the Trainer uses
    (``torch.cuda.get_device_name``), or, on a CPU Trainer, the CPU target: the step is simulated at the batch
    it has (``report``) and nothing is set. ``headroom``: the share of usable memory kept free (batchfit's
    ``planner.headroom``, 0.10; ``BatchSizeFinder``'s ``margin``, applied to memory, not to the batch).
    ``profile_path``: write the step's portable profile there. After fit starts: ``result`` (the card's
    ``GPUResult``, as ``estimate`` answers it), ``batch_size``, ``accumulation``, ``report`` (the step's memory
    at that batch) and ``fit``.
    """

    def __init__(self, gpu: str | GPU | None = None, *, headroom: float | None = None,
                 batch_arg_name: str = "batch_size", target_global_batch: int | None = None, max_val: int = 8192,
                 profile_path: str | Path | None = None) -> None:
        super().__init__(batch_arg_name=batch_arg_name, max_val=max_val)
        self.gpu, self.headroom, self.target_global_batch = gpu, headroom, target_global_batch
        self.profile_path = profile_path
        self.fit: Fit | None = None
        self._before_strategy: Any = None  # the module at setup, on the meta device

    @property
    def result(self) -> Any:
        return None if self.fit is None else self.fit.result

    @property
    def batch_size(self) -> int | None:
        return None if self.fit is None else self.fit.batch_size

    @property
    def accumulation(self) -> int | None:
        return None if self.fit is None else self.fit.accumulation

    @property
    def report(self) -> Any:
        return None if self.fit is None else self.fit.report

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        """Stage fit: the module's structure as it is now, before the strategy moves, casts or wraps it (FSDP
        replaces its blocks), copied onto the meta device for ``on_fit_start``."""
        if stage == "fit":
            from estimator.models.meta import meta_copy

            self._before_strategy = meta_copy(pl_module, (trainer,))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Where ``BatchSizeFinder`` searches: the module's own ``setup`` has run (its datasets exist), the
        train dataloader is not made yet."""
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: Any, pl_module: Any) -> None:
        """Estimate, then set the batch (and the accumulation) where ``BatchSizeFinder`` sets it."""
        name = self._batch_arg_name
        if not trainer.fit_loop._data_source.is_module():
            raise SpecError("train_dataloaders", "passed to fit", "the module's or the datamodule's "
                            "train_dataloader (the batch is set on them)")
        if not lightning_hasattr(pl_module, name):
            raise SpecError("batch_arg_name", name, "a field of the module, its datamodule or their hparams "
                            "(lightning_setattr sets the batch there)")
        fit = _on_rank_zero(trainer, lambda: self._estimate(trainer, pl_module))
        self.fit = fit
        self.optimal_batch_size = fit.batch_size
        if fit.card is None:
            return  # the CPU target: the step's peak is predicted, no batch is fitted
        lightning_setattr(pl_module, name, fit.batch_size)
        if self.target_global_batch is not None:
            trainer.accumulate_grad_batches = fit.accumulation
        trainer.fit_loop._combined_loader = None  # the train dataloader is made again, at the new batch

    def _estimate(self, trainer: Any, pl_module: Any) -> Fit:
        current = lightning_getattr(pl_module, self._batch_arg_name)
        module = self._before_strategy if self._before_strategy is not None else pl_module
        fit = estimate_lightning(module, first_batch(trainer), trainer=trainer, gpu=self.gpu,
                                 batch_size=current, headroom=self.headroom,
                                 target_global_batch=self.target_global_batch, max_val=self._max_val)
        if self.profile_path is not None:
            fit.save_profile(self.profile_path)
        return fit

    # BatchSizeFinder's trial searches at validate, test and predict start: nothing to try here
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        pass

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        pass

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        pass


def estimate_lightning(pl_module: Any, batch: Any, *, trainer: Any = None, strategy: Strategy | None = None,
                       precision: str | None = None, gpu: str | GPU | None = None, batch_size: int | None = None,
                       headroom: float | None = None, target_global_batch: int | None = None,
                       max_val: int | None = None) -> Fit:
    """The callback's answer without a ``fit``: ``pl_module``'s step on batches shaped like ``batch`` (one the
    train dataloader yields, of ``batch_size`` samples), trained as ``trainer`` is configured, or with
    ``strategy`` and ``precision`` (a strategy object constructed without a launch). With a card, the
    recommended batch; on the CPU target, the step at ``batch_size``."""
    if trainer is not None:
        strategy = strategy or trainer.strategy
        precision = precision or trainer.precision
    strategy = strategy or SingleDeviceStrategy(torch.device("cpu"))
    accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
    recipe = recipe_of(strategy, precision or "32-true", accumulation)
    card = card_for(gpu, strategy.root_device if gpu is None and _has_devices(strategy) else None)
    built = lightning_step(pl_module, batch, batch_size=batch_size, trainer=trainer)
    if isinstance(strategy, FSDPStrategy):
        built.assumptions.append(FSDP_ASSUMPTION)
        if recipe.distributed.param_dtype is not None and "mixed" in (precision or ""):
            built.assumptions.append(f"{precision} under FSDP: the blocks compute in MixedPrecision's param_dtype "
                                     f"({recipe.distributed.param_dtype}); Lightning's autocast around them is not "
                                     "simulated (it casts little more there)")
    recipe = dataclasses.replace(recipe, optimizer=_optimizer_name(pl_module, trainer))
    return fit_batch(built, recipe, card, batch_size=None if card is not None else batch_size, headroom=headroom,
                     target_global_batch=target_global_batch, max_val=max_val)


def lightning_step(pl_module: Any, batch: Any, *, batch_size: int | None = None, trainer: Any = None) -> BuiltModel:
    """The module's automatic-optimization step as a ``BuiltModel``: ``training_step`` through a wrapper module
    (as Lightning's strategies call it through theirs, so DDP sees the forward), ``configure_optimizers``'s
    optimizer, batches like ``batch``."""
    if not pl_module.automatic_optimization:
        raise SpecError("automatic_optimization", False, "True: a manual-optimization step calls its optimizers "
                        "itself, which batchfit does not simulate")
    cls = type(pl_module)
    return user_model(TrainingStep(pl_module), batch_like(batch, batch_size), step_fn=training_loss,
                      optimizer_fn=configured_optimizer, on_device=_on_device, share=(trainer,) if trainer else (),
                      name=f"{cls.__module__}:{cls.__qualname__}")


class TrainingStep(torch.nn.Module):
    """``module.training_step(batch, 0)`` as a forward: what Lightning's strategy wrappers forward to."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> Any:
        module: Any = self.module
        return module.training_step(batch, 0)


def training_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``training_step``'s output: a tensor, or a dict's ``"loss"``."""
    out = model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise SpecError("training_step", type(out).__name__, "a loss tensor or a dict with 'loss' (a step that "
                        "returns None is skipped by Lightning, and has nothing to simulate)")
    return loss


def configured_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` returns (its schedulers are built and left alone)."""
    module: Any = model.module if isinstance(model, TrainingStep) else model
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    if len(optimizers) != 1:
        raise SpecError("configure_optimizers", f"{len(optimizers)} optimizers", "one optimizer (automatic "
                        "optimization takes one)")
    optimizer: torch.optim.Optimizer = optimizers[0]
    return optimizer


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` in the simulation: the logged scalars are not modelled."""


def _on_device(model: torch.nn.Module) -> None:
    """The copy on the device, as Lightning's ``.to(device)`` leaves it: ``self.device`` answers the device,
    and ``self.log`` logs nothing (its values are fake)."""
    module: Any = model.module if isinstance(model, TrainingStep) else model
    first = next(iter(module.parameters()), None)
    if first is not None:
        module._device = first.device
    module.log = module.log_dict = _no_log


def recipe_of(strategy: Strategy, precision: str = "32-true", accumulate_grad_batches: int = 1) -> Recipe:
    """The Trainer's training choices in batchfit's recipe: precision, accumulation, Lightning's zero_grad
    after the training step, and the strategy (``distributed_of``)."""
    if precision not in PRECISIONS:
        raise SpecError("precision", precision, f"one of {', '.join(PRECISIONS)}")
    d, checkpointing = distributed_of(strategy)
    mode = PRECISIONS[precision]
    if mode == "bf16":
        d = dataclasses.replace(d, param_dtype=None, reduce_dtype=None)  # the module itself is cast to bf16
    elif d.param_dtype is not None:
        mode = "fp32"  # FSDP casts the shards to param_dtype for compute (batchfit's MixedPrecisionPolicy)
    return Recipe(precision=mode, grad_accumulation_steps=accumulate_grad_batches, zero_grad_at="after-forward",
                  gradient_checkpointing=checkpointing, distributed=d)


def distributed_of(strategy: Strategy) -> tuple[Distributed, bool]:
    """A strategy's settings as batchfit's ``Distributed`` (one rank of its world), and whether it applies
    activation checkpointing. Read from the object, without a launch: ``num_nodes`` x its devices ranks."""
    if isinstance(strategy, SingleDeviceStrategy):
        return Distributed(), False
    world = strategy.num_nodes * max(strategy.num_processes, 1)  # type: ignore[attr-defined]
    if isinstance(strategy, FSDPStrategy):
        name = strategy.sharding_strategy.name
        if name not in _RESHARD:
            raise SpecError("strategy.sharding_strategy", name, f"one of {', '.join(_RESHARD)} (hybrid sharding "
                            "and NO_SHARD are not modelled)")
        offload = strategy.cpu_offload
        if offload is not None and offload.offload_params:
            raise SpecError("strategy.cpu_offload", True, "off (parameters offloaded to the CPU are not modelled)")
        mp = strategy.mixed_precision_config
        names = {torch.float32: None, torch.bfloat16: "bf16", torch.float16: "fp16"}
        param = names.get(mp.param_dtype) if mp is not None and mp.param_dtype is not None else None
        reduce = names.get(mp.reduce_dtype) if mp is not None and mp.reduce_dtype is not None and param else None
        d = Distributed("fsdp", world, reshard_after_forward=_RESHARD[name], param_dtype=param, reduce_dtype=reduce)
        return d, bool(strategy._activation_checkpointing_kwargs)
    if isinstance(strategy, DDPStrategy):
        kw = strategy._ddp_kwargs
        return Distributed("ddp", world, bucket_cap_mb=kw.get("bucket_cap_mb"),
                           gradient_as_bucket_view=bool(kw.get("gradient_as_bucket_view", False)),
                           static_graph=bool(kw.get("static_graph", False))), False
    raise SpecError("strategy", type(strategy).__name__, "SingleDeviceStrategy, DDPStrategy or FSDPStrategy")


def first_batch(trainer: Any) -> Any:
    """The first batch of the train dataloader, made again as the fit loop will make it (on the CPU)."""
    loader = trainer.fit_loop._data_source.dataloader()
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise SpecError("train_dataloader", type(loader).__name__, "one DataLoader (the batch is shaped like its "
                        "first batch)")
    return next(iter(loader))


def _has_devices(strategy: Strategy) -> bool:
    try:
        return strategy.root_device is not None
    except (AssertionError, AttributeError, IndexError, TypeError):  # a strategy built without its devices
        return False


def _optimizer_name(pl_module: Any, trainer: Any) -> str:
    """batchfit's name of the module's optimizer class, for the recipe's label (a profile's request); the
    optimizer simulated is the module's own either way."""
    from estimator.models.meta import meta_copy

    try:
        copy: Any = meta_copy(pl_module, (trainer,) if trainer is not None else ())
        optimizers, _, _ = _configure_optimizers(copy.configure_optimizers())
    except Exception:  # noqa: BLE001 - a label only: configure_optimizers runs again, checked, in the simulation
        return "adamw"
    return _OPTIMIZERS.get(type(optimizers[0]), "adamw") if optimizers else "adamw"


def _on_rank_zero(trainer: Any, estimate: Callable[[], Fit]) -> Fit:
    """``estimate()`` here, or, in a launched job, on rank 0 with the job's process group set aside (a
    simulation makes its own fake one), its answer (or its error) broadcast to every rank."""
    if not torch.distributed.is_initialized():
        return estimate()
    answer: Fit | BatchfitError | None = None
    if trainer.global_rank == 0:
        from estimator.simulate.distributed import job_group_set_aside

        try:
            with job_group_set_aside():
                answer = estimate()
        except BatchfitError as exc:
            answer = exc  # every rank raises it, rather than the others waiting for an answer
    answer = trainer.strategy.broadcast(answer, src=0)
    if isinstance(answer, BaseException):
        raise answer
    assert answer is not None  # rank 0's
    return answer
