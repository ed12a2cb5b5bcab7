"""The largest batch that fits, and the batch to recommend.

``max_batch`` searches any monotone probe: replays of the affine trace
(estimator/plan/affine.py), or full simulations when the step is not affine in
the batch. Secant steps on the allocated peak find the neighbourhood of the
answer, bisection pins it.
"""

from __future__ import annotations

from collections.abc import Callable

from estimator.options import MAX_BATCH

# Tensor cores run batches in multiples of 8 best (NVIDIA's "Deep Learning
# Performance" guide: dimensions divisible by 8 for fp16/bf16 GEMMs).
ALIGNMENT = 8
ALIGNMENT_MAX_COST = 0.10


def max_batch(probe: Callable[[int], tuple[bool, int]], capacity: int, limit: int = MAX_BATCH,
              start: int = 1) -> int | None:
    """Largest ``b`` in [start, limit] whose ``probe(b) -> (fits, allocated_peak)`` fits; None if not even ``start``.

    Assumes fits is monotone in ``b``. Secant steps on the allocated peak
    (memory is close to affine in the batch) find the neighbourhood, then
    galloping and bisection pin the answer.

    >>> max_batch(lambda b: (b <= 37, 100 + 10 * b), capacity=480)
    37
    """
    ok, p1 = probe(start)
    if not ok:
        return None
    lo, hi = start, None  # invariant: fits(lo), not fits(hi)
    _, p2 = probe(start + 1) if limit > start else (False, p1)
    guess = affine_guess(p1, p2, capacity, start)
    for _ in range(3):
        top = hi - 1 if hi is not None else limit
        if guess is None or top <= lo:
            break
        b = min(max(guess, lo + 1), top)
        ok, peak = probe(b)
        if ok:
            lo = b
        else:
            hi = b
        guess = start + (capacity - p1) * (b - start) // (peak - p1) if peak > p1 else None
    step = 0.01
    while hi is not None and hi - lo > 2 and lo < int(hi * (1 - step)):  # gallop down: -1%, -2%, -4%...
        b = int(hi * (1 - step))
        step *= 2
        if probe(b)[0]:
            lo = b
            break
        hi = b
    step = 1.0
    while hi is None:  # gallop up: +100%, +200%, ...
        if lo >= limit:
            return limit
        b = min(limit, max(lo + 1, int(lo * (1 + step))))
        step *= 2
        ok, _ = probe(b)
        if ok:
            lo = b
        else:
            hi = b
    return bisect(lambda b: probe(b)[0], lo, hi)


def max_batch_between(fits: Callable[[int], bool], lo: int, hi: int, guess: int) -> int:
    """Largest ``b`` in [lo, hi) that fits, given fits(lo) and not fits(hi), probing from ``guess`` outwards.

    Gallops away from the guess (1, 2, 4, ... batches) until the answer is
    bracketed, then bisects: a guess off by d costs about 2 log2(d) probes.

    >>> max_batch_between(lambda b: b <= 37, 1, 100, 35)
    37
    """
    b = min(max(guess, lo + 1), hi - 1)
    step = 1
    if b > lo and fits(b):
        lo = b
        while lo + step < hi:
            if not fits(lo + step):
                hi = lo + step
                break
            lo += step
            step *= 2
    elif b > lo:
        hi = b
        while hi - step > lo:
            if fits(hi - step):
                lo = hi - step
                break
            hi -= step
            step *= 2
    return bisect(fits, lo, hi)


def bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``b`` in [lo, hi) that fits, given fits(lo) (or lo a floor) and not fits(hi).

    >>> bisect(lambda b: b <= 37, 1, 100)
    37
    """
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def affine_guess(peak_at_1: int, peak_at_2: int, capacity: int, start: int = 1) -> int | None:
    """Where the line through the peaks at batch ``start`` and ``start + 1`` meets ``capacity``."""
    per_sample = peak_at_2 - peak_at_1
    if per_sample <= 0:
        return None
    return max(start, start + (capacity - peak_at_1) // per_sample)


def headroom_capacity(usable: int, context: int, headroom: float) -> int:
    """What the allocator may hold for the recommendation: (1 - headroom) of the usable memory, less the
    CUDA context, so that the device peak (reserved + context) stays within (1 - headroom) x usable.

    >>> headroom_capacity(1000, 100, 0.10)
    800
    """
    return max(int((1 - headroom) * usable) - context, 0)


def aligned_within(fits: Callable[[int], bool], room: int, align: bool = True) -> int:
    """``recommended(room)``, or the next multiple of 8 down while that stays cheap and ``fits``
    fails there (fits is monotone only up to allocator blocks); else ``room`` itself, which fits.

    >>> aligned_within(lambda b: b != 192, 199)
    184
    """
    b = _aligned(room, align)
    while b != room and not fits(b):
        lower = b - ALIGNMENT
        b = lower if (room - lower) / room < ALIGNMENT_MAX_COST else room
    return b


def recommended(max_size: int | None, align: bool = True) -> int | None:
    """``max_size`` rounded down to a multiple of 8 when that gives up less than 10%."""
    return None if max_size is None else _aligned(max_size, align)


def _aligned(max_size: int, align: bool) -> int:
    if not align or max_size < ALIGNMENT:
        return max_size
    aligned = max_size // ALIGNMENT * ALIGNMENT
    return aligned if (max_size - aligned) / max_size < ALIGNMENT_MAX_COST else max_size


def max_fitting(fits: Callable[[int], bool], limit: int) -> int | None:
    """The largest ``n`` in [1, limit] that ``fits``, by bisection (``fits`` monotone); None if not even 1.

    >>> max_fitting(lambda n: n <= 300, 1024)
    300
    """
    if fits(limit):
        return limit
    return bisect(fits, 0, limit) or None
