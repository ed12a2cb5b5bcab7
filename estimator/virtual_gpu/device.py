"""``torch.cuda`` queries answered for the target card.

Library code asks ``torch.cuda`` what it runs on (GradScaler, autocast,
``is_bf16_supported``, SDPA backend checks). Inside the virtual GPU those
answers describe the target card, and the memory counters read the trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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


def patch_cuda_queries(
    patches: Patches,
    props: DeviceProperties,
    allocated: Callable[[], int],
    peak: Callable[[], int],
    reset_peak: Callable[[], None],
) -> None:
    """Answer ``torch.cuda``'s device and memory queries for ``props``."""
    cuda = torch.cuda
    capability = (props.major, props.minor)
    patches.set(cuda, "is_available", lambda: True)
    patches.set(cuda, "device_count", lambda: 1)
    patches.set(cuda, "current_device", lambda: 0)
    patches.set(cuda, "is_initialized", lambda: True)
    patches.set(cuda, "_lazy_init", lambda: None)
    patches.set(cuda, "synchronize", lambda device=None: None)
    patches.set(cuda, "get_device_properties", lambda device=None: props)
    patches.set(cuda, "get_device_capability", lambda device=None: capability)
    patches.set(cuda, "get_device_name", lambda device=None: props.name)
    patches.set(cuda, "is_bf16_supported", lambda including_emulation=True: props.major >= 8)
    patches.set(cuda, "memory_allocated", lambda device=None: allocated())
    patches.set(cuda, "max_memory_allocated", lambda device=None: peak())
    patches.set(cuda, "reset_peak_memory_stats", lambda device=None: reset_peak())
    patches.set(cuda, "mem_get_info", lambda device=None: (props.total_memory - allocated(), props.total_memory))
    patches.set(cuda, "empty_cache", lambda: None)
    patches.set(torch.backends.cuda, "is_built", lambda: True)
