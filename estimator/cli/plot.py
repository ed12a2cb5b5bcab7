"""The memory timeline of one training step, stacked by category, phases marked.

>>> draw_timeline(events, phases, "resnet50 b681 on T4-16GB", "step.png")   # doctest: +SKIP

``events`` are the allocator events of the step (requested bytes);
``phases[k]`` is the phase that made allocation ``k``.
"""

from __future__ import annotations

from estimator.errors import MissingExtraError
from estimator.replay.allocator import Event
from estimator.trace import Category

# the stacking order, bottom up; cuDNN's workspaces join cuBLAS's, empty_cache calls hold no memory
ORDER = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.ACTIVATION,
         Category.TEMPORARY, Category.INPUT, Category.WORKSPACE)
GIB = 2**30


def category_timeline(events: list[Event]) -> dict[str, list[int]]:
    """Live requested bytes per category after each event (cuDNN's workspaces with cuBLAS's, as the breakdown
    counts them)."""
    live: dict[str, int] = dict.fromkeys(ORDER, 0)
    out: dict[str, list[int]] = {c: [] for c in ORDER}
    for e in events:
        cat = (Category.WORKSPACE if e.category == Category.CONV_WORKSPACE
               else e.category if e.category in live else Category.TEMPORARY)
        live[cat] += e.nbytes if e.alloc else -e.nbytes
        for c in ORDER:
            out[c].append(live[c])
    return out


def _pyplot():
    """matplotlib's pyplot on the file-only backend; matplotlib is the ``plot`` extra, not a core dependency."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise MissingExtraError("plot", "drawing the memory timeline (batchfit estimate --plot)", str(exc)) from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw_timeline(events: list[Event], phases: list[str], title: str, path: str) -> None:
    plt = _pyplot()
    series = category_timeline(events)
    x = range(len(events))
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.stackplot(x, *[[v / GIB for v in series[c]] for c in ORDER], labels=[str(c) for c in ORDER])
    last = None
    for i, e in enumerate(events):
        phase = phases[e.key] if e.alloc else None
        if phase and phase != last:
            ax.axvline(i, color="black", lw=0.5, alpha=0.4)
            ax.text(i, ax.get_ylim()[1] * 0.98, phase, rotation=90, va="top", fontsize=7)
            last = phase
    ax.set_xlabel("allocator event")
    ax.set_ylabel("live GiB (requested)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
