"""One request's walk through the layers (bench/hop_trace.py): it goes down, and climbs back up only where a
layer calls what was handed to it (the planner asking its step source, a model's code running the recorder's
hooks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parents[1]


def test_one_request_crosses_upward_at_most_four_times() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "hop_trace.py"), "--json"], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env={**os.environ, "BATCHFIT_PARALLEL": "0"})
    assert out.returncode == 0, out.stderr
    hops = json.loads(out.stdout)
    assert hops["max"] == [3790, 680]  # resnet18 on A100-80GB and T4-16GB, as recorded before the move
    # the planner asking its step source (signature, trace -> simulate, prefetch -> speculate) and the model's
    # code running the recorder's hooks
    assert len(hops["upward"]) <= 4, hops["upward"]
    assert len(hops["crossings"]) > len(hops["upward"])  # the trace saw the walk down too
