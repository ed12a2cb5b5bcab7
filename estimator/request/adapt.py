"""A request converted once into what the layers below take: ``job_of(request)``.

>>> job = job_of(parse_request({"model": {"source": "timm", "name": "resnet18"}, "gpus": ["T4-16GB"]}))
>>> job.recipe.precision, [c.name for c in job.cards], job.plan.headroom
('fp32', ['T4-16GB'], 0.1)

The model section goes to the builders (``estimator.models.build``), the
recipe to the simulation, the cards and ``PlanOptions`` to the planner; no
layer below the pipeline sees the request itself. ``with_changes`` applies a
planner's change (dotted request paths, as a suggestion reports it) to a
request, for the job a search asks about.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from estimator.errors import SpecError
from estimator.gpus import CATALOG, DEFAULT_CONTEXT_BYTES, GPU, custom_gpu, get_gpu
from estimator.models.spec import InputSpec
from estimator.options import AdviceOptions, ConfirmMode, Levers, PlanOptions
from estimator.request.spec import CustomGPUSpec, EstimateRequest
from estimator.simulate.recipe import Distributed, Recipe


@dataclass(frozen=True)
class Job:
    """What each layer takes of one request: ``model`` (the request's model section) and ``input`` for the
    builders, ``recipe`` for the simulation, ``cards`` and ``plan`` for the planner."""

    model: Any
    input: InputSpec
    recipe: Recipe
    cards: list[GPU]
    plan: PlanOptions


def job_of(request: EstimateRequest) -> Job:
    """The request as the layers take it; a bad card name fails here, before any build."""
    if request.training.distributed.world_size == "auto" and request.planner.max_seq_len:
        raise SpecError("planner.max_seq_len", True, "false with training.distributed.world_size 'auto' "
                        "(search the seq_len at an integer world size)")
    return Job(request.model, request.input, recipe_of(request), cards_of(request), plan_of(request))


def recipe_of(request: EstimateRequest) -> Recipe:
    """The request's recipe (over one rank when the world size is ``"auto"``: the planner searches it)."""
    t = request.training
    return Recipe(
        precision=t.precision, optimizer=t.optimizer.name, optimizer_kwargs=t.optimizer.kwargs(),
        gradient_checkpointing=t.gradient_checkpointing, grad_accumulation_steps=t.grad_accumulation_steps,
        zero_grad_set_to_none=t.zero_grad_set_to_none, zero_grad_at=t.zero_grad_at, cudnn_benchmark=t.cudnn_benchmark,
        distributed=_distributed_of(request),
    )


def _distributed_of(request: EstimateRequest) -> Distributed:
    d = request.training.distributed
    return Distributed(
        strategy=d.strategy, world_size=d.world_size if isinstance(d.world_size, int) else 1,
        bucket_cap_mb=d.ddp.bucket_cap_mb, gradient_as_bucket_view=d.ddp.gradient_as_bucket_view,
        static_graph=d.ddp.static_graph, reshard_after_forward=d.fsdp.reshard_after_forward,
        param_dtype=d.fsdp.param_dtype, reduce_dtype=d.fsdp.reduce_dtype,
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


def plan_of(request: EstimateRequest) -> PlanOptions:
    """What the planner is asked: the ``planner`` section, the batch, and the training choices it reads."""
    p, t = request.planner, request.training
    d = t.distributed
    compute, compute_from = _compute_dtype(request)
    advice = AdviceOptions(
        optimizer=t.optimizer.name, compute=compute, compute_from=compute_from, curve_points=p.curve_points,
        efficiency=p.efficiency, ranks=p.data_parallel_ranks, dataset_size=p.dataset_size,
        max_epoch_seconds=p.max_epoch_seconds, target_global_batch=p.target_global_batch, base_lr=p.base_lr,
        base_batch=p.base_batch, batch_schedule=tuple(p.batch_schedule or ()), accumulation=t.grad_accumulation_steps,
    )
    levers = Levers(checkpointing=bool(t.gradient_checkpointing), precision=t.precision, optimizer=t.optimizer.name,
                    momentum=bool(t.optimizer.momentum), foreach=t.optimizer.foreach, strategy=d.strategy,
                    adaptable=_adaptable(request), peft=getattr(request.model, "peft", None) is not None,
                    quantized=getattr(request.model, "quantization", None) is not None)
    return PlanOptions(
        batch_size=request.batch_size, align=p.align, confirm=ConfirmMode(p.confirm), reserve_bytes=p.reserve_bytes,
        headroom=p.headroom, suggestions=p.suggestions, max_seq_len=p.max_seq_len, strategy=d.strategy,
        world_size=d.world_size if isinstance(d.world_size, int) else None,
        grad_accumulation_steps=t.grad_accumulation_steps, zero_grad_at=t.zero_grad_at, advice=advice, levers=levers,
    )


def _adaptable(request: EstimateRequest) -> bool:
    """The model section takes ``peft`` and ``quantization`` (transformers) and the libraries are installed (the
    ``peft`` extra), so that the planner may suggest them."""
    from importlib.util import find_spec

    return "peft" in type(request.model).model_fields and all(find_spec(m) for m in ("peft", "bitsandbytes"))


def _compute_dtype(request: EstimateRequest) -> tuple[str, str]:
    """The dtype the step's matmuls run in and the field that decides it: autocast's or pure bf16's
    (``training.precision``), or FSDP's ``MixedPrecisionPolicy.param_dtype`` under fp32 (the blocks compute in
    it: torchtitan's recipe)."""
    precision = request.training.precision
    param_dtype = request.training.distributed.fsdp.param_dtype
    if precision == "fp32" and param_dtype in ("bf16", "fp16"):
        return param_dtype, f"training.distributed.fsdp.param_dtype {param_dtype}"
    compute = {"amp-bf16": "bf16", "bf16": "bf16", "amp-fp16": "fp16"}.get(precision, "fp32")
    return compute, f"training.precision {precision}"


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


def with_changes(request: EstimateRequest, change: Mapping[str, Any]) -> EstimateRequest:
    """``request`` with each dotted path of ``change`` (``training.distributed.world_size``) set to its value, as
    a suggestion reports it. The planner's changes are valid values of their fields."""
    doc = request.model_dump(mode="json", by_alias=True)
    for path, value in change.items():
        *parents, last = path.split(".")
        at = doc
        for name in parents:
            at = at.setdefault(name, {})
        at[last] = value
    return EstimateRequest.model_validate(doc)
