"""The memory timeline of one training step (``estimator.replay.timeline``), stacked by category, phases marked.

>>> draw_timeline(timeline_of(view), "step.png", "resnet50 b681 on T4-16GB")   # doctest: +SKIP

Stacked: the live requested bytes per category; the line: what the allocator reserves; dashed: the card's
usable memory (capacity - CUDA context - the planner's reserve), named in the legend when it lies far above
the step; the marker: the allocated peak. Each phase's label stands in the middle of its span; one that would
overlap the label drawn before it is left out, and the legend sits outside the axes, clear of the labels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from estimator.errors import MissingExtraError
from estimator.replay.timeline import Timeline

GIB = 2**30
LABEL_GAP_PX = 2.0  # between two phase labels drawn side by side
FAR_ABOVE = 2.0  # a usable line more than this many times the step's reserved peak is left above the plot


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend; matplotlib is the ``plot`` extra, not a core dependency."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise MissingExtraError("plot", "drawing the memory timeline (batchfit estimate --plot)", str(exc)) from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def keep_apart(spans: Sequence[tuple[float, float]], gap: float = LABEL_GAP_PX) -> list[bool]:
    """Which labels to draw, given each one's left and right edge (pixels, left to right): each that starts
    ``gap`` past the right edge of the last one drawn."""
    kept, right = [], -math.inf
    for left, end in spans:
        clear = left >= right + gap
        kept.append(clear)
        if clear:
            right = end
    return kept


def figure(t: Timeline, title: str | None = None) -> Any:
    """The timeline's matplotlib figure (``draw_timeline`` saves it)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 5), dpi=120, layout="constrained")
    x = t.points
    ax.stackplot(x, *[[v / GIB for v in lane] for lane in t.categories.values()], labels=list(t.categories))
    ax.plot(x, [v / GIB for v in t.reserved], color="black", lw=0.8, label="reserved (the allocator's cache)")
    far = t.usable_bytes > FAR_ABOVE * t.reserved_peak_bytes
    ax.axhline(t.usable_bytes / GIB, color="tab:red", ls="--", lw=1,
               label=f"usable on {t.gpu}: {t.usable_bytes / GIB:.2f} GiB" + (" (above the plot)" if far else ""))
    ax.plot([t.peak_event], [t.allocated_peak_bytes / GIB], marker="v", color="tab:red", ls="none", ms=8,
            label=f"allocated peak: {t.allocated_peak_bytes / GIB:.2f} GiB ({t.peak_phase})")
    top = max(t.reserved_peak_bytes if far else t.usable_bytes, t.reserved_peak_bytes, 1) / GIB * 1.1
    ax.set_ylim(0, top)
    end = max(t.events - 1, 1)
    ax.set_xlim(0, end)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    ax.set_title(title or f"batch {t.batch_size} on {t.gpu}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    labels = []
    for span, after in zip(t.phases, [*(s.start for s in t.phases[1:]), end], strict=True):
        ax.axvline(span.start, color="black", lw=0.5, alpha=0.4)
        labels.append(ax.text((span.start + after) / 2, top * 0.99, span.phase, rotation=90, ha="center", va="top",
                              fontsize=7))
    fig.canvas.draw()  # the final layout: where each label lies
    renderer = fig.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    for label, keep in zip(labels, keep_apart([(b.x0, b.x1) for b in boxes]), strict=True):
        if not keep:
            label.remove()
    return fig


def draw_timeline(t: Timeline, path: str, title: str | None = None) -> None:
    """The timeline drawn into ``path`` (PNG, or any format matplotlib infers from the name)."""
    plt = _pyplot()
    fig = figure(t, title)
    fig.savefig(path)
    plt.close(fig)
