"""``torch.cuda`` queries answered for the target card.

Library code asks ``torch.cuda`` what it runs on (GradScaler, autocast,
``is_bf16_supported``, SDPA backend checks). Inside the virtual GPU those
answers describe the target card, and the memory counters read the trace.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Memory(Protocol):
    """What ``torch.cuda``'s memory queries read: the virtual GPU's observer (``estimator.simulate.record``)."""

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def empty_cache(self) -> None: ...


@dataclass(frozen=True)
class DeviceProperties:
    """Stands in for ``torch.cuda._CudaDeviceProperties``."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int = 108
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 40 * 1024 * 1024
    warp_size: int = 32


class Patches:
    """Set attributes on objects and put every one back on ``restore``."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        # The raw attribute, not getattr's: a classmethod read through
        # getattr comes back bound and would be restored as a plain method.
        own = vars(obj)
        had = name in own
        self._saved.append((obj, name, own.get(name), had))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._saved:
            obj, name, old, had = self._saved.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def patch_cuda_queries(patches: Patches, props: DeviceProperties, memory: Memory,
                       on_query: Callable[[str], None] = lambda name: None) -> None:
    """Answer ``torch.cuda``'s device and memory queries for ``props``, the memory ones from ``memory``.

    ``on_query`` hears every question whose answer depends on the card
    (capability, properties, free memory): a trace that asked none is the
    same on every card.
    """
    allocated, peak, reset_peak = memory.memory_allocated, memory.max_memory_allocated, memory.reset_peak
    cuda = torch.cuda
    capability = (props.major, props.minor)

    def told(name: str, answer):
        def query(*args, **kwargs):
            # bitsandbytes' import asks once per process (cuda_specs, to pick its library; cached by the
            # import): heard, it would set the first trace of a process apart from the same step's others
            if sys._getframe(1).f_globals.get("__name__") != "bitsandbytes.cuda_specs":
                on_query(name)
            return answer() if callable(answer) else answer
        return query
    patches.set(cuda, "is_available", lambda: True)
    patches.set(cuda, "device_count", lambda: 1)
    patches.set(cuda, "current_device", lambda: 0)
    patches.set(cuda, "is_initialized", lambda: True)
    patches.set(cuda, "_lazy_init", lambda: None)
    patches.set(cuda, "synchronize", lambda device=None: None)
    patches.set(cuda, "get_device_properties", told("get_device_properties", lambda: props))
    patches.set(cuda, "get_device_capability", told("get_device_capability", capability))
    patches.set(cuda, "get_device_name", told("get_device_name", props.name))
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        # sm80+ natively; older cards emulate it, and torch's default counts that (it creates a bf16 tensor): the
        # default's answer is true on every card (autocast asks it each time it is entered), so only the native
        # question depends on the card
        if not including_emulation:
            on_query("is_bf16_supported")
        return props.major >= 8 or including_emulation
    patches.set(cuda, "is_bf16_supported", is_bf16_supported)
    patches.set(cuda, "memory_allocated", lambda device=None: allocated())
    patches.set(cuda, "max_memory_allocated", lambda device=None: peak())
    patches.set(cuda, "reset_peak_memory_stats", lambda device=None: reset_peak())
    free_total = told("mem_get_info", lambda: (props.total_memory - allocated(), props.total_memory))
    patches.set(cuda, "mem_get_info", free_total)
    patches.set(cuda, "empty_cache", memory.empty_cache)
    patches.set(torch.backends.cuda, "is_built", lambda: True)
