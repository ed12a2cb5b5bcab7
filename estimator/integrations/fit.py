"""What every drop-in does with the user's model and step: the card, the batches, the planner's answer, the profile.

>>> built = user_model(module, batch_like(first_batch), step_fn=step)            # doctest: +SKIP
>>> fit = fit_batch(built, recipe, card_for("A100-80GB"))
>>> fit.batch_size, fit.result.max_batch_size, fit.report.device_peak_bytes

``fit_batch`` answers one card as ``estimate`` does (``estimator.plan.answer``: the max batch from replays of the
affine trace, checked by a full simulation; the recommended batch with the headroom kept free), over a
``Simulator`` of the user's own step. On the CPU target (no card) nothing is searched: the step is simulated
at the batch the caller gives, and ``report`` is its peak, which tests compare with torch.profiler's.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from estimator import __version__, torch_version
from estimator.errors import MissingExtraError, SpecError, UnknownGPUError
from estimator.gpus import CATALOG_VERSION, GPU, custom_gpu, get_gpu
from estimator.models import BatchFactory, BuiltModel, LossFn, StepFn
from estimator.options import DEFAULT_HEADROOM, AdviceOptions, PlanOptions
from estimator.plan.answer import answer_at, smallest_batch
from estimator.plan.notes import Notes
from estimator.plan.results import EstimateResponse, GPUResult, WarningCode
from estimator.plan.steps import Steps
from estimator.portable.profile import PortableProfile, profile_of
from estimator.replay.report import MemoryReport, report_from_trace
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built
from estimator.simulate.source import Simulator

if TYPE_CHECKING:
    import torch

EXTRA = "integrations"


def require(module: str, feature: str) -> Any:
    """``import module``, or ``MissingExtraError`` naming the ``integrations`` extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(EXTRA, feature, str(exc)) from exc


def card_for(gpu: str | GPU | None, device: torch.device | None = None) -> GPU | None:
    """The card to answer for: a catalog name (any spelling ``get_gpu`` takes) or a ``GPU``; None: the CUDA
    device the run will use (``device``, else torch's current one; a card the catalog lacks is described from
    ``torch.cuda.get_device_properties``), or the CPU target (None) when it uses none."""
    if isinstance(gpu, GPU):
        return gpu
    if gpu is not None:
        return get_gpu(gpu, field="gpu")
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    try:
        return get_gpu(name, field="gpu")
    except UnknownGPUError:
        props = torch.cuda.get_device_properties(device)
        return custom_gpu(name[:64], props.total_memory, f"{props.major}.{props.minor}")


def batch_like(example: Any, size: int | None = None) -> BatchFactory:
    """A batch factory for batches shaped like ``example`` (one batch as the loader yields it, of ``size``
    samples: by default the first tensor's first dimension): each tensor whose first dimension is ``size``
    gets ``b`` rows, the example's own again (``index_select``: a real run trains on real values), every other
    value stays as it is; tensors go to the device. A tensor the example holds twice (``labels`` that are the
    ``input_ids`` themselves) is one tensor in each batch too: the memory differs.

    >>> batch_like({"x": torch.zeros(2, 3), "n": 7})(5, torch.device("cpu"))["x"].shape
    torch.Size([5, 3])
    """
    import torch
    from torch.utils._pytree import tree_leaves, tree_map_only

    tensors = [t for t in tree_leaves(example) if isinstance(t, torch.Tensor) and t.dim()]
    if not tensors:
        raise SpecError("batch", type(example).__name__, "a batch holding at least one tensor with a batch "
                        "dimension")
    n = size if size is not None else tensors[0].shape[0]

    def make(b: int, device: torch.device) -> Any:
        rows = torch.arange(b) % n  # (b,): the example's rows, again and again
        made: dict[int, torch.Tensor] = {}

        def scaled(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                made[id(t)] = (t.index_select(0, rows) if t.dim() and t.shape[0] == n else t).to(device)
            return made[id(t)]

        return tree_map_only(torch.Tensor, scaled, example)

    return make


@dataclass
class Fit:
    """The answer of a drop-in: the batch to train with (``batch_size`` per rank, ``accumulation`` steps), the
    step's memory there (``report``) and, on a card, the card's result as ``estimate`` answers it
    (``result``: max and recommended batch, their memory, the accumulation plan) in its ``response``."""

    card: GPU | None
    recipe: Recipe
    batch_size: int
    accumulation: int
    report: MemoryReport
    result: GPUResult | None = None
    response: EstimateResponse | None = None
    name: str = "model"
    _steps: Steps | None = field(default=None, repr=False)
    _start: int = 1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_steps": None}  # the steps hold the user's code: the answer travels without it

    def save_profile(self, path: str | Path) -> PortableProfile:
        """Write the portable profile of the simulated step to ``path`` (JSON): ``estimate_from_profile`` and
        ``batchfit estimate --profile`` answer it on any card without the model's code."""
        if self.card is None or self._steps is None:
            raise SpecError("gpu", None if self.card is None else self.card.name,
                            "a card, in the process that simulated the step (a profile holds a card's steps)")
        steps = self._steps
        source = steps.source
        assert isinstance(source, Simulator)
        versions = {"batchfit": __version__, "torch": torch_version(), "catalog": CATALOG_VERSION}
        profile = profile_of(steps, source.backend_key, [self.card], self._start,
                             request=request_of(self.name, self.recipe), versions=versions)
        Path(path).write_text(json.dumps(profile.to_json()))
        return profile


def fit_batch(built: BuiltModel, recipe: Recipe, card: GPU | None, *, batch_size: int | None = None,
              headroom: float | None = None, target_global_batch: int | None = None,
              max_val: int | None = None) -> Fit:
    """The batch for ``built`` trained with ``recipe`` on ``card`` (module docstring): the recommended one,
    at most ``max_val``; with ``target_global_batch``, the accumulation plan's micro-batch and steps over the
    recipe's ranks. ``batch_size`` given: the step's memory there (the answer still searched on a card)."""
    if card is None:
        if batch_size is None:
            raise SpecError("gpu", None, "a catalog name or a GPU: this run uses no CUDA device, and the CPU "
                            "target predicts the step at a batch you give, with no card to fit a batch to")
        trace = record_built(built, batch_size, recipe, None)
        return Fit(None, recipe, batch_size, recipe.grad_accumulation_steps, report_from_trace(trace, batch_size,
                                                                                                None),
                   name=built.name)
    t0 = time.perf_counter()
    d = recipe.distributed
    options = PlanOptions(
        batch_size=batch_size, headroom=DEFAULT_HEADROOM if headroom is None else headroom, suggestions=False,
        strategy=d.strategy, world_size=d.world_size, grad_accumulation_steps=recipe.grad_accumulation_steps,
        zero_grad_at=recipe.zero_grad_at,
        advice=AdviceOptions(optimizer=recipe.optimizer, ranks=d.world_size, target_global_batch=target_global_batch))
    source = Simulator(built, recipe)
    source.prefetch_second(2, card)  # every search needs batch 2 (a fit point, or the start)
    steps, notes = Steps(source, options.reserve_bytes), Notes()
    start = smallest_batch(steps, card, notes)
    response = answer_at(steps, [card], options, start, notes, t0)
    result = response.results[0]
    if result.recommended_batch_size is None:
        why = notes.find(WarningCode.DOES_NOT_FIT) or notes.find(WarningCode.NO_RECOMMENDATION)
        raise SpecError("gpu", card.name, f"a card the step fits on with {options.headroom:.0%} headroom "
                        f"({why.message if why else 'no batch is recommended'})")
    batch, accumulation = result.recommended_batch_size, recipe.grad_accumulation_steps
    if target_global_batch is not None and result.accumulation is not None:
        batch, accumulation = result.accumulation.micro_batch, result.accumulation.steps
    if max_val is not None and batch > max_val:
        batch = max_val
        if target_global_batch is not None:
            accumulation = -(-target_global_batch // (batch * d.world_size))
    chosen = batch_size or batch
    return Fit(card, recipe, chosen, accumulation, steps.report(chosen, card, exact=False), result, response,
               built.name, steps, start)


def fit_step(model: Any, batch_factory: BatchFactory, loss_fn: LossFn | None = None, *,
             step_fn: StepFn | None = None, recipe: Recipe | None = None, gpu: str | GPU | None = "A100-80GB",
             headroom: float | None = None, target_global_batch: int | None = None) -> Fit:
    """Plain PyTorch's drop-in: ``estimate_memory``'s model and step (an instance or a factory; ``loss_fn`` or
    ``step_fn``) answered on a card as the frameworks' are, the recommended batch and the card's result, and
    ``save_profile`` for a scheduler.

    >>> fit = fit_step(my_module, make_batch, step_fn=my_step, gpu="H100-80GB")        # doctest: +SKIP
    >>> fit.result.recommended_batch_size, fit.save_profile("job.profile.json")
    """
    from estimator.models.user import user_model

    card = card_for(gpu)
    return fit_batch(user_model(model, batch_factory, loss_fn, step_fn=step_fn), recipe or Recipe(), card,
                     headroom=headroom, target_global_batch=target_global_batch)


def request_of(name: str, recipe: Recipe) -> dict[str, Any]:
    """The request a profile carries for the user's step: the recipe in the request's words, the model a
    label (``custom``: a profile's request is never built)."""
    from estimator.request.parse import parse_request

    d = recipe.distributed
    optimizer_fields = ("foreach", "fused", "momentum", "nesterov", "amsgrad", "centered", "weight_decay")
    training: dict[str, Any] = {
        "precision": recipe.precision, "gradient_checkpointing": recipe.gradient_checkpointing,
        "optimizer": {"name": recipe.optimizer, **{k: v for k, v in recipe.optimizer_kwargs.items()
                                                   if k in optimizer_fields and v is not None}},
        "grad_accumulation_steps": recipe.grad_accumulation_steps, "zero_grad_at": recipe.zero_grad_at,
        "zero_grad_set_to_none": recipe.zero_grad_set_to_none,
        "distributed": {"strategy": d.strategy, "world_size": d.world_size,
                        "ddp": {"bucket_cap_mb": d.bucket_cap_mb, "gradient_as_bucket_view": d.gradient_as_bucket_view,
                                "static_graph": d.static_graph},
                        "fsdp": {"reshard_after_forward": d.reshard_after_forward, "param_dtype": d.param_dtype,
                                 "reduce_dtype": d.reduce_dtype}}}
    label = name if ":" in name else f"user:{name}"
    doc = {"model": {"source": "custom", "factory": label}, "training": training, "planner": {"suggestions": False}}
    request = parse_request(doc, allow_local_code=True)
    return request.model_dump(mode="json", exclude={"gpus", "batch_size"})
