"""Data-parallel training on the virtual GPU: one rank of DDP, FSDP2 or ZeRO-1, under a fake process group.

>>> with process_group(Distributed("fsdp", 8)):                         # doctest: +SKIP
...     shard(meta_model, Distributed("fsdp", 8), "cuda")               # fully_shard per block, then the root

A simulation stands for one rank. PyTorch's own distributed code runs on it:
``fully_shard`` (FSDP2, with its all-gather and reduce-scatter buffers on
their own streams), ``ZeroRedundancyOptimizer`` and DDP's construction
(``_sync_module_states``, ``_compute_bucket_assignment_by_size``), under
torch's fake process group (``init_process_group("fake")`` with a
``FakeStore``: collectives return at once, their outputs allocated by the
caller as the real ones are). DDP's C++ Reducer cannot run without a CUDA
driver; ``ddp.SimulatedDDP`` does what it does to memory.

Which rank: ranks are alike under DDP; under FSDP2 every rank holds padded
shards of the same size, but the last rank's shards of a parameter whose
first dimension does not divide are short (or empty), so with uneven shards
rank 0 and the last rank are both candidates; under ZeRO-1 the rank whose
partition (``ZeroRedundancyOptimizer``'s own greedy split) holds the most
parameters keeps the most optimizer state. ``candidate_ranks`` names them;
the simulator keeps the one whose step needs more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from estimator.errors import SimulationError
from estimator.simulate.recipe import Distributed

# NCCL's docs (Environment Variables, NCCL_BUFFSIZE): "default is 4194304 (4 MiB)" per channel and peer,
# allocated by NCCL with cudaMalloc, outside PyTorch's caching allocator.
NCCL_ASSUMPTION = ("NCCL's own buffers are not in the prediction: NCCL allocates them with cudaMalloc, outside "
                   "PyTorch's caching allocator (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer; "
                   "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize); keep "
                   "planner.reserve_bytes above them")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


@contextlib.contextmanager
def process_group(d: Distributed) -> Iterator[None]:
    """torch's fake process group as rank ``d.rank`` of ``d.world_size``, for the block; destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise SimulationError("a torch.distributed process group is already initialized in this process; a "
                              "distributed simulation makes its own fake one", "setup")
    dist.init_process_group("fake", rank=d.rank, world_size=d.world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def job_group_set_aside() -> Iterator[None]:
    """Inside a rank of a real job (a launched Lightning DDP run): the job's process groups put aside for the
    block, so that simulations make their fake ones (``process_group``), then put back.

    torch keeps the default group on ``distributed_c10d._world`` and its registry in module-level maps; a fake
    group's ``destroy_process_group`` empties them and unregisters every group name torch's C++ side resolves
    (functional collectives, DTensor), so the job's names are registered again after. No collective of the job
    may run inside: its other ranks wait (within the job's timeout) until the block ends.
    """
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    maps: list[Any] = [world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.tags_to_pg,
            world.pg_to_tag, world.pg_coalesce_state]
    default, saved = world.default_pg, [dict(m) for m in maps]
    world.default_pg = None
    for m in maps:
        m.clear()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        world.default_pg = default
        for m, kept in zip(maps, saved, strict=True):
            m.clear()
            m.update(kept)
        for group, name in saved[1].items():
            _register_process_group(name, group)


def blocks_of(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]] | None:
    """The transformer blocks as checkpointing finds them (transformers' decoder layers, else the largest
    ModuleList/Sequential's entries), and where they are."""
    from estimator.simulate.checkpointing import find_blocks

    found = find_blocks(model)
    if found is None:
        return None
    where, blocks = found
    return where, [b for _, b in blocks]


def mesh_for(d: Distributed, device_type: str) -> Any:
    """The 1-D device mesh of the world (made outside the virtual GPU: DeviceMesh reads its rank tensor)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (d.world_size,))


def shard(model: torch.nn.Module, d: Distributed, mesh: Any) -> str:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each block (the last one not resharded after
    forward when the others are: FSDP would gather it again at once for backward), then on the root.
    Returns the assumption to report. The model may be on the meta device (then ``to_empty`` it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    found = blocks_of(model)
    name, blocks = found if found is not None else ("none found: the root is one unit", [])
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(d.param_dtype), reduce_dtype=torch_dtype(d.reduce_dtype))
    raf = d.reshard_after_forward
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=False if last and raf is True else raf, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    how = {True: "freed after each block's forward, gathered again in backward",
           False: "kept from forward to backward"}.get(raf, f"resharded to {raf} ranks after forward")  # type: ignore
    dtypes = ""
    if d.param_dtype or d.reduce_dtype:
        dtypes = f"; compute in {d.param_dtype or 'the parameter dtype'}, gradients reduced in " \
                 f"{d.reduce_dtype or 'the parameter dtype'} (MixedPrecisionPolicy, no autocast)"
    if not blocks:
        return (f"fsdp: fully_shard (FSDP2) on the root only (the model has no ModuleList/Sequential of blocks), "
                f"over {d.world_size} ranks: all its parameters are gathered for the forward and again for the "
                f"backward{dtypes}")
    return (f"fsdp: fully_shard (FSDP2) on each of {len(blocks)} blocks ({name}) and on the root, "
            f"over {d.world_size} ranks; gathered parameters {how} (the last block's kept, as torchtitan "
            f"does){dtypes}")


def replicate(model: torch.nn.Module, d: Distributed, simulated: bool) -> tuple[torch.nn.Module, str]:
    """DDP around ``model``: the simulated Reducer on the virtual GPU, the real one on a real device."""
    caps = "25 MiB (the first 1 MiB)" if d.bucket_cap_mb is None else f"{d.bucket_cap_mb:g} MiB"
    how = (f"{d.strategy}: DistributedDataParallel over {d.world_size} ranks; one gradient bucket in the first "
           f"iteration, then buckets of {caps} in the order gradients became ready"
           + ("; gradients are views into the buckets" if d.gradient_as_bucket_view else
              "; the buckets hold a second copy of the gradients (gradient_as_bucket_view: false)"))
    if simulated:
        from estimator.simulate.distributed.ddp import SimulatedDDP

        return SimulatedDDP(model, d), how
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=d.bucket_cap_mb, static_graph=d.static_graph,
                                   gradient_as_bucket_view=d.gradient_as_bucket_view), how


def gathered_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameters of ``model`` (its all-gather outputs, freed and refilled in place each
    step), once the first forward has made them."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(t for fp in group.fsdp_params for t in fp.all_gather_outputs)
    return out


def gradient_buckets(model: torch.nn.Module) -> list[torch.Tensor]:
    """DDP's gradient buckets (of the simulated Reducer), the ones alive now."""
    from estimator.simulate.distributed.ddp import SimulatedDDP

    return [b.gradients for b in model.buckets] if isinstance(model, SimulatedDDP) else []


def zero_optimizer(cls: type[torch.optim.Optimizer], params: list[torch.nn.Parameter],
                   kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer`` over ``cls``: this rank keeps the state of its partition only."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)


def uneven_shards(model: torch.nn.Module, world_size: int) -> bool:
    """Whether FSDP2's dim-0 shards of some parameter differ between ranks (padding on the last ones)."""
    return any(p.dim() > 0 and p.size(0) % world_size for p in model.parameters())


def zero_partition_sizes(model: torch.nn.Module, world_size: int) -> list[int]:
    """Parameters per rank under ``ZeroRedundancyOptimizer``'s greedy split (largest first, to the rank
    with the fewest so far): torch's ``_partition_parameters``, run on the meta model."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [p for p in model.parameters() if p.requires_grad]
    with process_group(Distributed("zero1", world_size)):
        zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
        partition = zero._partition_parameters()  # type: ignore[attr-defined]  # torch's own split
        return [sum(p.numel() for group in rank for p in group["params"]) for rank in partition]


def candidate_ranks_of(factory: Any, d: Distributed) -> list[int]:
    """``candidate_ranks`` of the model ``factory`` builds (on the meta device); [0] for one GPU."""
    if not d.active or d.world_size == 1 or d.strategy == "ddp":
        return [0]
    from estimator.models.meta import build_on_meta

    return candidate_ranks(build_on_meta(factory), d)


def candidate_ranks(model: torch.nn.Module, d: Distributed) -> list[int]:
    """The ranks whose step may need the most memory (module docstring); the first is tried first."""
    last = d.world_size - 1
    if d.world_size == 1:
        return [0]
    if d.shards:
        return [0, last] if uneven_shards(model, d.world_size) else [0]
    if d.strategy == "zero1":
        sizes = zero_partition_sizes(model, d.world_size)
        return [max(range(len(sizes)), key=lambda r: (sizes[r], -r))]
    return [0]
