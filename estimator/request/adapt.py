"""A parsed request as the layers below take it: a ``Recipe``, the cards, the planner's options."""

from __future__ import annotations

from typing import Any

from estimator.errors import SpecError
from estimator.gpus import CATALOG, DEFAULT_CONTEXT_BYTES, GPU, custom_gpu, get_gpu
from estimator.plan.advice import AdviceOptions
from estimator.plan.strategy import ConfirmMode
from estimator.request.recipe import Distributed, Recipe
from estimator.request.spec import CustomGPUSpec, EstimateRequest


def recipe_of(request: EstimateRequest, world_size: int | None = None) -> Recipe:
    """The request's recipe; over ``world_size`` ranks when given (a request's ``"auto"`` is searched by the
    pipeline: without ``world_size`` it stands for 1 here)."""
    t = request.training
    return Recipe(
        precision=t.precision, optimizer=t.optimizer.name, optimizer_kwargs=t.optimizer.kwargs(),
        gradient_checkpointing=t.gradient_checkpointing, grad_accumulation_steps=t.grad_accumulation_steps,
        zero_grad_set_to_none=t.zero_grad_set_to_none, zero_grad_at=t.zero_grad_at, cudnn_benchmark=t.cudnn_benchmark,
        distributed=distributed_of(request, world_size),
    )


def distributed_of(request: EstimateRequest, world_size: int | None = None) -> Distributed:
    d = request.training.distributed
    if world_size is None:
        world_size = d.world_size if isinstance(d.world_size, int) else 1
    return Distributed(
        strategy=d.strategy, world_size=world_size, bucket_cap_mb=d.ddp.bucket_cap_mb,
        gradient_as_bucket_view=d.ddp.gradient_as_bucket_view, static_graph=d.ddp.static_graph,
        reshard_after_forward=d.fsdp.reshard_after_forward, param_dtype=d.fsdp.param_dtype,
        reduce_dtype=d.fsdp.reduce_dtype,
    )


def cards_of(request: EstimateRequest) -> list[GPU]:
    """The request's cards (the whole catalog when it names none); a bad name fails here, before any build."""
    if request.gpus is None:
        return list(CATALOG.values())
    cards = []
    for i, g in enumerate(request.gpus):
        if isinstance(g, CustomGPUSpec):
            ctx = g.context_bytes if g.context_bytes is not None else DEFAULT_CONTEXT_BYTES
            cards.append(custom_gpu(g.name, g.memory_bytes, g.compute_capability, ctx))
        else:
            cards.append(get_gpu(g, field=f"gpus[{i}]"))
    return cards


def advice_options(request: EstimateRequest, resolved_input: dict[str, Any], ranks: int | None = None) -> AdviceOptions:
    """The planner's options; ``ranks``: the world size of a distributed request (the data-parallel ranks)."""
    plan = request.planner
    return AdviceOptions(
        optimizer=request.training.optimizer.name, low_precision=request.training.precision != "fp32",
        curve_points=plan.curve_points, efficiency=plan.efficiency, ranks=ranks or plan.data_parallel_ranks,
        dataset_size=plan.dataset_size, max_epoch_seconds=plan.max_epoch_seconds,
        target_global_batch=plan.target_global_batch, base_lr=plan.base_lr, base_batch=plan.base_batch,
        seq_len=resolved_input.get("seq_len"),  # a profile's input has every field, null ones too
    )


def with_planner(request: EstimateRequest, **changes: Any) -> EstimateRequest:
    """``request`` with the ``planner`` fields in ``changes`` that are not None replaced."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if "confirm" in changes:
        try:
            changes["confirm"] = ConfirmMode(changes["confirm"])
        except ValueError:
            raise SpecError("confirm", changes["confirm"], "one of 'top', 'every-card', 'none' (true and false, "
                            "before 0.3.0, are 'every-card' and 'none')") from None
    if not changes:
        return request
    return request.model_copy(update={"planner": request.planner.model_copy(update=changes)})
