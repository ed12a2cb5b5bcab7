"""CUDA streams and events on the virtual GPU.

Distributed code (FSDP2's all-gather and reduce-scatter streams) makes
streams, switches to them and orders them with events. On a host without a
CUDA driver ``torch.cuda.Stream()`` fails, so inside the virtual GPU streams
are plain objects: the work on them runs at once (fake tensors have no data
to wait for), and what they are for memory is kept: which stream is current
when a tensor is allocated. The caching allocator keeps one pool per stream
(a block freed by one stream is never handed to another,
CUDACachingAllocator.cpp's ``BlockComparatorSize`` orders by stream first),
so each allocation carries its stream into the trace (``Allocation.stream``).

>>> streams = Streams()
>>> with streams.stream(streams.new()):
...     streams.current().stream_id
1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class FakeStream:
    """Stands in for ``torch.cuda.Stream``: an id and the ordering calls, which are no-ops."""

    def __init__(self, streams: Streams, stream_id: int, priority: int = 0) -> None:
        self._streams = streams
        self.stream_id = stream_id
        self.priority = priority
        self.device = None
        self.device_index = 0
        self.device_type = 1  # cuda

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> FakeEvent:
        event = event if event is not None else FakeEvent()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False  # no CUDA graph is captured

    def __enter__(self) -> FakeStream:
        self._streams._stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._streams._stack.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("stream", self.stream_id))

    def __repr__(self) -> str:
        return f"<virtual cuda stream {self.stream_id}>"


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: recorded and waited on at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> FakeEvent:
        return self

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class Streams:
    """The virtual GPU's streams: the default stream (id 0), those made since, and which one is current."""

    def __init__(self) -> None:
        self.default = FakeStream(self, 0)
        self._stack: list[FakeStream] = []
        self._count = 0

    def new(self, priority: int = 0, **_: Any) -> FakeStream:
        self._count += 1
        return FakeStream(self, self._count, priority)

    def current(self, device: Any = None) -> FakeStream:
        return self._stack[-1] if self._stack else self.default

    def current_id(self) -> int:
        return self._stack[-1].stream_id if self._stack else 0

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        """``torch.cuda.stream(s)``: ``s`` current inside (None: no change)."""
        if stream is None:
            yield
            return
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def patch(self, patches: Any) -> None:
        """Put these streams in ``torch.cuda`` (and ``torch.accelerator``) for the virtual GPU's lifetime."""
        import torch

        streams = self

        class Stream(FakeStream):
            """``torch.cuda.Stream(priority=...)`` inside the virtual GPU."""

            def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
                streams._count += 1
                super().__init__(streams, streams._count, priority)

        cuda = torch.cuda
        patches.set(cuda, "Stream", Stream)
        patches.set(cuda, "Event", FakeEvent)
        patches.set(cuda, "current_stream", streams.current)
        patches.set(cuda, "default_stream", lambda device=None: streams.default)
        patches.set(cuda, "stream", streams.stream)
        patches.set(cuda, "set_stream", lambda s: None)
        if hasattr(torch, "accelerator"):
            patches.set(torch.accelerator, "current_stream", streams.current)
        patches.set(torch.Tensor, "record_stream", lambda self, stream: None)
