"""The allocator replay in C (``_allocator.c``), loaded with ctypes: ``replay_sized``'s fast path.

The C library is built when the package is installed (pyproject.toml's
``ext-modules``; optional, since it needs a C compiler). It answers what
most replays are: no expandable segments, no recording. ``replay_native``
returns None where it cannot answer (no library, one of those two, a key
out of range, host memory), and ``replay_sized`` replays in Python, the
reference both are held to (tests/test_native_replay.py).

>>> available()                                                        # doctest: +SKIP
True
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import itertools
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator.errors import ReplayError
from estimator.trace import MANAGED_CATEGORIES, SOFT_CATEGORIES, Category

# what an allocation is to the C replay (_allocator.c's KIND_*)
KIND_NORMAL, KIND_SOFT, KIND_EMPTY_CACHE, KIND_MANAGED = 0, 1, 2, 3
# the slots of its out[] array
(OUT_ALLOC_PEAK, OUT_RESERVED_PEAK, OUT_OOM_EVENT, OUT_PEAK_EVENT, OUT_SEGMENTS, OUT_FLUSHES, OUT_FAILED,
 OUT_MANAGED_PEAK, OUT_DEVICE_PEAK, OUT_EVENTS_DONE, OUT_ERROR_EVENT, OUT_ERROR_KEY, OUT_ERROR_VALUE) = range(13)
OUT_SLOTS = 13
# its return codes; the others (a key out of range, host memory, sizes past SAFE_BYTES, a state Python's model would
# not reach) hand the replay to Python
OK, ERR_TWICE, ERR_NEGATIVE, ERR_NOT_ALLOCATED = 0, 1, 2, 3
SAFE_BYTES = 1 << 60  # sizes and limits the C replay takes (its int64 sums never overflow below it)


def _kind(category: str) -> int:
    if category in MANAGED_CATEGORIES:
        return KIND_MANAGED
    if category == Category.EMPTY_CACHE:
        return KIND_EMPTY_CACHE
    return KIND_SOFT if category in SOFT_CATEGORIES else KIND_NORMAL


ABI = 2  # _allocator.c's BF_ABI: what this module passes and reads


def _load() -> Any:
    """The built library next to this module, or None (not built: no C compiler when it was installed; or built
    from another version of _allocator.c, which a new install builds again)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_allocator{suffix}"
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # not loadable here (another machine's build): the Python replay
                return None
            if not hasattr(lib, "bf_abi") or lib.bf_abi() != ABI:
                return None
            fn = lib.bf_replay
            i64, p = ctypes.c_int64, ctypes.c_void_p
            fn.argtypes = [i64, p, i64, p, p, p, ctypes.c_int32, p, ctypes.c_int32, i64, i64, ctypes.c_int, p, p, p,
                           p, p]
            fn.restype = ctypes.c_int
            return fn
    return None


# BATCHFIT_NATIVE_REPLAY=0: the Python replay alone (a bench's "before", in the same run)
_REPLAY = None if os.environ.get("BATCHFIT_NATIVE_REPLAY") == "0" else _load()


def available() -> bool:
    """Whether the C replay was built (``replay_sized`` is then about 50 times faster)."""
    return _REPLAY is not None


def _address(a: array[Any]) -> int:
    address: int = a.buffer_info()[0]
    return address


@dataclass(frozen=True)
class Encoded:
    """A step's events, categories and streams as the C replay reads them: the same at every batch, so a step whose
    lists never change (an affine trace) encodes them once (``AffineTrace.encoded``)."""

    events: array[int]  # (is_alloc, key) of each event, flat
    categories: array[int]  # each allocation's index in ``names``
    kinds: array[int]  # each allocation's KIND_*
    names: list[str]  # the categories, in order of first use
    streams: array[int] | None  # each allocation's stream as a dense index (None: all on the default stream)
    n_streams: int

    @property
    def n_events(self) -> int:
        return len(self.events) // 2


def encode(events: Sequence[tuple[bool, int]], categories: Sequence[str],
           streams: Sequence[int] | None) -> Encoded | None:
    """The C replay's form of a step's lists; None where they do not have one (a malformed event)."""
    flat = array("q", itertools.chain.from_iterable(events))
    if len(flat) != 2 * len(events):
        return None  # an event that is not a pair: what Python makes of it
    index: dict[str, int] = {c: i for i, c in enumerate(dict.fromkeys(categories))}
    names = list(index)
    cats = array("i", map(index.__getitem__, categories))
    kinds = array("B", map(array("B", [_kind(c) for c in names]).__getitem__, cats))
    n_streams, dense = 1, None
    if streams is not None:
        ids: dict[int, int] = {0: 0}  # the default stream's pools first, as the Python allocator makes them
        for s in streams:
            ids.setdefault(s, len(ids))
        n_streams, dense = len(ids), array("i", map(ids.__getitem__, streams))
    return Encoded(flat, cats, kinds, names, dense, n_streams)


def replay_native(events: Sequence[tuple[bool, int]], sizes: Sequence[int], categories: Sequence[str],
                  streams: Sequence[int] | None, *, capacity: int | None = None, max_split_size: int | None = None,
                  timelines: bool = False, encoded: Encoded | None = None) -> dict[str, Any] | None:
    """``replay_sized``'s result fields for a replay without expandable segments or recording, from the C replay;
    None where it cannot answer (the caller replays in Python). ``encoded``: ``encode(events, categories,
    streams)``, made before. Raises ``ReplayError`` as the Python replay does."""
    if _REPLAY is None:
        return None
    m = len(sizes)
    if len(categories) != m or (streams is not None and len(streams) != m):
        return None  # what Python makes of it (an IndexError where a key reaches past), not ours to judge
    for limit in (capacity, max_split_size):
        if limit is not None and (type(limit) is not int or not 0 <= limit <= SAFE_BYTES):
            return None  # past what the C replay's int64 sums hold, or not an int: Python's arbitrary precision
    try:
        if encoded is None:
            encoded = encode(events, categories, streams)
            if encoded is None:
                return None
        sized = array("q", sizes)
    except (TypeError, OverflowError):  # sizes or flags that are not int64: Python's to replay
        return None
    e, n = encoded, encoded.n_events
    if n != len(events) or len(e.kinds) != m or (e.streams is not None and len(e.streams) != m):
        return None  # an encoding of other lists: never read past its arrays
    out = array("q", bytes(8 * OUT_SLOTS))
    breakdown = array("q", bytes(8 * max(len(e.names), 1)))
    present = array("B", bytes(max(len(e.names), 1)))
    tl_alloc = array("q", bytes(8 * n)) if timelines else array("q", b"")
    tl_res = array("q", bytes(8 * n)) if timelines else array("q", b"")
    rc = _REPLAY(n, _address(e.events), m, _address(sized), _address(e.kinds), _address(e.categories), len(e.names),
                 None if e.streams is None else _address(e.streams), e.n_streams,
                 -1 if capacity is None else capacity, -1 if max_split_size is None else max_split_size,
                 int(timelines), _address(tl_alloc) if timelines else None, _address(tl_res) if timelines else None,
                 _address(out), _address(breakdown), _address(present))
    i, k = out[OUT_ERROR_EVENT], out[OUT_ERROR_KEY]
    if rc == ERR_TWICE:
        raise ReplayError(f"event {i}: key {k} allocated twice without a free")
    if rc == ERR_NEGATIVE:
        raise ReplayError(f"event {i}: nbytes {out[OUT_ERROR_VALUE]}; expected >= 0")
    if rc == ERR_NOT_ALLOCATED:
        raise ReplayError(f"event {i}: free of key {k} that is not allocated")
    if rc != OK:
        return None
    done = out[OUT_EVENTS_DONE]
    oom = out[OUT_OOM_EVENT]
    return {
        "allocated_peak": out[OUT_ALLOC_PEAK],
        "reserved_peak": out[OUT_RESERVED_PEAK],
        "fits": oom < 0,
        "oom_event": None if oom < 0 else oom,
        "peak_event": out[OUT_PEAK_EVENT],
        "allocated": tl_alloc[:done].tolist() if timelines else [],
        "reserved": tl_res[:done].tolist() if timelines else [],
        "breakdown_at_peak": {e.names[c]: breakdown[c] for c in range(len(e.names)) if present[c]},
        "segments_allocated": out[OUT_SEGMENTS],
        "cache_flushes": out[OUT_FLUSHES],
        "failed_mallocs": out[OUT_FAILED],
        "managed_peak": out[OUT_MANAGED_PEAK],
        "device_peak": out[OUT_DEVICE_PEAK],
    }
