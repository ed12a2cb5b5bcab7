"""``Module._apply`` (``.to``, ``.float()``, ``.cuda()``) on fake parameters, as on a card's real ones.

On real CUDA parameters ``Module._apply`` sets the converted tensor into the parameter in place
(``param.data = fn(param)``: the same Parameter object, the optimizer's reference stays valid; a no-op when
``fn`` returns the parameter itself). On a ``FakeTensor`` parameter torch takes another path:
``torch.utils.swap_tensors``, which refuses a tensor that has a weakref, and every fake tensor the fake mode
made has one (its MetaConverter's ``tensor_memo``). A model that converts a submodule inside its forward
(switch_transformers' router: ``self.classifier = self.classifier.to(self.dtype)``) would then fail on the
virtual GPU where the card runs it. The patch gives fake parameters the real tensors' path; everything else
(meta parameters at ``materialize``, buffers, children) goes through torch's own ``_apply``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _settable(tensor: Any, applied: Any) -> bool:
    """``applied`` can go into fake ``tensor`` with ``.data =`` (a fake tensor of a compatible kind)."""
    return (isinstance(tensor, FakeTensor) and isinstance(applied, FakeTensor)
            and not is_traceable_wrapper_subclass(applied))


def module_apply(original: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """A ``Module._apply`` that converts fake parameters (and their grads) in place, then calls ``original``
    on the rest of the module with those parameters hidden from it."""

    def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> torch.nn.Module:
        if recurse:
            for module in self.children():
                module._apply(fn)
        done: list[str] = []
        for key, param in self._parameters.items():
            if not isinstance(param, FakeTensor):
                continue
            with torch.no_grad():
                applied = fn(param)
            if not _settable(param, applied):
                continue  # torch's own path (and its error)
            if applied is not param:
                param.data = applied
            grad = param.grad
            if grad is not None:
                with torch.no_grad():
                    grad_applied = fn(grad)
                if grad_applied is not grad:
                    if not _settable(grad, grad_applied):
                        raise RuntimeError(f"_apply(): cannot convert {self._get_name()}.{key}.grad in place")
                    grad.data = grad_applied
            done.append(key)
        if not done:
            return original(self, fn, recurse=False)
        params = self._parameters
        object.__setattr__(self, "_parameters", {k: p for k, p in params.items() if k not in done})
        try:
            original(self, fn, recurse=False)
        finally:
            rest = self._parameters
            object.__setattr__(self, "_parameters", params)
            params.update(rest)  # what torch's path put in (a new Parameter for a non-fake one)
        return self

    return _apply
