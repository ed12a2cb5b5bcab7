"""How a model is trained: precision, optimizer, checkpointing, accumulation.

>>> Recipe(precision="amp-bf16", optimizer="adamw").autocast_dtype
torch.bfloat16
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from estimator.errors import SpecError

PRECISIONS = ("fp32", "amp-fp16", "amp-bf16", "bf16")
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor")
CHECKPOINTING = (False, True, "reentrant", "non-reentrant")


@dataclass(frozen=True)
class Recipe:
    """The training recipe; ``None`` optimizer options mean PyTorch's default on the target.

    ``gradient_checkpointing``: ``False``, ``True`` (non-reentrant, the
    torch.utils.checkpoint default), ``"reentrant"`` or ``"non-reentrant"``.
    """

    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool | str = False
    grad_accumulation_steps: int = 1
    zero_grad_set_to_none: bool = True
    iterations: int = 2

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SpecError("training.precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError("training.optimizer.name", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        if self.gradient_checkpointing not in CHECKPOINTING:
            raise SpecError(
                "training.gradient_checkpointing", self.gradient_checkpointing,
                "false, true, 'reentrant' or 'non-reentrant'",
            )
        if not isinstance(self.grad_accumulation_steps, int) or self.grad_accumulation_steps < 1:
            raise SpecError("training.grad_accumulation_steps", self.grad_accumulation_steps, "an integer >= 1")
        if not isinstance(self.iterations, int) or self.iterations < 2:
            # Optimizer state appears in the first step, the steady peak in the second.
            raise SpecError("training.iterations", self.iterations, "an integer >= 2")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}.get(self.precision)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def uses_grad_scaler(self) -> bool:
        return self.precision == "amp-fp16"
