"""DistributedDataParallel's memory on the virtual GPU: its Reducer, in Python.

DDP's gradient buckets live in its C++ ``Reducer``, which cannot run here:
``Reducer::prepare_for_forward`` records CUDA events for its runtime stats
in each of the first iterations, and those need a CUDA driver
(docs/DESIGN.md, fact 15). So ``SimulatedDDP`` does what the Reducer does to
memory, step for step (torch/csrc/distributed/c10d/reducer.cpp), with
PyTorch's own Python pieces where DDP has them:

- construction (``DistributedDataParallel.__init__``): the parameters that
  require grad, each once (``_build_params_for_reducer``); the broadcast of
  the module's state from rank 0 (``torch.distributed.utils._sync_module_states``,
  the real one, whose flattened 250 MiB buckets are allocated and freed);
  one bucket for all of them (``[sys.maxsize]``: with ``find_unused_parameters``
  off DDP does not bucket the first iteration), from
  ``dist._compute_bucket_assignment_by_size``, reversed; the bucket caps from
  DDP's own ``_BucketCapacityConfig`` (``bucket_cap_mb=None``: 25 MiB, the
  first bucket 1 MiB; a number given caps the first bucket too);
- ``initialize_buckets``: one flat tensor per bucket (``at::empty`` of the
  bucket's elements, the parameters' dtype), alive as long as DDP is, and a
  view of it per parameter;
- each gradient as AccumulateGrad makes it (the Reducer's hook is a post
  hook of AccumulateGrad: a post-accumulate-grad hook here): copied into its
  bucket view divided by the world size (``at::mul_out``: no allocation);
  with ``gradient_as_bucket_view`` the parameter's ``.grad`` becomes that view
  and the gradient AccumulateGrad made is freed;
- the bucket's all-reduce is in place (the fake process group does nothing;
  NCCL's own buffers are outside the caching allocator);
- ``finalize_backward`` (a final callback of the backward): without bucket
  views the reduced bucket is copied back into each ``.grad`` (in place);
- ``_rebuild_buckets`` at the second forward (the third with
  ``static_graph``): buckets reassigned in the order the gradients became
  ready in the first backward (not reversed), with the limits
  ``[first cap, cap]``; the old buckets are dropped first (``buckets_.clear()``),
  then the new ones allocated; with bucket views the gradients that still
  view the old buckets keep them alive until each is moved into its new view.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.utils import _sync_module_states
from torch.nn.parallel.distributed import _BucketCapacityConfig

from estimator.simulate.recipe import Distributed

_MB = 1024 * 1024
BROADCAST_BUCKET_BYTES = 250 * _MB  # DistributedDataParallel.broadcast_bucket_size


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        first = params[0]
        # reducer.cpp initialize_buckets: at::empty({offset}, options) of the bucket's dtype and device
        self.gradients = torch.empty(numel, dtype=first.dtype, device=first.device)
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in params:
            # initialize_bucket_views: a view with the parameter's strides when it is dense, else contiguous
            n = p.numel()
            flat = self.gradients.narrow(0, offset, n)
            self.views[id(p)] = flat.as_strided(p.size(), p.stride()) if p.is_contiguous() else flat.view(p.size())
            offset += n


class SimulatedDDP(torch.nn.Module):
    """``DistributedDataParallel(module)`` as memory sees it (this module's docstring): forwards to ``module``."""

    def __init__(self, module: torch.nn.Module, d: Distributed) -> None:
        super().__init__()
        self.module = module
        self.world_size = d.world_size
        self.gradient_as_bucket_view = d.gradient_as_bucket_view
        self.static_graph = d.static_graph
        # DDP's own caps: the first bucket is 1 MiB only when bucket_cap_mb is None (MiB: a float works)
        caps = _BucketCapacityConfig.create(d.bucket_cap_mb, None, False)  # type: ignore[arg-type]
        self.bucket_bytes_cap = caps.bucket_bytes_cap
        self.first_bucket_bytes_cap = caps.first_bucket_bytes_cap
        self.forwards = 0
        params = self._params_for_reducer()
        world = dist.group.WORLD
        assert world is not None  # estimator.simulate.distributed.process_group made it
        _sync_module_states(module=module, process_group=world, broadcast_bucket_size=BROADCAST_BUCKET_BYTES,
                            src=0, params_and_buffers_to_ignore=set(), broadcast_buffers=True)
        indices, _ = dist._compute_bucket_assignment_by_size(list[torch.Tensor](params), [sys.maxsize],
                                                             [False] * len(params))
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._initialize_buckets([[params[i] for i in bucket] for bucket in reversed(indices)])
        self.rebuilt = False
        self._ready_order: list[torch.nn.Parameter] = []  # the first backward's, for the rebuild
        self._in_backward = False
        self._handles = [p.register_post_accumulate_grad_hook(self._autograd_hook) for p in params]

    def _params_for_reducer(self) -> list[torch.nn.Parameter]:
        """DistributedDataParallel._build_params_for_reducer: parameters that require grad, each once."""
        seen: set[int] = set()
        params = []
        for _, m in self.module.named_modules():
            for _, p in m.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _initialize_buckets(self, buckets: list[list[torch.nn.Parameter]]) -> None:
        """reducer.cpp initialize_buckets: ``buckets_.clear()`` first (the old buckets are freed unless
        gradients still view them), then one flat tensor per new bucket."""
        self.buckets, self._bucket_of = [], {}
        new = [_Bucket(params) for params in buckets]
        if self.gradient_as_bucket_view:
            for bucket in new:
                for p in bucket.params:
                    # initialize_bucket_views: a gradient that exists moves into the new view
                    view = bucket.views[id(p)]
                    if p.grad is not None and not _aliases(p.grad, view):
                        view.copy_(p.grad)
                        p.grad = view
        self.buckets = new
        self._bucket_of = {id(p): b for b in new for p in b.params}

    # --- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        buffers = list(self.module.buffers())
        if buffers and torch.is_grad_enabled():
            # _pre_forward -> _sync_buffers (broadcast_buffers, on by default): rank 0's buffers broadcast,
            # flattened into 250 MiB chunks (DistributedDataParallel._default_broadcast_coalesced)
            group = dist.group.WORLD
            assert group is not None
            with torch.no_grad():
                dist._broadcast_coalesced(group, buffers, BROADCAST_BUCKET_BYTES, 0)
        if torch.is_grad_enabled():
            self.forwards += 1
            # _pre_forward -> _rebuild_buckets: at the second forward; with static_graph the first backward's
            # all-reduce is delayed to its end, and the buckets are rebuilt at the third
            if not self.rebuilt and self._ready_order and self.forwards == (3 if self.static_graph else 2):
                self._rebuild_buckets()
        return self.module(*args, **kwargs)

    def _rebuild_buckets(self) -> None:
        """Reducer::rebuild_buckets: the first backward's ready order, [1 MiB, bucket_cap_mb]."""
        order = self._ready_order
        limits = [self.first_bucket_bytes_cap, self.bucket_bytes_cap]
        indices, _ = dist._compute_bucket_assignment_by_size(list[torch.Tensor](order), limits, [False] * len(order))
        self._initialize_buckets([[order[i] for i in bucket] for bucket in indices])
        self.rebuilt = True
        self._ready_order = []

    # --- backward
    def _autograd_hook(self, param: torch.Tensor) -> None:
        """Reducer::autograd_hook -> mark_variable_ready (a post hook of the parameter's AccumulateGrad)."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        if not self.rebuilt and self.forwards == 1:
            self._ready_order.append(param)  # type: ignore[arg-type]  # rebuilt_params_: the first backward's
        bucket = self._bucket_of[id(param)]
        view = bucket.views[id(param)]
        grad = param.grad
        if grad is not None and not _aliases(grad, view):
            # mark_variable_ready_dense: copy_grad_to_bucket, at::mul_out(bucket_view, grad, 1 / world_size)
            torch.mul(grad, 1.0 / self.world_size, out=view)
            if self.gradient_as_bucket_view:
                param.grad = view
        elif grad is not None:
            view.mul_(1.0 / self.world_size)
        del grad
        # a ready bucket is all-reduced in place: nothing allocated through the caching allocator

    def _finalize_backward(self) -> None:
        """Reducer::finalize_backward: with copies (no bucket views) the reduced buckets go back to ``.grad``."""
        self._in_backward = False
        if self.gradient_as_bucket_view:
            return  # the gradients are the buckets
        for bucket in self.buckets:
            for p in bucket.params:
                view = bucket.views[id(p)]
                if p.grad is None:
                    # copy_bucket_to_grad: a gradient made with the layout contract (clone_obey_contract)
                    p.grad = view.clone(memory_format=torch.preserve_format)
                else:
                    p.grad.copy_(view)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata
