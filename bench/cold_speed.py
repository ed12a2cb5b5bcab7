"""Cold estimates, as a scheduler meets them: each request in a new process (as a service worker answers a
request its cache has not seen: the libraries imported and torch's lazy state set up by ``estimator.warm_up``, no
trace of this model yet), as a ratio to one real CPU training step of resnet50 at batch 32 measured in this run.

Prints, per case: the seconds of ``estimate`` in that process (imports excluded: a worker has them), the
full simulations it ran and the seconds with the imports; then each case's ratio to the median of the CPU steps
measured in the run (the median of three before the first case, then one after each: this host is shared and
its speed drifts)
and the aim.

    python bench/cold_speed.py [--only NAME] [--python-replay]

``--python-replay``: each case also with the allocator replay in Python (``BATCHFIT_NATIVE_REPLAY=0``), the
C replay's "before", measured in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from planner_speed import cpu_step_seconds

LLAMA = {"source": "transformers", "preset": "llama-3-8b"}
CASES = {
    # name: (request, aim as a ratio to the CPU step)
    "resnet50 on every card": ({"model": {"source": "torchvision", "name": "resnet50"}}, 0.1),
    "llama-3-8b s2048 on 2 cards, suggestions": ({
        "model": LLAMA, "input": {"seq_len": 2048}, "training": {"precision": "amp-bf16"},
        "gpus": ["A100-80GB", "H100-80GB"]}, 1.5),
    "llama-3-8b s8192, one FSDP rank of 8": ({
        "model": LLAMA, "input": {"seq_len": 8192}, "gpus": ["H100-80GB"], "batch_size": 1,
        "training": {"precision": "fp32", "gradient_checkpointing": "selective",
                     "distributed": {"strategy": "fsdp", "world_size": 8, "fsdp": {"param_dtype": "bf16"}}},
        "planner": {"suggestions": False, "curve_points": 0}}, 0.5),
    "fasterrcnn_mobilenet_v3_large_fpn on 5 cards": ({
        "model": {"source": "torchvision", "name": "fasterrcnn_mobilenet_v3_large_fpn"},
        "gpus": ["T4-16GB", "L4-24GB", "A10G-24GB", "A100-40GB", "A100-80GB"]}, 5.0),
}

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from estimator.pipeline import estimate
from estimator.request.parse import parse_request
from estimator import warm_up
warm_up()  # what a worker has done before its first request (app/worker.py), frozen as it does
import gc
gc.freeze()
t1 = time.perf_counter()
response = estimate(parse_request(json.loads(sys.argv[1])))
t2 = time.perf_counter()
print(json.dumps({"estimate_s": t2 - t1, "total_s": t2 - t0, "simulations": response.provenance.simulations,
                  "max": [r.max_batch_size for r in response.results]}))
"""


def cold(request: dict, python_replay: bool = False) -> dict:
    """One estimate in a new process; its own timings."""
    env = {**os.environ, "BATCHFIT_NATIVE_REPLAY": "0"} if python_replay else None
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(request)], capture_output=True, text=True,
                         check=True, env=env)
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    modes = [False, True] if "--python-replay" in sys.argv else [False]
    t0 = time.perf_counter()
    steps = [cpu_step_seconds()]
    print(f"real CPU step, resnet50 b32: {steps[0]:.2f} s (median of 3)")
    measured = []
    for name, (request, aim) in CASES.items():
        if only and only not in name:
            continue
        for python_replay in modes:
            got = cold(request, python_replay)
            steps.append(cpu_step_seconds(repeats=1))  # after each case: this host is shared, its speed drifts
            label = f"{name}, Python replay" if python_replay else name
            measured.append((label, aim, got))
            print(f"{label}: {got['estimate_s']:.1f} s, {got['simulations']} full simulations; with imports "
                  f"{got['total_s']:.1f} s; max {got['max']} (CPU step after it: {steps[-1]:.2f} s)")
    step = statistics.median(steps)
    print(f"ratios to the median CPU step of this run, {step:.2f} s ({len(steps)} measured, "
          f"{min(steps):.2f} to {max(steps):.2f} s):")
    for name, aim, got in measured:
        ratio = got["estimate_s"] / step
        print(f"  {name}: ratio {ratio:.2f} (aim <= {aim}: {'met' if ratio <= aim else 'NOT met'})")
    print(f"(bench wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
