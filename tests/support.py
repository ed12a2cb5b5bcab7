"""Helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from estimator.models import BuiltModel, build
from estimator.request.adapt import job_of


def build_request(request: Any) -> BuiltModel:
    """The model of a parsed request, as the pipeline builds it."""
    job = job_of(request)
    return build(job.model, job.input)
