"""Validation: the comparison against recorded measurements, the no-GPU paths, the OOM path through a
stand-in measurement source, and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from estimator.errors import NoGPUError
from estimator.measure.cuda import Measurement, compare, cuda_available, validate
from estimator.request.parse import parse_request

pytestmark = pytest.mark.sim

GIB = 2**30
SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"],
         "planner": {"confirm": "none", "curve_points": 0}}


def test_compare_against_a_recorded_measurement() -> None:
    # recorded: 10.0 GiB allocated, 10.5 GiB reserved, 10.6 GiB used by the step + 0.5 GiB context
    measured = Measurement(64, allocated_peak_bytes=10 * GIB, reserved_peak_bytes=int(10.5 * GIB),
                           device_used_bytes=int(10.6 * GIB), context_bytes=GIB // 2, gpu="NVIDIA H200")
    predicted = {"allocated_peak_bytes": int(9.5 * GIB), "reserved_peak_bytes": int(10.5 * GIB),
                 "device_peak_bytes": int(11.0 * GIB)}
    v = compare(predicted, measured)
    assert v.errors["allocated_peak_bytes"] == pytest.approx(-0.05)        # 9.5 vs 10
    assert v.errors["reserved_peak_bytes"] == pytest.approx(0.0)
    assert v.errors["device_peak_bytes"] == pytest.approx(11.0 / 11.1 - 1)  # vs 10.6 + 0.5


class StandIn:
    """A measurement source that answers as a GPU would (or runs out of memory)."""

    def __init__(self, oom: bool) -> None:
        self.oom, self.calls = oom, []

    def measure(self, request_json, batch_size) -> Measurement:
        self.calls.append(batch_size)
        if self.oom:
            return Measurement(batch_size, allocated_peak_bytes=15 * GIB, reserved_peak_bytes=15 * GIB, oom=True,
                               error="out of memory: CUDA out of memory. Tried to allocate 2.00 GiB")
        return Measurement(batch_size, allocated_peak_bytes=GIB, reserved_peak_bytes=GIB + GIB // 8)


def test_validate_runs_at_the_predicted_max() -> None:
    source = StandIn(oom=False)
    response, v = validate(parse_request(SMALL), source=source)
    assert source.calls == [response.results[0].max_batch_size]
    assert v.predicted["allocated_peak_bytes"] == response.results[0].memory.allocated_peak_bytes
    assert v.errors["allocated_peak_bytes"] is not None and v.errors["device_peak_bytes"] is None  # no NVML


def test_out_of_memory_is_reported_not_raised() -> None:
    response, v = validate(parse_request(SMALL), source=StandIn(oom=True), batch_size=64)
    assert v.measured.oom and "out of memory" in v.measured.error
    assert response.results[0].memory.batch_size == 64


@pytest.mark.service
@pytest.mark.skipif(cuda_available(), reason="this checks the machine without a GPU")
def test_no_gpu_library_service_and_cli(tmp_path) -> None:
    with pytest.raises(NoGPUError):
        validate(parse_request(SMALL))
    app = create_app(Settings(workers=1, cache_path=""))
    with TestClient(app) as c:
        r = c.post("/estimate", json={**SMALL, "validate": True})
        assert r.status_code == 503 and r.json()["type"].endswith("/no-gpu")
        assert "no CUDA GPU" in r.json()["detail"]
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps(SMALL))
    exe = str(Path(sys.executable).with_name("batchfit"))
    proc = subprocess.run([exe, "validate", "--spec", str(spec)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 4
    assert proc.stderr.strip() == f"error: {NoGPUError()}"


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_a_real_step_on_this_gpu_meets_the_prediction() -> None:
    """Real CUDA steps (a subprocess) of the small request at batch 64 on this machine's card: no out of
    memory, and the peaks within 10 % of the prediction for that card."""
    response, v = validate(parse_request({k: v for k, v in SMALL.items() if k != "gpus"}), batch_size=64)
    assert not v.measured.oom and v.measured.error is None, v.measured.error
    assert v.measured.batch_size == response.results[0].memory.batch_size == 64
    for name in ("allocated_peak_bytes", "reserved_peak_bytes"):
        assert abs(v.errors[name]) <= 0.10, (name, v.errors[name])


def test_cli_bad_spec_exits_2(tmp_path) -> None:
    from estimator.cli.main import main

    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({"model": {"source": "torchvision", "name": "resnet5"}}))
    assert main(["validate", "--spec", str(spec)]) == 2


def test_gpu_accuracy_harness_on_this_machine() -> None:
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu_accuracy.py"
    run = lambda *a: subprocess.run([sys.executable, str(bench), *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    help_ = run("--help")
    assert help_.returncode == 0 and "--cpu-selfcheck" in help_.stdout and "--out" in help_.stdout
    check = run("--cpu-selfcheck")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "worst error 0.0" in check.stdout
    if not cuda_available():
        assert run().returncode == 4  # the GPU suite refuses to run without a GPU


def test_gpu_accuracy_suite_covers_every_family_and_recipe() -> None:
    from estimator.measure.cases import CASES, MAX_BATCH_CASES

    assert len(CASES) >= 20 and len(MAX_BATCH_CASES) == 5
    names = " ".join(name for name, _, _ in CASES)
    for needle in ("resnet50", "vit_b_16", "vit_l_16", "convnext", "efficientnet", "bert-base", "bert-large",
                   "gpt2 ", "gpt2-medium", "llama-1b", "fp32", "amp-bf16", "amp-fp16", "bf16", "sgd", "ckpt",
                   " lora", "qlora", "llm.int8", "adamw8bit", "paged_adamw8bit"):
        assert needle in names, needle
    for _, _, req in CASES:
        parse_request(req)  # every case is a valid request
