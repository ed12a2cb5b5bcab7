"""How a model is trained: precision, optimizer, checkpointing, accumulation.

>>> Recipe(precision="amp-bf16", optimizer="adamw").autocast_dtype
torch.bfloat16

Torch is imported only when a dtype is asked for: the request schema uses
this module's vocabularies where torch is not loaded (the service's API process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from estimator.errors import SpecError
from estimator.options import MAX_WORLD_SIZE

if TYPE_CHECKING:
    import torch

# Each vocabulary once: the request schema (estimator/request/spec.py) uses these aliases.
Precision = Literal["fp32", "amp-fp16", "amp-bf16", "bf16"]
# the last three are bitsandbytes' (8-bit block-wise state; paged: CUDA unified memory)
OptimizerName = Literal["sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor", "adamw8bit", "paged_adamw8bit",
                        "paged_adamw32bit"]
Checkpointing = bool | Literal["reentrant", "non-reentrant", "selective"]
ZeroGradAt = Literal["step-start", "after-forward"]
Strategy = Literal["none", "ddp", "fsdp", "zero1"]
LowPrecision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
CHECKPOINTING = (False, True, "reentrant", "non-reentrant", "selective")
ZERO_GRAD_AT: tuple[str, ...] = get_args(ZeroGradAt)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
MP_DTYPES: tuple[str, ...] = get_args(LowPrecision)


@dataclass(frozen=True)
class Distributed:
    """How the step is spread over ``world_size`` ranks, and which ``rank`` a simulation stands for.

    ``strategy``: ``"none"`` (one GPU), ``"ddp"`` (``DistributedDataParallel``),
    ``"fsdp"`` (FSDP2's ``fully_shard`` on each block, then the root, as
    torchtitan applies it) or ``"zero1"`` (DDP plus
    ``ZeroRedundancyOptimizer``). The DDP options are
    ``DistributedDataParallel``'s own (``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ``static_graph``); the FSDP ones
    ``fully_shard``'s (``reshard_after_forward``) and its
    ``MixedPrecisionPolicy``'s (``param_dtype``, ``reduce_dtype``: None is the
    parameter's dtype).

    >>> Distributed("fsdp", 8).shards
    True
    """

    strategy: str = "none"
    world_size: int = 1
    rank: int = 0
    bucket_cap_mb: float | None = None  # None: DDP's default, 25 MiB buckets after a first one of 1 MiB
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    reshard_after_forward: bool | int = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SpecError("training.distributed.strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        if not isinstance(self.world_size, int) or not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise SpecError("training.distributed.world_size", self.world_size,
                            f"an integer from 1 to {MAX_WORLD_SIZE}, or 'auto'")
        if self.strategy == "none" and self.world_size != 1:
            raise SpecError("training.distributed.world_size", self.world_size,
                            "1 with strategy 'none' (name a strategy: ddp, fsdp or zero1)")
        if not 0 <= self.rank < self.world_size:
            raise SpecError("rank", self.rank, f"a rank from 0 to {self.world_size - 1}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in MP_DTYPES:
                raise SpecError(f"training.distributed.fsdp.{name}", value, f"null or one of {', '.join(MP_DTYPES)}")
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and not (isinstance(raf, int) and raf >= 1):
            raise SpecError("training.distributed.fsdp.reshard_after_forward", raf, "true, false or an integer >= 1")
        if not isinstance(raf, bool) and self.strategy == "fsdp" and (
                raf > self.world_size or self.world_size % raf):
            raise SpecError("training.distributed.fsdp.reshard_after_forward", raf,
                            f"true, false, or a divisor of the world size ({self.world_size})")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise SpecError("training.distributed.ddp.bucket_cap_mb", self.bucket_cap_mb, "a number > 0")

    @property
    def active(self) -> bool:
        return self.strategy != "none"

    @property
    def shards(self) -> bool:
        """Whether parameters are sharded across ranks (FSDP)."""
        return self.strategy == "fsdp"

    @property
    def uses_ddp(self) -> bool:
        return self.strategy in ("ddp", "zero1")

    def at(self, world_size: int, rank: int = 0) -> Distributed:
        """The same strategy over ``world_size`` ranks, as ``rank`` sees it."""
        from dataclasses import replace

        return replace(self, world_size=world_size, rank=rank)

    def describe(self) -> str:
        if not self.active:
            return "one GPU"
        text = f"{self.strategy} over {self.world_size} ranks"
        return text + (f", rank {self.rank} simulated" if self.world_size > 1 else "")


@dataclass(frozen=True)
class Recipe:
    """The training recipe; ``None`` optimizer options mean PyTorch's default on the target.

    ``gradient_checkpointing``: ``False``, ``True`` (non-reentrant, the
    torch.utils.checkpoint default), ``"reentrant"``, ``"non-reentrant"`` or
    ``"selective"`` (torchtitan's per-op selective activation checkpointing:
    matmul and attention outputs saved, every second mm and all else recomputed).
    ``zero_grad_at``: ``"step-start"`` (``optimizer.zero_grad()`` before the
    forward, or after the previous step: the HF Trainer, timm) or
    ``"after-forward"`` (between the loss and backward, as Lightning's
    automatic optimization closure and many scripts do: the previous step's
    gradients stay alive through the forward).
    """

    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool | str = False
    grad_accumulation_steps: int = 1
    zero_grad_set_to_none: bool = True
    zero_grad_at: str = "step-start"
    cudnn_benchmark: bool = False
    iterations: int = 2
    distributed: Distributed = field(default_factory=Distributed)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SpecError("training.precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError("training.optimizer.name", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        if self.gradient_checkpointing not in CHECKPOINTING:
            raise SpecError(
                "training.gradient_checkpointing", self.gradient_checkpointing,
                "false, true, 'reentrant', 'non-reentrant' or 'selective'",
            )
        if not isinstance(self.cudnn_benchmark, bool):
            raise SpecError("training.cudnn_benchmark", self.cudnn_benchmark, "true or false")
        if self.zero_grad_at not in ZERO_GRAD_AT:
            raise SpecError("training.zero_grad_at", self.zero_grad_at, f"one of {', '.join(ZERO_GRAD_AT)}")
        if not isinstance(self.grad_accumulation_steps, int) or self.grad_accumulation_steps < 1:
            raise SpecError("training.grad_accumulation_steps", self.grad_accumulation_steps, "an integer >= 1")
        if not isinstance(self.distributed, Distributed):
            raise SpecError("training.distributed", self.distributed, "a Distributed")
        if self.distributed.param_dtype is not None and self.precision != "fp32":
            raise SpecError("training.precision", self.precision, "'fp32' with fsdp.param_dtype set: FSDP2 casts "
                            "for compute, without autocast, and keeps the sharded parameters and the optimizer "
                            "state in fp32 (torchtitan's recipe)")
        if not isinstance(self.iterations, int) or self.iterations < 2:
            # Optimizer state appears in the first step, the steady peak in the second.
            raise SpecError("training.iterations", self.iterations, "an integer >= 2")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}.get(self.precision)

    @property
    def param_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def uses_grad_scaler(self) -> bool:
        return self.precision == "amp-fp16"

    def forward_inputs(self, inputs: Any, keep: tuple[int | str, ...] = ()) -> Any:
        """The model's inputs as the forward gets them: in pure bf16, every floating tensor cast to bf16.

        As Lightning's ``bf16-true`` (``HalfPrecision.convert_input``, which
        applies ``_convert_fp_tensor`` through nested lists and dicts):
        floating tensors, detection boxes among them, become bf16; token
        ids and labels stay integers. The fp32 batch the loader made stays
        alive beside the copy, as Fabric's loop variable keeps it; outputs
        are not cast back (the Trainer's ``convert_output`` is a no-op).
        ``keep``: positions or keys of ``inputs`` left as they are
        (torchvision's detection targets: its ``roi_heads.check_targets``
        refuses bf16 boxes, so a run that works keeps them fp32).

        >>> Recipe(precision="bf16").forward_inputs({"x": torch.zeros(1), "ids": torch.zeros(1, dtype=torch.long)})
        {'x': tensor([0.], dtype=torch.bfloat16), 'ids': tensor([0])}
        """
        if self.precision != "bf16":
            return inputs
        import torch
        from torch.utils._pytree import tree_map_only

        def cast(part: Any) -> Any:
            return tree_map_only(torch.Tensor, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t, part)

        if isinstance(inputs, dict):
            return {k: v if k in keep else cast(v) for k, v in inputs.items()}
        if isinstance(inputs, (tuple, list)):
            return type(inputs)(v if i in keep else cast(v) for i, v in enumerate(inputs))
        return cast(inputs)
