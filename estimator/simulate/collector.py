"""The garbage collector during an estimate: young cycles collected as always, full collections held off.

An estimate keeps what it simulated until it answers: dozens of traces of tens of thousands of allocations each,
the models it built, their replays. CPython's full collection scans every object not frozen, and it runs each time
the objects that survived the younger generations grow by a quarter: about ten times in an estimate of a deep
model with suggestions, ~80 ms each there (~1 s of its ~7 s, on the critical path of the process that plans). Held
off, the cycles that reached the oldest generation wait for the first full collection after the estimate; the
young ones (most of the cyclic garbage: each step's autograd and module objects) go as before.

>>> with rare_full_collections():                                       # doctest: +SKIP
...     response = answer(...)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# the oldest generation's threshold inside an estimate: its younger collections before a full one (CPython's: 10)
HELD_OFF = 100_000

_lock = threading.Lock()
_depth = 0  # estimates running in this process (threads, or one inside another)
_saved: int | None = None  # the oldest generation's threshold before the first


@contextlib.contextmanager
def rare_full_collections() -> Iterator[None]:
    """Full collections held off inside the block (the oldest generation's threshold raised), restored after the
    last of the blocks running in this process ends."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            first, second, third = gc.get_threshold()
            _saved = third
            gc.set_threshold(first, second, max(third, HELD_OFF))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                first, second, _ = gc.get_threshold()
                gc.set_threshold(first, second, _saved)
                _saved = None
