"""The hop trace of one request: every call that crosses from one layer of estimator/ to another, and those
that cross upward against tests/test_layers.py's reading order.

    BATCHFIT_PARALLEL=0 python bench/hop_trace.py          # the crossings, upward ones marked
    BATCHFIT_PARALLEL=0 python bench/hop_trace.py --json   # {"max": [...], "crossings": [...], "upward": [...]}

resnet18 on A100-80GB and T4-16GB, integer world size, ``confirm: top``. A profiler hook logs each call
whose caller (the nearest frame in estimator/ or app/) sits in another room (a folder of estimator/, or a
loose module); the virtual GPU's dispatch of ops from model code is left out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = str(REPO) + os.sep


def _layers():
    spec = importlib.util.spec_from_file_location("test_layers", REPO / "tests" / "test_layers.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module._layer


def room(filename: str) -> str:
    parts = os.path.relpath(filename, ROOT)[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts[:2]) if parts[0] == "estimator" else parts[0]


def mine(filename: str) -> bool:
    return filename.startswith((ROOT + "estimator" + os.sep, ROOT + "app" + os.sep))


def trace() -> tuple[list[tuple[str, str, str, str]], list[int | None]]:
    sys.path.insert(0, str(REPO))
    from estimator import estimate, parse_request

    seen: set[tuple[str, str, str, str]] = set()
    hops: list[tuple[str, str, str, str]] = []

    def prof(frame, event, arg):  # noqa: ANN001, ANN202  sys.setprofile's signature
        if event != "call" or not mine(frame.f_code.co_filename):
            return
        caller = frame.f_back
        while caller is not None and not mine(caller.f_code.co_filename):
            caller = caller.f_back
        if caller is None:
            return
        a, b = room(caller.f_code.co_filename), room(frame.f_code.co_filename)
        key = (a, caller.f_code.co_name, b, frame.f_code.co_name)
        if a != b and key not in seen and not ("virtual_gpu" in frame.f_code.co_filename and "simulate" not in a):
            seen.add(key)
            hops.append(key)

    request = parse_request({"model": {"source": "torchvision", "name": "resnet18"},
                             "gpus": ["A100-80GB", "T4-16GB"]})
    sys.setprofile(prof)
    try:
        response = estimate(request)
    finally:
        sys.setprofile(None)
    return hops, [r.max_batch_size for r in response.results]


def main() -> None:
    layer = _layers()
    hops, best = trace()
    upward = [h for h in hops if layer(h[2]) < layer(h[0])]
    if "--json" in sys.argv:
        print(json.dumps({"max": best, "crossings": [list(h) for h in hops], "upward": [list(h) for h in upward]}))
        return
    for h in hops:
        print(("UP  " if h in upward else "    ") + f"{h[0]}.{h[1]} -> {h[2]}.{h[3]}")
    print(f"{len(hops)} crossings, {len(upward)} upward; max {best}")


if __name__ == "__main__":
    main()
