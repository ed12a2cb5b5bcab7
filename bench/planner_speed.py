"""A full estimate for resnet50 on every catalog card, as a ratio to one real CPU training step.

Prints, measured in this run: the wall time of one real training step of
resnet50 at batch 32 on this machine's CPU (fp32, AdamW; the median of
three), the wall time of
``estimate`` for resnet50 (fp32, AdamW) on every card of the catalog for
each ``planner.confirm`` mode (``top``, the default: one full simulation
past the largest answer checks the affine trace; ``none``: the fit is
checked at a small batch; ``every-card``: full simulations at every card's
max and max + 1), their ratios to the CPU step (aim: below 0.5 for the
default), how many full simulations and allocator replays each needed, and
whether every mode gave the same answers.

    python bench/planner_speed.py [--skip-every-card]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision

from estimator.gpus import CATALOG
from estimator.pipeline import estimate
from estimator.request.parse import parse_request


def cpu_step_seconds(batch: int = 32, repeats: int = 3) -> float:
    """The median of ``repeats`` real training steps (this machine is shared: single runs vary by 30%)."""
    model = torchvision.models.resnet50()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(batch, 3, 224, 224), torch.zeros(batch, dtype=torch.long)
    F.cross_entropy(model(x), y).backward()  # warm-up: first-touch allocations, kernel selection
    opt.step()
    opt.zero_grad()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import estimator.plan.replays as replays_module

    replays = [0]
    counted = replays_module.replay_sized

    def counting(*args, **kwargs):
        replays[0] += 1
        return counted(*args, **kwargs)

    replays_module.replay_sized = counting
    request = parse_request({"model": {"source": "torchvision", "name": "resnet50"}})
    estimate(parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"]}),
             confirm="none")  # warm the process (imports, kernel registration), as a service worker is
    step = cpu_step_seconds()
    print(f"real CPU step, resnet50 b32: {step:.2f} s (median of 3)")
    modes = ["top", "none"] + ([] if "--skip-every-card" in sys.argv else ["every-card"])
    answers = {}
    for mode in modes:
        times = []
        for _ in range(3 if mode == "top" else 1):  # the first run meets resnet50's shapes for the first time
            replays[0] = 0
            t0 = time.perf_counter()
            response = estimate(request, confirm=mode)
            times.append(time.perf_counter() - t0)
        answers[mode] = [r.max_batch_size for r in response.results]
        dt = times[0]
        print(f"estimate on {len(CATALOG)} cards (confirm={mode}): {dt:.2f} s, ratio {dt / step:.2f} "
              f"(aim < 0.5), {response.provenance.simulations} full simulations, {replays[0]} replays")
        if len(times) > 1:
            again = statistics.median(times[1:])
            print(f"  again in the same process (the fake-tensor cache warm): {again:.2f} s, ratio {again / step:.2f}")
        if mode == "top":
            for r in response.results[:4]:
                print(f"  {r.gpu:<24} max {r.max_batch_size}  recommended {r.recommended_batch_size}  "
                      f"({r.search.method})")
    same = all(a == answers["top"] for a in answers.values())
    print(f"every mode gives the same max batch on every card: {same}")


if __name__ == "__main__":
    main()
