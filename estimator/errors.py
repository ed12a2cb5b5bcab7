"""batchfit's exception hierarchy.

    BatchfitError
    ├── SpecError              a request field has a bad value (carries ``field``)
    │   └── UnknownGPUError    a GPU name not in the catalog
    ├── SimulationError        the model could not be simulated (carries ``where``)
    │   ├── DataDependentError the model reads tensor values (``.item()``, ...)
    │   └── BatchTooSmallError batch norm needs more than one value per channel
    ├── ReplayError            an event trace is malformed
    ├── NoGPUError             a validation needs a CUDA GPU and this machine has none
    ├── MissingExtraError      a feature needs an optional extra that is not installed (carries ``extra``)
    └── ServiceError           the HTTP service would not or could not answer
        ├── Unauthorized       no API key, or a wrong one
        ├── Busy               every worker busy and the queue full
        ├── WorkerDied         the worker running an estimate died (a signal, the OOM killer, a crash)
        ├── LimitExceeded      an estimate ran past a limit of the service (carries ``limit``)
        ├── NotStored          a stored profile the service does not have (carries ``field``, ``value``)
        └── StoreUnavailable   the profile store cannot be read or written now

Foreign exceptions are translated at one seam (``estimator.simulate.record``)
with ``raise ... from exc``; callers never match message text. Each error
knows its fields (``fields()``), so it crosses a process boundary as data
and is rebuilt there (``from_fields``), and the service maps each type to
one HTTP status (``app/errors.py``).
"""

from __future__ import annotations

from typing import Any


class BatchfitError(Exception):
    """Base of every error batchfit raises on purpose."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)

    def fields(self) -> dict[str, Any]:
        """The arguments that rebuild this error (``type(self)(**fields)``)."""
        return {"message": str(self)}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> BatchfitError:
        return cls(**fields)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.fields())


def _rebuild(cls: type[BatchfitError], fields: dict[str, Any]) -> BatchfitError:
    return cls.from_fields(fields)


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

    def fields(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value, "expected": self.expected}


class UnknownGPUError(SpecError):
    """A GPU name that is not in the catalog; ``suggestions`` holds close matches."""

    def __init__(self, field: str, value: object, suggestions: list[str]) -> None:
        self.suggestions = suggestions
        hint = f" (did you mean {', '.join(suggestions)}?)" if suggestions else ""
        super().__init__(field, value, f"a catalog GPU name{hint}; see `batchfit gpus` or GET /gpus; or a card "
                         'of your own: {"name": "my-card", "memory_bytes": <bytes nvidia-smi reports>, '
                         '"compute_capability": "8.0"}')

    def fields(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value, "suggestions": self.suggestions}


class SimulationError(BatchfitError, RuntimeError):
    """The training step failed while simulated; ``where`` names phase and module."""

    def __init__(self, message: str, where: str) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{message} (in {where})")

    def fields(self) -> dict[str, Any]:
        return {"message": self.message, "where": self.where}


class DataDependentError(SimulationError):
    """The model reads a tensor's value, which fake tensors do not have."""


class BatchTooSmallError(SimulationError):
    """The batch cannot train at all: PyTorch's batch norm refuses one value per channel
    in training (``F.batch_norm``), on a GPU as on the CPU."""


class ReplayError(BatchfitError, ValueError):
    """An event trace given to the allocator replay is inconsistent."""


class NoGPUError(BatchfitError, RuntimeError):
    """No CUDA GPU on this machine: a validation cannot run."""

    def __init__(self, message: str = "no CUDA GPU is available on this machine: validation needs one") -> None:
        super().__init__(message)


class MissingExtraError(BatchfitError, ImportError):
    """A feature needs one of batchfit's optional extras (``service``, ``plot``, ``gpu``), not installed.

    >>> str(MissingExtraError("plot", "drawing the memory timeline", "No module named 'matplotlib'"))
    "drawing the memory timeline needs the plot extra: pip install 'batchfit[plot]' (No module named 'matplotlib')"
    """

    def __init__(self, extra: str, feature: str, cause: str) -> None:
        self.extra, self.feature, self.cause = extra, feature, cause
        super().__init__(f"{feature} needs the {extra} extra: pip install 'batchfit[{extra}]' ({cause})")

    def fields(self) -> dict[str, Any]:
        return {"extra": self.extra, "feature": self.feature, "cause": self.cause}


class ServiceError(BatchfitError):
    """The HTTP service would not or could not answer a request."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class Unauthorized(ServiceError):
    """No API key, or one the service does not know."""


class Busy(ServiceError):
    """Every worker is busy and the queue is full."""

    def __init__(self, message: str = "every worker is busy and the queue is full") -> None:
        super().__init__(message)


class WorkerDied(ServiceError):
    """The worker process running an estimate died (killed by a signal or the OOM killer, or crashed); it was
    replaced, and the same request may succeed when retried."""


class LimitExceeded(ServiceError):
    """A worker ran past a limit and was replaced; ``limit`` is 'time' or 'memory'."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        super().__init__(message)

    def fields(self) -> dict[str, Any]:
        return {"limit": self.limit, "message": str(self)}


class NotStored(ServiceError):
    """A profile id the service does not have (never stored, or evicted): ``field`` names where it came from.

    >>> str(NotStored("profile", "sha256:00"))
    "profile: no stored profile 'sha256:00' (POST /profiles it first: it may have been evicted)"
    """

    def __init__(self, field: str, value: str) -> None:
        self.field, self.value = field, value
        super().__init__(f"{field}: no stored profile {value!r} (POST /profiles it first: it may have been evicted)")

    def fields(self) -> dict[str, Any]:
        return {"field": self.field, "value": self.value}


class StoreUnavailable(ServiceError):
    """The profile store (the service's cache backend) cannot be read or written now; retry later."""
