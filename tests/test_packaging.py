"""The Dockerfile and docker-compose.yml, checked statically (no Docker engine on this machine)."""

from __future__ import annotations

from pathlib import Path

import yaml

TIER = "unit"

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_runs_as_non_root_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert any(line.startswith("HEALTHCHECK") for line in lines) and "/healthz" in text
    assert any(line.startswith("CMD") and "serve" in line for line in lines)
    # everything the package needs is copied before it is installed
    copied = " ".join(line for line in lines if line.startswith("COPY"))
    for path in ("pyproject.toml", "estimator", "app"):
        assert path in copied


def test_compose_service_redis_and_gpu_profile() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert services["batchfit"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["batchfit"]["environment"]["BATCHFIT_REDIS_URL"].startswith("redis://redis:")
    assert "healthcheck" in services["redis"]
    gpu = services["batchfit-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
