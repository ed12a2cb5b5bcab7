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

if TYPE_CHECKING:
    import torch

# Each vocabulary once: the request schema (estimator/request/spec.py) uses these aliases.
Precision = Literal["fp32", "amp-fp16", "amp-bf16", "bf16"]
OptimizerName = Literal["sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor"]
Checkpointing = bool | Literal["reentrant", "non-reentrant", "selective"]
ZeroGradAt = Literal["step-start", "after-forward"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
CHECKPOINTING = (False, True, "reentrant", "non-reentrant", "selective")
ZERO_GRAD_AT: tuple[str, ...] = get_args(ZeroGradAt)


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
