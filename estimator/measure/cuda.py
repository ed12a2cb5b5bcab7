"""One real CUDA training step, measured, compared with the prediction.

>>> response, validation = validate(request)                             # doctest: +SKIP
>>> validation.errors["allocated_peak_bytes"]                            # measured vs predicted

The step runs in a subprocess (``python -m estimator.measure.cuda``), so an
out-of-memory error or a crashed driver leaves the caller healthy: the model
is built for real (random init, no downloads), the request's recipe runs for
3 iterations at the batch, and the child reports
``torch.cuda.max_memory_allocated()``, ``max_memory_reserved()`` and the
device's used memory through NVML, against a baseline taken before the model
was built (after CUDA was initialized: that difference is the context).
Sources of measurements are pluggable (``MeasurementSource``) so the logic
is tested without a GPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from estimator.errors import MissingExtraError, NoGPUError

ITERATIONS = 3


@dataclass
class Measurement:
    """What one real step used; ``oom`` when it ran out of memory (then the peaks are what it reached)."""

    batch_size: int
    allocated_peak_bytes: int = 0
    reserved_peak_bytes: int = 0
    device_used_bytes: int = 0     # NVML used during the step minus before the model (the process's share)
    context_bytes: int = 0         # NVML used after CUDA init minus before it
    gpu: str = ""
    driver: str = ""
    torch: str = ""
    cuda: str = ""
    oom: bool = False
    error: str | None = None


@dataclass
class Validation:
    """Measured values and relative errors ``(predicted - measured) / measured`` per field."""

    measured: Measurement
    predicted: dict[str, int]
    errors: dict[str, float | None] = field(default_factory=dict)


class MeasurementSource(Protocol):
    def measure(self, request_json: dict[str, Any], batch_size: int) -> Measurement: ...


def compare(predicted: dict[str, int], measured: Measurement) -> Validation:
    """Relative error for each predicted field that has a measured counterpart.

    ``device_peak_bytes`` is compared with NVML's used memory plus the
    measured context (what nvidia-smi shows for the process).
    """
    pairs = {
        "allocated_peak_bytes": measured.allocated_peak_bytes,
        "reserved_peak_bytes": measured.reserved_peak_bytes,
        "device_peak_bytes": measured.device_used_bytes + measured.context_bytes
        if measured.device_used_bytes else 0,
    }
    errors: dict[str, float | None] = {}
    for name, real in pairs.items():
        guess = predicted.get(name)
        errors[name] = None if not real or guess is None else (guess - real) / real
    return Validation(measured, dict(predicted), errors)


def _pynvml():
    """NVML's bindings; nvidia-ml-py is the ``gpu`` extra, not a core dependency."""
    try:
        import pynvml
    except ModuleNotFoundError as exc:
        raise MissingExtraError("gpu", 'validating on a GPU (batchfit validate, "validate": true)', str(exc)) from exc
    return pynvml


def cuda_available() -> bool:
    import torch

    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


class CudaSubprocess:
    """Measures in a child process on this machine's first GPU."""

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s = timeout_s

    def measure(self, request_json: dict[str, Any], batch_size: int) -> Measurement:
        if not cuda_available():
            raise NoGPUError()
        proc = subprocess.run([sys.executable, "-m", "estimator.measure.cuda"], input=json.dumps(
            {"request": request_json, "batch_size": batch_size}), capture_output=True, text=True,
            timeout=self.timeout_s)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            return Measurement(batch_size, error=f"the measuring process failed (exit {proc.returncode}): "
                                                 f"{proc.stderr.strip()[-500:]}")
        return Measurement(**json.loads(lines[-1]))


def validate(request, source: MeasurementSource | None = None, batch_size: int | None = None):
    """Estimate ``request``, run one real step at ``batch_size`` (default: the first card's max), compare.

    Returns ``(EstimateResponse, Validation)``; raises ``NoGPUError`` without a GPU.
    """
    from estimator.models import build
    from estimator.pipeline import estimate
    from estimator.request.adapt import job_of

    job = job_of(request)
    build(job.model, job.input)  # a bad request fails as a bad request first, GPU or not
    source = source or CudaSubprocess()
    if isinstance(source, CudaSubprocess):
        if not cuda_available():
            raise NoGPUError()
        _pynvml()  # the measuring child needs NVML: say so before the estimate, not after it
        if request.gpus is None:  # predict for the card that will measure
            request = request.model_copy(update={"gpus": [local_card()]})
    response = estimate(request)
    first = response.results[0]
    batch = batch_size or request.batch_size or first.max_batch_size or first.min_batch_size
    if batch != first.memory.batch_size:
        from estimator.request.parse import parse_request

        again = parse_request({**request.model_dump(mode="json"), "batch_size": batch})
        response = estimate(again)
        first = response.results[0]
    predicted = {k: getattr(first.memory, k) for k in ("allocated_peak_bytes", "reserved_peak_bytes",
                                                        "device_peak_bytes")}
    measured = source.measure(request.model_dump(mode="json"), batch)
    return response, compare(predicted, measured)


def local_card():
    """This machine's first GPU: its catalog entry when one matches, else a custom card from NVML."""
    import torch

    from estimator.gpus import CATALOG
    from estimator.request.spec import CustomGPUSpec

    pynvml = _pynvml()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    name = pynvml.nvmlDeviceGetName(handle)
    name = name if isinstance(name, str) else name.decode()
    capability = torch.cuda.get_device_capability(0)
    for card in CATALOG.values():
        if card.memory_bytes == total and card.capability == capability and card.description in name:
            return card.name
    # not a catalog card's name or description, and plain text (the custom-name rule: estimator/gpus.py)
    local = re.sub(r"[^A-Za-z0-9 ._()+-]", " ", f"local {name}")[:64]
    return CustomGPUSpec(name=local, memory_bytes=total, compute_capability=f"{capability[0]}.{capability[1]}")


def as_json(v: Validation) -> dict[str, Any]:
    return {"measured": asdict(v.measured), "predicted": v.predicted, "errors": v.errors}


# --- the child process --------------------------------------------------------

def _nvml_used() -> tuple[int, str, str]:
    pynvml = _pynvml()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    name = pynvml.nvmlDeviceGetName(handle)
    driver = pynvml.nvmlSystemGetDriverVersion()
    name = name if isinstance(name, str) else name.decode()
    return used, name, driver if isinstance(driver, str) else driver.decode()


def _child(doc: dict[str, Any]) -> Measurement:
    import dataclasses

    import torch

    from estimator.models import build
    from estimator.models.meta import build_on_meta
    from estimator.request.adapt import job_of
    from estimator.request.parse import parse_request
    from estimator.simulate.step import StepHooks, cast_model, prepare, run_steps
    from estimator.simulate.virtual_gpu.bnb import materialize_real, quantized_layers

    request = parse_request(doc["request"])
    batch = int(doc["batch_size"])
    before_init, gpu, driver = _nvml_used()
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context and torch's kernels, as the catalog's context_bytes counts them
    torch.cuda.synchronize()
    baseline, _, _ = _nvml_used()
    m = Measurement(batch, gpu=gpu, driver=driver, torch=torch.__version__, cuda=str(torch.version.cuda),
                    context_bytes=baseline - before_init)
    torch.cuda.reset_peak_memory_stats()
    job = job_of(request)
    built = build(job.model, job.input)
    recipe = dataclasses.replace(job.recipe, iterations=ITERATIONS)
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
    class Measuring(StepHooks):
        """The real loop, reading NVML's used memory after each iteration."""

        peak_used = 0

        def iteration_end(self, iteration: int) -> None:
            torch.cuda.synchronize()
            self.peak_used = max(self.peak_used, _nvml_used()[0])

    device = torch.device("cuda")
    measuring = Measuring(device)
    try:
        meta = build_on_meta(built.factory)
        if quantized_layers(meta):  # bitsandbytes quantizes on the device, layer by layer, after the cast
            model = materialize_real(cast_model(meta, recipe), device)
        else:
            with device:
                model = cast_model(built.factory(), recipe)
        # the loop the simulation runs (estimator/simulate/step.py), for real
        run_steps(prepare(model, recipe, device), built.batch_factory, built.loss_fn, batch, recipe,
                  device, hooks=measuring)
        peak_used = measuring.peak_used
    except torch.cuda.OutOfMemoryError as exc:
        m.oom, m.error = True, f"out of memory: {str(exc).splitlines()[0]}"
        peak_used = _nvml_used()[0]
    m.allocated_peak_bytes = torch.cuda.max_memory_allocated()
    m.reserved_peak_bytes = torch.cuda.max_memory_reserved()
    m.device_used_bytes = peak_used - baseline
    return m


if __name__ == "__main__":
    measurement = _child(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(asdict(measurement)) + "\n")
