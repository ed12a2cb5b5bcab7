"""bitsandbytes' 8-bit and paged optimizers: ``adamw8bit``, ``paged_adamw8bit``, ``paged_adamw32bit``.

>>> optimizer = build("paged_adamw8bit", model.parameters(), {"lr": 1e-3})       # doctest: +SKIP
>>> sorted(optimizer.state[p])                                                    # doctest: +SKIP
['absmax1', 'absmax2', 'qmap1', 'qmap2', 'state1', 'state2', 'step']

bitsandbytes' own classes (``bnb.optim.AdamW8bit``, ``PagedAdamW8bit``, ``PagedAdamW32bit``) run their own
``init_state`` and ``update_step`` (bitsandbytes/optim/optimizer.py, ``Optimizer2State``):

- 8-bit state: ``state1`` and ``state2`` uint8 of the parameter's shape, ``absmax1`` and ``absmax2`` float32, one
  per 256-element block, and the two 256-entry dynamic code tables (``qmap1``, ``qmap2``) shared by every
  parameter; a parameter under ``min_8bit_size`` (4096) elements keeps two float32 states, as in bitsandbytes.
- paged: ``get_state_buffer`` puts the states of a parameter of at least 1e5 elements in CUDA unified memory
  (``functional.get_paged``: ``cudaMallocManaged``), outside PyTorch's caching allocator; smaller ones are
  ordinary. On fake tensors those buffers are fake tensors tagged ``PAGED``: the recorder puts them in the paged
  category, which the allocator replay counts against the card as resident (``estimator.replay.allocator``),
  never in ``torch.cuda.memory_reserved()``.
- The update is ``torch.ops.bitsandbytes.optimizer_update_8bit_blockwise`` / ``optimizer_update_32bit``, in
  place (their fake kernels allocate nothing, nor do the CUDA kernels).

Two host-side steps cannot run on fake tensors and run on the host as bitsandbytes runs them: the code tables
(``fill_qmap``: ``create_dynamic_map`` reads values), and the paged buffer itself (a ``cudaMallocManaged``
pointer), which becomes a fake tensor of its size.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from estimator.errors import MissingExtraError

NAMES = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit", "paged_adamw32bit": "PagedAdamW32bit"}
PAGED = "_batchfit_paged"  # the attribute a paged state buffer carries on fake tensors
PAGED_MIN_NUMEL = 100_000  # Optimizer8bit.get_state_buffer: "p.numel() < 1e5" stays ordinary memory

ASSUMPTION = ("paged optimizer state (bitsandbytes' cudaMallocManaged buffers for parameters of >= 1e5 elements): "
              "outside PyTorch's caching allocator (not in memory_reserved), counted against the card as resident "
              "for the whole step; the driver may page it out to host memory under pressure, which a real run can "
              "survive at a slower step, so a batch that fits only by paging is not reported as fitting")


def is_paged(t: Any) -> bool:
    """Whether ``t`` is a paged optimizer-state buffer made on fake tensors."""
    return bool(getattr(t, PAGED, False))


@cache
def _simulable(name: str) -> type[torch.optim.Optimizer]:
    """bitsandbytes' class ``name``, with its two host-side steps done on the host when the parameters are fake."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise MissingExtraError("peft", f"the {name} optimizer", str(exc)) from exc
    import bitsandbytes.functional as F
    from torch.utils._python_dispatch import _disable_current_modes

    base = getattr(bnb.optim, NAMES[name])

    class Simulable(base):  # type: ignore[misc, valid-type]
        def fill_qmap(self) -> None:
            with _disable_current_modes():  # host tensors, moved to the device by init_state
                self.name2qmap["dynamic"] = F.create_dynamic_map(signed=True)
                self.name2qmap["udynamic"] = F.create_dynamic_map(signed=False)

        def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if isinstance(p, FakeTensor) and p.device.type == "cuda" and self.is_paged \
                    and p.numel() >= PAGED_MIN_NUMEL:
                buff = torch.zeros_like(p, dtype=dtype)  # get_paged + fill(buff, 0): managed memory of these bytes
                setattr(buff, PAGED, True)
                return buff
            return super().get_state_buffer(p, dtype)

        def prefetch_state(self, p: torch.Tensor) -> None:
            if not isinstance(p, FakeTensor):  # cudaMemPrefetchAsync of a paged buffer: no bytes move here
                super().prefetch_state(p)

    Simulable.__name__ = Simulable.__qualname__ = base.__name__
    return Simulable


def build(name: str, params: Iterable[torch.nn.Parameter], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """bitsandbytes' optimizer ``name`` over ``params``."""
    return _simulable(name)(list(params), **kwargs)
