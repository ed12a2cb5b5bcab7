"""Replay of an allocation trace through PyTorch's CUDA caching allocator.

A pure function of (events, config): no torch, no globals, no environment.
Rules and constants follow c10/cuda/CUDACachingAllocator.cpp (torch 2.14):

- requests are rounded up to ``kMinBlockSize`` (512 B)                round_size
- requests <= ``kSmallSize`` (1 MiB) use the small pool, served from
  ``kSmallBuffer`` (2 MiB) segments; 1-10 MiB requests get ``kLargeBuffer``
  (20 MiB) segments; larger ones are rounded to ``kRoundLarge`` (2 MiB)       get_allocation_size
- best fit: the smallest cached block of the pool that is large enough,
  lowest address first on ties; oversize blocks (>= max_split_size) serve
  only requests within ``kLargeBuffer`` of their size                       get_free_block
- split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool,
  and only for requests below max_split_size)                             should_split
- freed blocks merge with free neighbours of the same segment              free_block
- a failed cudaMalloc frees oversize cached blocks (when max_split_size is
  set), retries, then frees every cached whole segment and retries once
  more before reporting out of memory                                      malloc

- an allocation in ``SOFT_CATEGORIES`` that cannot be had is skipped, not an
  OOM: cuDNN catches the OutOfMemoryError of a plan's workspace and takes a
  plan that needs less (Conv_v8.cpp try_configs); the cache is freed first,
  as for any failed cudaMalloc
- an allocation in ``MANAGED_CATEGORIES`` (bitsandbytes' paged optimizer state: ``cudaMallocManaged``) is not
  the caching allocator's: its bytes are counted apart (``managed_peak``; ``device_peak`` is the most of reserved
  plus managed at once) and, as resident memory, against the capacity every cudaMalloc is checked against; one
  that does not fit beside the reserved segments is an OOM (the driver could page it out, at a cost a real run
  may or may not survive: never reported as fitting)
- an ``EMPTY_CACHE`` event releases every cached whole segment
  (``emptyCache`` -> release_cached_blocks), as cudnn.benchmark's search does;
  with expandable segments it keeps the pages mapped (a simplification: more
  reserved, never less)

``record=True`` also records each action the allocator takes (cudaMalloc and
cudaFree of segments, where each block lives) and its final segments
(``estimator.replay.recording``), what a memory snapshot shows; off, it costs
nothing (the same branch as the timelines).

``expandable_segments`` is modelled as one growing segment per pool mapped
in 2 MiB pages (a simplification of ExpandableSegment: pages are unmapped
only when an allocation would otherwise fail).

Example:

>>> r = replay([Event(True, 1, 4096), Event(False, 1, 4096)], AllocatorConfig())
>>> (r.allocated_peak, r.reserved_peak, r.fits)
(4096, 2097152, True)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from estimator.errors import ReplayError, SpecError
from estimator.replay.native import Encoded, replay_native
from estimator.replay.recording import Action, Entry, Recording, Segment
from estimator.replay.recording import Block as BlockState
from estimator.trace import MANAGED_CATEGORIES, SOFT_CATEGORIES, Category, Trace

KMIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
KSMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
KSMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
KLARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
KMIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
KROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB
EXPANDABLE_PAGE = 2097152  # ExpandableSegment maps 2 MiB pages (segment_size_ for the large pool)
CONV_WORKSPACE = Category.CONV_WORKSPACE  # cuDNN's per-call workspace (simulate/virtual_gpu/cudnn.py)
EMPTY_CACHE = Category.EMPTY_CACHE  # an allocation of this category is a torch.cuda.empty_cache() call


class Event(NamedTuple):
    """One storage allocation (``alloc=True``) or its free; ``key`` pairs them."""

    alloc: bool
    key: int
    nbytes: int
    category: str = ""
    stream: int = 0  # the CUDA stream it is allocated on (0: the default stream)


def trace_events(trace: Trace) -> list[Event]:
    """A trace's events with each allocation's bytes, category and stream, as ``replay`` takes them."""
    allocs = trace.allocations
    return [Event(a, k, allocs[k].nbytes, allocs[k].category, allocs[k].stream) for a, k in trace.events]


@dataclass(frozen=True)
class AllocatorConfig:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` and the card decide.

    ``capacity``: bytes cudaMalloc can hand out (card memory minus the CUDA
    context and memory outside the allocator); ``None`` for unlimited.
    """

    capacity: int | None = None
    max_split_size: int | None = None
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.garbage_collection_threshold != 0.0:
            raise SpecError("allocator.garbage_collection_threshold", self.garbage_collection_threshold,
                            "0.0 (the allocator's garbage collection of cached blocks is not modelled)")
        if self.capacity is not None and self.capacity < 0:
            raise ReplayError(f"capacity: got {self.capacity}; expected bytes >= 0 or None")
        if self.max_split_size is not None and self.max_split_size < KLARGE_BUFFER:
            # CUDAAllocatorConfig::parseMaxSplitSize: "max_split_size_mb too small"
            raise ReplayError(
                f"max_split_size: got {self.max_split_size}; expected >= {KLARGE_BUFFER} bytes (20 MiB)"
            )
        if self.max_split_size is not None and self.max_split_size % (1 << 20):
            # PYTORCH_CUDA_ALLOC_CONF sets it in MiB (max_split_size_mb): only whole MiB keep an oversize block a
            # whole segment (a split one's free part is below any such size), which the release of oversize
            # blocks relies on
            raise ReplayError(f"max_split_size: got {self.max_split_size}; expected a whole number of MiB "
                              "(a multiple of 1048576 bytes), as max_split_size_mb sets it")


@dataclass
class ReplayResult:
    """Peaks and timelines of one replay; timelines have one entry per event."""

    allocated_peak: int
    reserved_peak: int
    fits: bool
    oom_event: int | None
    peak_event: int
    allocated: list[int] = field(repr=False)
    reserved: list[int] = field(repr=False)
    breakdown_at_peak: dict[str, int] = field(default_factory=dict)
    segments_allocated: int = 0
    cache_flushes: int = 0
    failed_mallocs: int = 0  # cudaMallocs refused for want of capacity (0: the same as an uncapped replay)
    managed_peak: int = 0  # the most managed (paged) bytes live at once: not in reserved
    device_peak: int = 0  # the most reserved + managed bytes at once: what the card holds (without the context)
    recording: Recording | None = field(default=None, repr=False)  # with ``record=True``


def round_size(size: int) -> int:
    """CUDACachingAllocator.cpp round_size (without roundup_power2_divisions)."""
    if size < KMIN_BLOCK_SIZE:
        return KMIN_BLOCK_SIZE
    return KMIN_BLOCK_SIZE * ((size + KMIN_BLOCK_SIZE - 1) // KMIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """CUDACachingAllocator.cpp get_allocation_size: the cudaMalloc for a rounded request."""
    if size <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if size < KMIN_LARGE_ALLOC:
        return KLARGE_BUFFER
    return KROUND_LARGE * ((size + KROUND_LARGE - 1) // KROUND_LARGE)


def _pool_key(stream: int, small: bool) -> int:
    return 2 * stream + small


class _Block:
    __slots__ = ("addr", "size", "small", "pool", "allocated", "prev", "next", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: int, pool: int) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.pool = pool  # _pool_key(stream, small): blocks serve only their own stream's requests
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment


class _Allocator:
    def __init__(self, config: AllocatorConfig) -> None:
        self.cfg = config
        self.expandable = config.expandable_segments
        self.max_split = config.max_split_size if config.max_split_size is not None else 1 << 62
        # per (stream, small or large): (size, addr) of free blocks; CUDACachingAllocator.cpp's BlockPools
        # order blocks by stream first, so a block is only ever found for a request on its own stream
        self.pools: dict[int, list[tuple[int, int]]] = {_pool_key(0, True): [], _pool_key(0, False): []}
        self.blocks: dict[int, _Block] = {}  # free blocks by address
        self.reserved = 0
        self.managed = 0  # live bytes outside the caching allocator that take the card's memory (MANAGED_CATEGORIES)
        self.allocated = 0
        self.next_addr = 1 << 20
        self.segments = 0
        self.flushes = 0
        self.failed = 0
        self.tails: dict[int, _Block | None] = {}  # expandable: per pool, its segment's last block
        # recording (None: off): the segment actions of the event being replayed, (action, addr, size, stream)
        self.log: list[tuple[Action, int, int, int]] | None = None

    # --- pool bookkeeping
    def _insert(self, b: _Block) -> None:
        bisect.insort(self.pools[b.pool], (b.size, b.addr))
        self.blocks[b.addr] = b

    def _remove(self, b: _Block) -> None:
        pool = self.pools[b.pool]
        i = bisect.bisect_left(pool, (b.size, b.addr))
        del pool[i]
        del self.blocks[b.addr]

    def _find(self, pk: int, size: int) -> _Block | None:
        pool = self.pools[pk]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        bsize, addr = pool[i]
        if size < self.max_split and bsize >= self.max_split:
            return None  # don't split an oversize block for a small request
        if size >= self.max_split and bsize >= size + KLARGE_BUFFER:
            return None  # oversize blocks only serve requests within kLargeBuffer
        return self.blocks[addr]

    # --- cudaMalloc / cudaFree
    def _cuda_malloc(self, small: bool, size: int, pk: int) -> _Block | None:
        cap = self.cfg.capacity
        if cap is not None and self.reserved + self.managed + size > cap:
            self.failed += 1
            return None
        self.reserved += size
        self.segments += 1
        b = _Block(self.next_addr, size, small, self.segments, pk)
        self.next_addr += size + (1 << 20)
        if self.log is not None:
            self.log.append((Action.SEGMENT_ALLOC, b.addr, size, pk >> 1))
        return b

    def _cuda_free(self, b: _Block) -> None:
        """cudaFree of a cached block (release_block)."""
        self._remove(b)
        self.reserved -= b.size
        if self.log is not None:
            self.log.append((Action.SEGMENT_FREE, b.addr, b.size, b.pool >> 1))

    def _release_segments(self) -> int:
        """Release every cached whole segment (release_cached_blocks); the bytes released."""
        freed = 0
        for pool in self.pools.values():
            for _size, addr in list(pool):
                b = self.blocks[addr]
                if b.prev is None and b.next is None:
                    self._cuda_free(b)
                    freed += b.size
        return freed

    def _release_oversize(self, pk: int, size: int) -> bool:
        """release_available_cached_blocks (of the request's own stream)."""
        if self.cfg.max_split_size is None:
            return False
        want = self.max_split if size < self.max_split else size
        pool = self.pools[pk]
        i = bisect.bisect_left(pool, (want, -1))
        if i < len(pool):
            self._cuda_free(self.blocks[pool[i][1]])
            return True
        released = 0
        j = len(pool) - 1
        while j >= 0 and released < want and pool[j][0] >= self.max_split:
            b = self.blocks[pool[j][1]]
            self._cuda_free(b)
            released += b.size
            j -= 1
        return released >= want

    # --- malloc / free
    def malloc(self, nbytes: int, soft: bool = False, stream: int = 0) -> _Block | None:
        size = KMIN_BLOCK_SIZE if nbytes < KMIN_BLOCK_SIZE else KMIN_BLOCK_SIZE * (
            (nbytes + KMIN_BLOCK_SIZE - 1) // KMIN_BLOCK_SIZE)  # round_size
        small = size <= KSMALL_SIZE
        pk = _pool_key(stream, small)
        pool = self.pools.get(pk)
        if pool is None:
            pool = self.pools[pk] = []
        if self.expandable:
            return self._malloc_expandable(small, size, pk, soft)
        # _find and _remove in one bisection (the hot path of every replay)
        i = bisect.bisect_left(pool, (size, -1))
        block = None
        if i < len(pool):
            bsize, addr = pool[i]
            max_split = self.max_split
            if not (size < max_split <= bsize or size >= max_split and bsize >= size + KLARGE_BUFFER):
                del pool[i]
                block = self.blocks.pop(addr)
        if block is None:
            alloc = allocation_size(size)
            block = self._cuda_malloc(small, alloc, pk)
            if block is None and self._release_oversize(pk, size):
                block = self._cuda_malloc(small, alloc, pk)
            if block is None:
                self.flushes += 1
                self._release_segments()
                block = self._cuda_malloc(small, alloc, pk)
            if block is None:
                return None
        return self._split(block, size)

    def _split(self, block: _Block, size: int) -> _Block:
        remaining = block.size - size
        if block.small or self.expandable:
            split = remaining >= KMIN_BLOCK_SIZE
        else:
            split = size < self.max_split and remaining > KSMALL_SIZE
        if split:
            rest = _Block(block.addr + size, remaining, block.small, block.segment, block.pool)
            rest.prev = block
            nxt = rest.next = block.next
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            bisect.insort(self.pools[rest.pool], (remaining, rest.addr))  # _insert
            self.blocks[rest.addr] = rest
            if self.expandable and self.tails.get(block.pool) is block:
                self.tails[block.pool] = rest
        block.allocated = True
        self.allocated += block.size
        return block

    def _malloc_expandable(self, small: bool, size: int, pk: int, soft: bool = False) -> _Block | None:
        block = self._find(pk, size)
        if block is not None:
            self._remove(block)
            return self._split(block, size)
        tail = self.tails.get(pk)
        have = tail.size if tail is not None and not tail.allocated else 0
        grow = EXPANDABLE_PAGE * ((size - have + EXPANDABLE_PAGE - 1) // EXPANDABLE_PAGE)
        cap = self.cfg.capacity
        if cap is not None and self.reserved + self.managed + grow > cap:
            self.failed += 1
            if soft:
                # a workspace cuDNN can do without: refused here, the free pages stay mapped (this model
                # unmaps them only on the way to an OOM, which it cannot undo)
                return None
            self.flushes += 1
            self._unmap_free_pages()
            tail = self.tails.get(pk)
            have = tail.size if tail is not None and not tail.allocated else 0
            grow = EXPANDABLE_PAGE * ((size - have + EXPANDABLE_PAGE - 1) // EXPANDABLE_PAGE)
            if self.reserved + self.managed + grow > cap:
                return None
        self.reserved += grow
        if have:
            assert tail is not None  # a free tail to grow
            self._remove(tail)
            tail.size += grow
            block = tail
        else:
            self.segments += 1
            block = _Block(self.next_addr, grow, small, self.segments, pk)
            self.next_addr += 1 << 40
            if tail is not None:
                tail.next = block
                block.prev = tail
        self.tails[pk] = block
        return self._split(block, size)

    def _unmap_free_pages(self) -> None:
        # Unmapping returns the whole pages inside free blocks.
        for pool in self.pools.values():
            for _size, addr in list(pool):
                b = self.blocks[addr]
                lo = (b.addr + EXPANDABLE_PAGE - 1) // EXPANDABLE_PAGE
                hi = (b.addr + b.size) // EXPANDABLE_PAGE
                if hi > lo:
                    self.reserved -= (hi - lo) * EXPANDABLE_PAGE

    def _merge(self, left: _Block, right: _Block) -> None:
        """``right`` into ``left``, its neighbour before it in the segment (both free, neither in a pool)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if self.expandable and self.tails.get(right.pool) is right:
            self.tails[right.pool] = left

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        prev = block.prev
        if prev is not None and not prev.allocated:  # into the free block before it
            self._remove(prev)
            self._merge(prev, block)
            block = prev
        after = block.next
        if after is not None and not after.allocated:  # the free block after it, into it
            self._remove(after)
            self._merge(block, after)
        self._insert(block)


def replay(events: Sequence[Event], config: AllocatorConfig, timelines: bool = True, *,
           record: bool = False) -> ReplayResult:
    """Run ``events`` through the caching-allocator model; stop at the first OOM.

    ``timelines=False`` leaves ``allocated`` and ``reserved`` empty (faster;
    the peaks are the same). ``record``: the allocator's actions and final
    segments in ``recording`` (``estimator.replay.recording``).
    """
    steps: list[tuple[bool, int]] = []
    sizes: list[int] = []
    categories: list[str] = []
    streams: list[int] = []
    current: dict[int, int] = {}  # an event's key -> the id of its live allocation
    for i, ev in enumerate(events):
        if ev.alloc:
            if ev.key in current:
                raise ReplayError(f"event {i}: key {ev.key} allocated twice without a free")
            current[ev.key] = len(sizes)
            steps.append((True, len(sizes)))
            sizes.append(ev.nbytes)
            categories.append(ev.category)
            streams.append(ev.stream)
        else:
            k = current.pop(ev.key, None)
            if k is None:
                raise ReplayError(f"event {i}: free of key {ev.key} that is not allocated")
            steps.append((False, k))
    return replay_sized(steps, sizes, categories, config, timelines, streams if any(streams) else None,
                        record=record)


def replay_sized(events: Sequence[tuple[bool, int]], sizes: Sequence[int], categories: Sequence[str],
                 config: AllocatorConfig, timelines: bool = True,
                 streams: Sequence[int] | None = None, *, record: bool = False, native: bool = True,
                 encoded: Encoded | None = None) -> ReplayResult:
    """``replay`` of ``(is_alloc, k)`` events whose allocation ``k`` has ``sizes[k]`` bytes in ``categories[k]``
    (on stream ``streams[k]``; None: all on the default stream).

    The form traces and affine traces already have: no per-event objects to build. Without expandable segments
    or ``record``, the C replay answers where it is built (``estimator.replay.native``: the same rules, about 50
    times faster; ``encoded``: the lists in its form, made once for a step that replays at many batches);
    ``native=False``: this Python model, the reference, always.
    """
    if record and config.expandable_segments:
        raise SpecError("allocator.expandable_segments", True, "false when the replay records where blocks live "
                        "(a snapshot): expandable segments are modelled by their sizes, not their addresses")
    if native and not record and not config.expandable_segments:
        fields = replay_native(events, sizes, categories, streams, capacity=config.capacity,
                               max_split_size=config.max_split_size, timelines=timelines, encoded=encoded)
        if fields is not None:
            return ReplayResult(**fields)
    a = _Allocator(config)
    recorder = _Recorder(a, sizes, categories, streams) if record else None
    tracking = timelines or record  # one branch per event for both: none when neither is asked for
    malloc, free = a.malloc, a.free
    live: dict[int, _Block] = {}
    block_size: dict[int, int] = {}  # allocation -> its block's size (fixed while allocated)
    allocated: list[int] = []
    reserved: list[int] = []
    alloc_peak = reserved_peak = 0
    peak_event = 0
    oom: int | None = None
    skipped: set[int] = set()  # soft allocations that could not be had, and empty_cache calls
    special = {k for k, c in enumerate(categories) if c == EMPTY_CACHE or c in SOFT_CATEGORIES}
    managed = {k for k, c in enumerate(categories) if c in MANAGED_CATEGORIES}
    managed_live: set[int] = set()
    managed_peak = device_peak = 0
    cap = config.capacity
    for i, (is_alloc, k) in enumerate(events):
        if managed and k in managed:  # outside the caching allocator: counted apart, against the capacity
            if is_alloc:
                if cap is not None and a.reserved + a.managed + sizes[k] > cap:
                    oom = i
                    break
                a.managed += sizes[k]
                managed_live.add(k)
                managed_peak = max(managed_peak, a.managed)
                device_peak = max(device_peak, a.reserved + a.managed)
            else:
                a.managed -= sizes[k]
                managed_live.discard(k)
            if timelines:
                allocated.append(a.allocated)
                reserved.append(a.reserved)
            continue
        if is_alloc:
            if k in live or k in skipped:
                raise ReplayError(f"event {i}: key {k} allocated twice without a free")
            nbytes = sizes[k]
            if nbytes < 0:
                raise ReplayError(f"event {i}: nbytes {nbytes}; expected >= 0")
            if k not in special:
                block = malloc(nbytes) if streams is None else malloc(nbytes, False, streams[k])
                if block is None:
                    oom = i
                    if recorder is not None:
                        recorder.event(i, True, k, None, 0)
                    break
            elif categories[k] == EMPTY_CACHE:
                if not config.expandable_segments:  # expandable: its pages stay mapped (see _malloc_expandable)
                    a._release_segments()
                block = None
            else:
                block = malloc(nbytes, True, 0 if streams is None else streams[k])
            if block is None:
                skipped.add(k)
                block_size.pop(k, None)  # a block it had before (a workspace had, freed, then skipped) is not live
            else:
                live[k] = block
                block_size[k] = block.size
                if a.allocated > alloc_peak:
                    alloc_peak = a.allocated
                    peak_event = i
                if a.reserved > reserved_peak:
                    reserved_peak = a.reserved
                if a.reserved + a.managed > device_peak:
                    device_peak = a.reserved + a.managed
        else:
            block = live.pop(k, None)
            if block is None:
                if k not in skipped:
                    raise ReplayError(f"event {i}: free of key {k} that is not allocated")
                skipped.discard(k)
            else:
                free(block)
        if tracking:
            if timelines:
                allocated.append(a.allocated)
                reserved.append(a.reserved)
            if recorder is not None:
                # the block's bytes as allocated (a freed block may have grown by merging with its neighbour)
                recorder.event(i, is_alloc, k, block, 0 if block is None else block_size[k])
    breakdown: dict[str, int] = {}
    if alloc_peak:
        at_peak: set[int] = set()
        for is_alloc, k in events[: peak_event + 1]:
            if is_alloc:
                at_peak.add(k)
            else:
                at_peak.discard(k)
        for k in at_peak & block_size.keys():  # not the skipped ones
            breakdown[categories[k]] = breakdown.get(categories[k], 0) + block_size[k]
        for k in at_peak & managed:  # managed bytes as requested: no blocks
            breakdown[categories[k]] = breakdown.get(categories[k], 0) + sizes[k]
    return ReplayResult(
        allocated_peak=alloc_peak,
        reserved_peak=reserved_peak,
        fits=oom is None,
        oom_event=oom,
        peak_event=peak_event,
        allocated=allocated,
        reserved=reserved,
        breakdown_at_peak=breakdown,
        segments_allocated=a.segments,
        cache_flushes=a.flushes,
        failed_mallocs=a.failed,
        managed_peak=managed_peak,
        device_peak=device_peak,
        recording=None if recorder is None else recorder.finish(live),
    )


class _Recorder:
    """What ``record=True`` keeps of one replay: each event's actions in order, then the final segments."""

    def __init__(self, a: _Allocator, sizes: Sequence[int], categories: Sequence[str],
                 streams: Sequence[int] | None) -> None:
        self.a, self.sizes, self.categories, self.streams = a, sizes, categories, streams
        self.actions: list[Entry] = []
        self.pending: list[tuple[Action, int, int, int]] = []
        a.log = self.pending  # the allocator's segment actions, until the event they belong to is logged

    def event(self, i: int, is_alloc: bool, k: int, block: _Block | None, size: int) -> None:
        """Event ``i``: the segments its malloc made or released, then its block's alloc or free (``size``: the
        block's bytes as allocated), or the OOM of an allocation that could not be had."""
        stream = 0 if self.streams is None else self.streams[k]
        self.actions.extend(Entry(action, addr, n, s, i) for action, addr, n, s in self.pending)
        self.pending.clear()
        if block is not None:
            self.actions.append(Entry(Action.ALLOC if is_alloc else Action.FREE, block.addr, size, stream, i, k))
        elif is_alloc and self.categories[k] != EMPTY_CACHE:  # a skipped cuDNN workspace, or the replay's OOM
            cap = self.a.cfg.capacity
            free = 0 if cap is None else cap - self.a.reserved
            self.actions.append(Entry(Action.OOM, free, self.sizes[k], stream, i, k))

    def finish(self, live: dict[int, _Block]) -> Recording:
        """The recording, with the segments the allocator holds at the end: its cached and its live blocks."""
        blocks: dict[int, list[BlockState]] = {}
        where: dict[int, tuple[int, bool]] = {}  # segment -> (stream, small)
        held = [(None, b) for b in self.a.blocks.values()] + [(k, b) for k, b in live.items()]
        for key, b in held:
            blocks.setdefault(b.segment, []).append(BlockState(b.addr, b.size, key))
            where[b.segment] = (b.pool >> 1, b.small)
        segments = []
        for seg, parts in blocks.items():
            parts.sort(key=lambda p: p.addr)
            stream, small = where[seg]
            segments.append(Segment(parts[0].addr, sum(p.size for p in parts), stream, small, tuple(parts)))
        return Recording(self.actions, sorted(segments))
