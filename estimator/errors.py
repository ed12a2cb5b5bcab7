"""batchfit's exception hierarchy.

    BatchfitError
    ├── SpecError              a request field has a bad value (carries ``field``)
    │   └── UnknownGPUError    a GPU name not in the catalog
    ├── SimulationError        the model could not be simulated (carries ``where``)
    │   ├── DataDependentError the model reads tensor values (``.item()``, ...)
    │   └── BatchTooSmallError batch norm needs more than one value per channel
    └── ReplayError            an event trace is malformed

Foreign exceptions are translated at one seam (``estimator.trace``) with
``raise ... from exc``; callers never match message text.
"""

from __future__ import annotations


class BatchfitError(Exception):
    """Base of every error batchfit raises on purpose."""


class SpecError(BatchfitError, ValueError):
    """A field of a request or recipe has a value batchfit cannot use.

    >>> str(SpecError("training.precision", "fp8", "one of fp32, amp-fp16, amp-bf16, bf16"))
    "training.precision: got 'fp8'; expected one of fp32, amp-fp16, amp-bf16, bf16"
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}: got {value!r}; expected {expected}")


class UnknownGPUError(SpecError):
    """A GPU name that is not in the catalog; ``suggestions`` holds close matches."""

    def __init__(self, field: str, value: object, suggestions: list[str]) -> None:
        self.suggestions = suggestions
        hint = f" (did you mean {', '.join(suggestions)}?)" if suggestions else ""
        super().__init__(field, value, f"a catalog GPU name{hint}; see `batchfit gpus`")


class SimulationError(BatchfitError, RuntimeError):
    """The training step failed while simulated; ``where`` names phase and module."""

    def __init__(self, message: str, where: str) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{message} (in {where})")


class DataDependentError(SimulationError):
    """The model reads a tensor's value, which fake tensors do not have."""


class BatchTooSmallError(SimulationError):
    """The batch cannot train at all: PyTorch's batch norm refuses one value per channel
    in training (``F.batch_norm``), on a GPU as on the CPU."""


class ReplayError(BatchfitError, ValueError):
    """An event trace given to the allocator replay is inconsistent."""
