"""What the command line prints: the per-card table of an answer, the by-module table, the catalog.

>>> print_answer(response)                                                  # doctest: +SKIP
gpu            memory GiB  max batch  recommended  dev peak @max GiB  dev peak @rec GiB  fits
A100-80GB            80.0        410          408              78.70              70.95   yes

Missing values print as ``-``; the columns for a requested ``batch_size``, world sizes, step and epoch time,
accumulation and learning rate appear only when an answer has them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

GIB = 2**30


def _or_dash(value: Any, fmt: Callable[[Any], str] = str) -> str:
    return "-" if value is None else fmt(value)


def _peak(m: Any) -> str:
    return _or_dash(m, lambda x: f"{x.device_peak_bytes / GIB:.2f}")


def print_answer(r: Any, asked_batch: int | None = None) -> None:
    """One row per card: max and recommended batch and their device peaks; the columns an answer fills."""
    rows = r.results
    width = max([len("gpu"), *(len(g.gpu) for g in rows)]) + 2
    columns: list[tuple[str, Callable[[Any], str]]] = [
        ("memory GiB", lambda g: f"{g.capacity_bytes / GIB:.1f}"),
        ("max batch", lambda g: _or_dash(g.max_batch_size)),
        ("recommended", lambda g: _or_dash(g.recommended_batch_size)),
        ("dev peak @max GiB", lambda g: _peak(g.max_memory)),
        ("dev peak @rec GiB", lambda g: _peak(g.recommended_memory)),
    ]
    if asked_batch is not None:
        columns.append((f"dev peak @{asked_batch} GiB", lambda g: _peak(g.memory)))
    if any(g.world_size > 1 or g.min_world_size is not None for g in rows):
        columns += [("ranks", lambda g: str(g.world_size)), ("global batch", lambda g: _or_dash(g.global_batch_size))]
    if any(g.step_seconds is not None for g in rows):
        columns.append(("step s @rec", lambda g: _or_dash(g.step_seconds, lambda s: f"{s:.3f}")))
    if any(g.epoch_seconds is not None for g in rows):
        columns.append(("epoch s @rec", lambda g: _or_dash(g.epoch_seconds, lambda s: f"{s:.0f}")))
    if any(g.accumulation is not None for g in rows):
        columns.append(("micro x steps x ranks", lambda g: _or_dash(
            g.accumulation, lambda a: f"{a.micro_batch} x {a.steps} x {a.ranks} = {a.global_batch}")))
    if any(g.learning_rate is not None for g in rows):
        columns.append(("lr", lambda g: _or_dash(g.learning_rate, lambda lr: f"{lr.lr:.3g}")))
    columns.append(("fits", lambda g: "yes" if g.memory.fits else "NO"))
    print(f"{'gpu':<{width}}" + " ".join(f"{name:>{max(len(name), 5)}}" for name, _ in columns))
    for g in rows:
        print(f"{g.gpu:<{width}}" + " ".join(f"{cell(g):>{max(len(name), 5)}}" for name, cell in columns))
    if any(g.world_size > 1 for g in rows):
        print("batch sizes are per rank (micro-batches); global batch = recommended x ranks x accumulation steps")
    for g in rows:
        for s in g.suggestions:
            per = " per rank" if s.world_size > 1 else ""
            print(f"{g.gpu}: a batch is recommended with {s.description} (max {_or_dash(s.max_batch_size)}, "
                  f"recommended {_or_dash(s.recommended_batch_size)}{per}): {json.dumps(s.change)}")
    lr = next((g.learning_rate for g in rows if g.learning_rate is not None), None)
    if lr is not None:
        print(f"\nlearning rate: {lr.rule} scaling; {lr.why}; warm-up: {lr.warmup}")
    b = r.breakdown
    print(f"\nat the peak (batch {b.batch_size}, first card), GiB: parameters {b.parameters / GIB:.2f}, "
          f"gradients {b.gradients / GIB:.2f}, optimizer state {b.optimizer_state / GIB:.2f}, "
          f"activations {b.activations / GIB:.2f}, temporaries {b.temporaries / GIB:.2f}, inputs {b.inputs / GIB:.2f}, "
          f"workspace {b.workspace / GIB:.2f}")
    print(f"per sample {r.per_sample_bytes / 2**20:.1f} MiB, fixed {r.fixed_bytes / GIB:.2f} GiB, "
          f"{r.parameter_count:,} parameters, {r.provenance.simulations} simulations in {r.provenance.seconds:.1f} s")
    for line in r.assumptions:
        print(f"  assumed: {line}")
    for note in r.warnings:
        print(f"  warning: {note.message}")


def print_modules(mb: Any, report: Any, top: int) -> None:
    """The top modules by activation and parameter bytes at the peak, in fvcore's table style."""
    from estimator.replay.modules import format_table, not_in_columns

    where = f"{report.peak_phase}, module {report.peak_module}" if report.peak_module else report.peak_phase
    print(f"\nby module at the peak (batch {report.batch_size} on {report.gpu}, {where}): the {top} modules "
          "holding the most activation and the most parameter bytes, and the modules they are in")
    print(format_table(mb, top))
    print("a row counts its submodules; the model row is every byte live at the peak (what runs outside any "
          "module, as the loss and the optimizer step, counts there only); bytes are allocator blocks")
    rest = not_in_columns(mb)
    if rest:
        print(f"not by module: {rest}")


def print_catalog() -> None:
    from estimator.gpus import CATALOG

    print(f"{'name':<24} {'memory (MiB)':>12} {'cc':>4} {'context (MiB)':>13}  also (GFD product labels, MIG resource)")
    for g in CATALOG.values():
        also = ", ".join([*g.aliases, *([g.mig_resource] if g.mig_resource else [])])
        print(f"{g.name:<24} {g.memory_bytes // 2**20:>12} {g.compute_capability:>4} {g.context_bytes // 2**20:>13}  "
              f"{also}")


def print_validation(v: Any) -> None:
    m = v.measured
    print(f"{m.gpu} (driver {m.driver}, torch {m.torch}, CUDA {m.cuda}), batch {m.batch_size}, "
          f"measured context {m.context_bytes / 2**20:.0f} MiB")
    for name, predicted in v.predicted.items():
        err = v.errors.get(name)
        real = {"allocated_peak_bytes": m.allocated_peak_bytes, "reserved_peak_bytes": m.reserved_peak_bytes,
                "device_peak_bytes": m.device_used_bytes + m.context_bytes}[name]
        print(f"  {name:<22} predicted {predicted / GIB:8.2f} GiB  measured {real / GIB:8.2f} GiB  "
              f"error {'n/a' if err is None else f'{err:+.1%}'}")
