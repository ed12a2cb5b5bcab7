"""batchfit's accuracy on a real GPU: predicted vs measured peaks over a suite of training steps.

    python bench/gpu_accuracy.py --out bench/RESULTS-h200.md      # on a CUDA machine (about 8 min on an H200)
    python bench/gpu_accuracy.py --cpu-selfcheck                  # anywhere: CPU-target predictions vs real CPU steps

For each of the 30 cases below: the prediction for this machine's card at
the case's batch, and one real step measured in a subprocess
(estimator.measure.cuda: 3 iterations, max_memory_allocated/reserved, NVML used
minus the pre-model baseline plus the measured context). Then for 5 cases
the real max batch, bisected on the GPU around the prediction, vs the
predicted max. Then the median and max absolute errors per field.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from estimator.measure.cases import CASES, MAX_BATCH_CASES  # the suite, shared with its test

FIELDS = ("allocated_peak_bytes", "reserved_peak_bytes", "device_peak_bytes")
GIB = 2**30


def _gpu_suite(out: str | None, budget_s: float) -> int:
    from estimator.measure.cuda import CudaSubprocess, cuda_available, local_card, validate
    from estimator.request.parse import parse_request

    if not cuda_available():
        print("error: no CUDA GPU is available on this machine (use --cpu-selfcheck here)", file=sys.stderr)
        return 4
    t0, card, source = time.time(), local_card(), CudaSubprocess()
    rows, errors = [], {f: [] for f in FIELDS}
    lines = ["| case | batch | " + " | ".join(f"{f.split('_')[0]} pred / meas GiB (err)" for f in FIELDS) + " |",
             "|---|---|---|---|---|"]
    for name, batch, req in CASES:
        request = parse_request({**req, "gpus": [card if isinstance(card, str) else card.model_dump()]})
        _, v = validate(request, source=source, batch_size=batch)
        m = v.measured
        measured = {"allocated_peak_bytes": m.allocated_peak_bytes, "reserved_peak_bytes": m.reserved_peak_bytes,
                    "device_peak_bytes": m.device_used_bytes + m.context_bytes}
        cells = []
        for f in FIELDS:
            err = v.errors.get(f)
            if err is not None and not m.oom:
                errors[f].append(abs(err))
            cells.append(f"{v.predicted[f] / GIB:.2f} / {measured[f] / GIB:.2f} "
                         f"({'n/a' if err is None else f'{err:+.1%}'}{', OOM' if m.oom else ''})")
        lines.append(f"| {name} | {batch} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        rows.append((name, v))
    lines += ["", "| case | predicted max | real max (bisected) |", "|---|---|---|"]
    for name, _, req in (c for c in CASES if c[0] in MAX_BATCH_CASES):
        if time.time() - t0 > budget_s:
            lines.append(f"| {name} | (skipped: time budget {budget_s:.0f} s spent) | |")
            continue
        request = parse_request({**req, "gpus": [card if isinstance(card, str) else card.model_dump()]})
        from estimator.pipeline import estimate

        predicted = estimate(request).results[0].max_batch_size or 1
        real = _bisect_real_max(source, request.model_dump(mode="json"), predicted)
        lines.append(f"| {name} | {predicted} | {real} |")
        print(lines[-1], flush=True)
    lines += ["", "| field | median abs error | max abs error |", "|---|---|---|"]
    for f in FIELDS:
        xs = errors[f]
        lines.append(f"| {f} | {statistics.median(xs):.1%} | {max(xs):.1%} |" if xs else f"| {f} | n/a | n/a |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        import torch

        m = rows[0][1].measured
        header = (f"# batchfit on {m.gpu}\n\n{time.strftime('%Y-%m-%d')}, driver {m.driver}, "
                  f"torch {torch.__version__}, "
                  f"CUDA {m.cuda}, measured context {m.context_bytes / 2**20:.0f} MiB\n\n")
        with open(out, "w") as f:
            f.write(header + text)
    return 0


def _bisect_real_max(source, request_json: dict, predicted: int, probes: int = 5) -> str:
    """The largest batch that runs, bisected in [0.8, 1.25] x the prediction (at most ``probes`` runs)."""
    lo, hi = max(1, int(predicted * 0.8)), int(predicted * 1.25) + 1
    ok_lo = not source.measure(request_json, lo).oom
    if not ok_lo:
        return f"< {lo}"
    if not source.measure(request_json, hi).oom:
        return f">= {hi}"
    for _ in range(probes - 2):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if source.measure(request_json, mid).oom:
            hi = mid
        else:
            lo = mid
    return str(lo) if hi - lo <= 1 else f"{lo}..{hi - 1}"


def _cpu_selfcheck() -> int:
    """CPU-target predictions vs real CPU steps (peak live bytes from torch.profiler) on two small cases.

    The cases and the measurement are the test suite's (estimator/testing: zoo.py, cpu_truth.py).
    """
    from estimator.measure.cpu import BATCH, real_cpu_peak
    from estimator.pipeline import estimate_memory
    from estimator.simulate.recipe import Recipe
    from estimator.testing.zoo import ZOO

    worst = 0.0
    for name in ("mlp", "conv"):
        recipe = Recipe(optimizer="adamw")
        mf, bf, lf = ZOO[name]
        predicted = estimate_memory(mf, bf, lf, BATCH, recipe=recipe, gpu=None).allocated_peak_bytes
        measured = real_cpu_peak(name, recipe)
        err = (predicted - measured) / measured
        worst = max(worst, abs(err))
        print(f"{name:<6} predicted {predicted:>10,} B  measured {measured:>10,} B  error {err:+.2%}")
    print(f"worst error {worst:.2%} (the self-check passes under 1%)")
    return 0 if worst < 0.01 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results table (markdown) here")
    parser.add_argument("--cpu-selfcheck", action="store_true",
                        help="no GPU needed: CPU-target predictions vs real CPU steps on two small cases")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stop starting max-batch bisections after this many seconds (default 420)")
    args = parser.parse_args(argv)
    if args.cpu_selfcheck:
        return _cpu_selfcheck()
    return _gpu_suite(args.out, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
