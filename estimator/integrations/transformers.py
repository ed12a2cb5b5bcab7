"""The Hugging Face Trainer: ``fit_training_args`` instead of ``auto_find_batch_size``, with no OOM trial.

>>> args = fit_training_args(TrainingArguments("out", bf16=True), model, tokenizer("a sample", return_tensors="pt"),
...                          gpu="A100-80GB", target_global_batch=256)                    # doctest: +SKIP
>>> Trainer(model, args, train_dataset=data).train()   # per_device_train_batch_size, gradient_accumulation_steps set

The step simulated is the Trainer's own, for this model and these arguments: ``model(**batch)`` with the labels
in the batch, the loss the model returns (``outputs["loss"]``), under autocast for ``bf16``/``fp16`` with the
outputs converted to fp32 as accelerate's prepared model converts them (``convert_outputs_to_fp32``), backward,
the optimizer ``optim`` names built as ``Trainer.create_optimizer`` builds it (``get_optimizer_cls_and_kwargs``,
weight decay and no-decay parameter groups), ``zero_grad`` after the step; ``activation_checkpointing`` (alias
``gradient_checkpointing``) as the Trainer enables it; and the launch's world size (``args.world_size``: DDP,
or FSDP2 with ``fsdp``, or the ZeRO stage of a ``deepspeed`` config where batchfit models it). ``sample`` is one
example as the collator yields it: a dict of tensors with batch dimension 1.

``PeakMemoryCallback`` is a ``TrainerCallback`` that logs the prediction beside
``torch.cuda.max_memory_reserved()`` after the first steps of a run on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from estimator.integrations.fit import Fit, batch_like, card_for, fit_batch, require

require("accelerate", "estimator.integrations.transformers (the Trainer needs accelerate)")

import torch  # noqa: E402
from accelerate.utils import convert_to_fp32  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from estimator.errors import SpecError  # noqa: E402
from estimator.gpus import GPU  # noqa: E402
from estimator.models import BuiltModel  # noqa: E402
from estimator.models.user import user_model  # noqa: E402
from estimator.simulate.recipe import Distributed, Recipe  # noqa: E402

log = logging.getLogger(__name__)
_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw",
               torch.optim.Adagrad: "adagrad", torch.optim.RMSprop: "rmsprop", torch.optim.Adafactor: "adafactor"}
_FSDP1_RESHARD = {"full_shard": True, "shard_grad_op": False}


def fit_training_args(args: TrainingArguments, model: torch.nn.Module, sample: Mapping[str, torch.Tensor], *,
                      gpu: str | GPU | None = None, target_global_batch: int | None = None,
                      profile_path: str | Path | None = None) -> TrainingArguments:
    """A copy of ``args`` with ``per_device_train_batch_size`` (the recommended batch on ``gpu``) and
    ``gradient_accumulation_steps`` (for ``target_global_batch`` over the world, else as ``args`` has it) set
    from a simulation of the Trainer's step (module docstring); ``profile_path``: write its portable profile."""
    fit = estimate_trainer(args, model, sample, gpu=gpu, target_global_batch=target_global_batch)
    if profile_path is not None:
        fit.save_profile(profile_path)
    fitted = copy.copy(args)
    fitted.per_device_train_batch_size = fit.batch_size
    fitted.gradient_accumulation_steps = fit.accumulation
    return fitted


def estimate_trainer(args: TrainingArguments, model: torch.nn.Module, sample: Mapping[str, torch.Tensor], *,
                     gpu: str | GPU | None = None, target_global_batch: int | None = None) -> Fit:
    """``fit_training_args``'s answer itself: the card's result, the batch, the accumulation, the memory."""
    card = card_for(gpu)
    if card is None:
        raise SpecError("gpu", None, "a catalog name or a GPU: this machine has no CUDA device to read, and the "
                        "batch is fitted to a card")
    built, recipe = trainer_step(args, model, sample)
    return fit_batch(built, recipe, card, target_global_batch=target_global_batch)


def trainer_step(args: TrainingArguments, model: torch.nn.Module,
                 sample: Mapping[str, torch.Tensor]) -> tuple[BuiltModel, Recipe]:
    """The Trainer's step for ``model`` and ``args`` (module docstring) as the simulator takes it, and its recipe."""
    if not isinstance(sample, Mapping) or not sample:
        raise SpecError("sample", type(sample).__name__, "one example as the collator yields it: a dict of tensors "
                        "with batch dimension 1")
    recipe = recipe_of(args, model)
    optimizer_fn = None if recipe.distributed.strategy == "zero1" else optimizer_fn_of(args)
    cls = type(model)
    built = user_model(model, batch_like(dict(sample), 1), step_fn=loss_fn_of(recipe), optimizer_fn=optimizer_fn,
                       name=f"{cls.__module__}:{cls.__qualname__}")
    if recipe.distributed.param_dtype is not None:
        built.assumptions.append("FSDP under bf16/fp16: the blocks compute in accelerate's MixedPrecisionPolicy "
                                 f"dtype ({recipe.distributed.param_dtype}); its autocast around them is not "
                                 "simulated")
    return built, recipe


def recipe_of(args: TrainingArguments, model: torch.nn.Module) -> Recipe:
    """The Trainer's training choices in batchfit's recipe: precision, checkpointing, accumulation, the
    optimizer's name (its options are the Trainer's own, ``optimizer_fn_of``) and the world."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if dtype == torch.bfloat16:
        precision = "bf16"  # the model itself in bf16 (loaded so): autocast changes nothing more
    elif args.bf16:
        precision = "amp-bf16"
    elif args.fp16:
        precision = "amp-fp16"
    else:
        precision = "fp32"
    d, fsdp_checkpointing = distributed_of(args)
    if d.strategy == "fsdp" and precision.startswith("amp"):
        low = "bf16" if args.bf16 else "fp16"
        d = dataclasses.replace(d, param_dtype=low, reduce_dtype=low)
        precision = "fp32"  # accelerate's MixedPrecisionPolicy casts the shards (batchfit's fsdp.param_dtype)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, cast(Any, model))
    options = {"lr": kwargs.get("lr"), "weight_decay": args.weight_decay, **{k: kwargs[k] for k in
                                                                             ("betas", "eps") if k in kwargs}}
    return Recipe(precision=precision, optimizer=_OPTIMIZERS.get(cls, "adamw"), optimizer_kwargs=options,
                  gradient_checkpointing=_checkpointing(args) or fsdp_checkpointing,
                  grad_accumulation_steps=args.gradient_accumulation_steps, distributed=d)


def _checkpointing(args: TrainingArguments) -> bool | str:
    if not args.activation_checkpointing:
        return False
    kwargs: dict[str, Any] = dict(cast(Any, args.activation_checkpointing_kwargs) or {})
    for key, plain in (("every_n_layers", 1), ("offload", False)):
        value = kwargs.pop(key, plain)
        if value != plain:
            raise SpecError(f"activation_checkpointing_kwargs.{key}", value, f"{plain} (not modelled)")
    return "reentrant" if kwargs.get("use_reentrant") else True  # transformers' default: non-reentrant


def distributed_of(args: Any, world_size: int | None = None) -> tuple[Distributed, bool]:
    """The launch's data parallelism as batchfit's ``Distributed`` (one rank of ``args.world_size``), and whether
    FSDP applies activation checkpointing itself: FSDP2 (``fsdp``, ``fsdp_config``), a ``deepspeed`` config's ZeRO
    stage 1 (DDP + a sharded optimizer) or 3 (FSDP2's per-parameter shards stand for it), else DDP over more
    than one rank."""
    world = world_size or int(getattr(args, "world_size", 1) or 1)
    if getattr(args, "deepspeed", None):
        stage = _zero_stage(args.deepspeed)
        if stage == 1:
            return Distributed("zero1", world), False
        if stage == 3:
            return Distributed("fsdp", world), False
        raise SpecError("deepspeed.zero_optimization.stage", stage, "1 or 3 (ZeRO-2's gradient partitioning and "
                        "stage 0 are not modelled)")
    if getattr(args, "fsdp", None):
        config: dict[str, Any] = dict(cast(Any, getattr(args, "fsdp_config", None)) or {})
        if str(config.get("cpu_offload", "false")).lower() == "true":
            raise SpecError("fsdp_config.cpu_offload", True, "false (offloaded parameters are not modelled)")
        raf = config.get("reshard_after_forward", True)
        if int(config.get("version", 2)) == 1:
            if str(raf).lower() not in _FSDP1_RESHARD:
                raise SpecError("fsdp_config.reshard_after_forward", raf, f"one of {', '.join(_FSDP1_RESHARD)}")
            raf = _FSDP1_RESHARD[str(raf).lower()]
        checkpointing = str(config.get("activation_checkpointing", "false")).lower() == "true"
        return Distributed("fsdp", world, reshard_after_forward=str(raf).lower() == "true"), checkpointing
    if world > 1:
        return Distributed("ddp", world, bucket_cap_mb=getattr(args, "ddp_bucket_cap_mb", None)), False
    return Distributed(), False


def _zero_stage(config: Any) -> int:
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    stage = (config.get("zero_optimization") or {}).get("stage", 0) if isinstance(config, Mapping) else None
    if not isinstance(stage, int):
        raise SpecError("deepspeed", config, "a DeepSpeed config (a dict or a JSON file) with "
                        "zero_optimization.stage")
    return stage


def optimizer_fn_of(args: TrainingArguments) -> Any:
    """``Trainer.create_optimizer``'s optimizer for a model: the class and options ``optim`` names, over the
    weight-decay and no-decay parameter groups."""

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, cast(Any, model))
        decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # self unused
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        optimizer: torch.optim.Optimizer = cls(groups, **kwargs)
        return optimizer

    return build


def loss_fn_of(recipe: Recipe) -> Any:
    """The Trainer's ``compute_loss``: the model's own loss, after accelerate converts a mixed-precision
    forward's outputs to fp32 (the logits' fp32 copy is real memory)."""
    mixed = recipe.autocast_dtype is not None

    def loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        outputs = model(**batch)
        if mixed:
            outputs = convert_to_fp32(outputs)
        value = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
        if not isinstance(value, torch.Tensor):
            raise SpecError("sample", sorted(batch), "a sample with the labels the model computes its loss from")
        return value

    return loss


class PeakMemoryCallback(TrainerCallback):
    """Logs the predicted reserved peak beside ``torch.cuda.max_memory_reserved()`` once ``after_steps`` steps
    have run on a GPU (``measured`` holds it); nothing without one.

    >>> trainer = Trainer(model, args, callbacks=[PeakMemoryCallback.of(estimate_trainer(...))])  # doctest: +SKIP
    """

    def __init__(self, predicted_reserved_bytes: int, after_steps: int = 2) -> None:
        self.predicted = predicted_reserved_bytes
        self.after_steps = after_steps
        self.measured: int | None = None

    @classmethod
    def of(cls, fit: Fit, after_steps: int = 2) -> PeakMemoryCallback:
        return cls(fit.report.reserved_peak_bytes, after_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.after_steps and torch.cuda.is_available():
            self.measured = torch.cuda.max_memory_reserved()
            error = (self.predicted - self.measured) / self.measured if self.measured else 0.0
            log.info("batchfit: predicted %.2f GiB reserved, measured %.2f GiB after %d steps (%+.1f%%)",
                     self.predicted / 2**30, self.measured / 2**30, self.after_steps, 100 * error)
        return control
