"""The estimate request (docs/API.md; the service serves its schema at ``GET /docs``), composed of the layers'
sections: ``model`` from the model sources, ``input`` from the builders, ``training`` in the recipe's
vocabulary, the bounds and defaults of ``estimator.options``; and the rules the schema cannot state
(``check_request``).

>>> req = EstimateRequest.model_validate({"model": {"source": "torchvision", "name": "resnet18"}})
>>> req.training.precision, req.gpus
('fp32', None)

``estimator.request.parse`` turns JSON into a checked request (or a ``SpecError``), ``estimator.request.adapt``
turns a request into what the layers below take (``job_of``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from estimator.errors import SpecError
from estimator.gpus import CUSTOM_NAME_PATTERN, DEFAULT_CONTEXT_BYTES, custom_name_problem
from estimator.models.registry import model_spec_type, source_of, sources
from estimator.models.spec import STRICT as _STRICT
from estimator.models.spec import InputSpec
from estimator.options import (
    DEFAULT_EFFICIENCY,
    DEFAULT_HEADROOM,
    DEFAULT_RESERVE_BYTES,
    MAX_BASE_LR,
    MAX_BATCH,
    MAX_CARDS,
    MAX_GLOBAL_BATCH,
    MAX_JSON_DEPTH,
    MAX_STAGES,
    MAX_WORLD_SIZE,
    ConfirmMode,
)
from estimator.simulate.recipe import Checkpointing, LowPrecision, OptimizerName, Precision, Strategy, ZeroGradAt

# The request's ``model``: one branch per registered source (estimator/models/registry.py).
if TYPE_CHECKING:
    ModelSpec = Any
else:
    ModelSpec = model_spec_type()


class OptimizerSpec(BaseModel):
    model_config = _STRICT
    name: OptimizerName = "adamw"
    foreach: bool | None = Field(None, description="null: PyTorch's default on a real GPU")
    fused: bool | None = None
    momentum: float | None = Field(None, ge=0.0)
    nesterov: bool | None = None
    amsgrad: bool | None = None
    centered: bool | None = None
    weight_decay: float | None = Field(None, ge=0.0)

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None}


class DDPSpec(BaseModel):
    model_config = _STRICT
    bucket_cap_mb: float | None = Field(None, gt=0, le=65536, description="DistributedDataParallel's "
                                        "bucket_cap_mb; null: DDP's default, 25 MiB buckets after a first one "
                                        "of 1 MiB (a number given caps the first bucket too, as in DDP)")
    gradient_as_bucket_view: bool = Field(False, description="gradients are views into the buckets: no "
                                          "second copy of the gradients")
    static_graph: bool = False


class FSDPSpec(BaseModel):
    model_config = _STRICT
    reshard_after_forward: bool | int = Field(True, description="fully_shard's: true frees each block's gathered "
                                              "parameters after its forward (gathered again in backward); false "
                                              "keeps them; an int reshards to that many ranks")
    param_dtype: LowPrecision | None = Field(None, description="MixedPrecisionPolicy.param_dtype: the dtype "
                                             "blocks compute in (null: the parameters' own); with it set, "
                                             "training.precision must be 'fp32' (no autocast)")
    reduce_dtype: LowPrecision | None = Field(None, description="MixedPrecisionPolicy.reduce_dtype: the "
                                              "gradients' reduce-scatter dtype (null: the parameters' own)")
    wrap: Literal["blocks"] = Field("blocks", description="fully_shard on each transformer block (the largest "
                                    "ModuleList/Sequential's entries), then on the root, as torchtitan does")


class DistributedSpec(BaseModel):
    model_config = _STRICT
    strategy: Strategy = Field("none", description="'none' (one GPU), 'ddp', 'fsdp' (FSDP2) or 'zero1' (DDP + "
                               "ZeroRedundancyOptimizer)")
    world_size: int | Literal["auto"] = Field(
        1, description=f"ranks (1 to {MAX_WORLD_SIZE}), or 'auto': the fewest at which batch 1 fits each card")
    ddp: DDPSpec = Field(default_factory=DDPSpec, description="with strategy 'ddp' or 'zero1'")
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec, description="with strategy 'fsdp'")

    @field_validator("world_size")
    @classmethod
    def _world(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_WORLD_SIZE:
            raise ValueError(f"an integer from 1 to {MAX_WORLD_SIZE}, or 'auto'")
        return v


class TrainingSpec(BaseModel):
    model_config = _STRICT
    precision: Precision = "fp32"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    gradient_checkpointing: Checkpointing = False
    grad_accumulation_steps: int = Field(1, ge=1, le=4096)
    zero_grad_set_to_none: bool = True
    zero_grad_at: ZeroGradAt = Field(
        "step-start", description="where optimizer.zero_grad() runs: 'step-start' (before the forward; HF "
        "Trainer, timm) or 'after-forward' (between the loss and backward: Lightning's automatic optimization, "
        "many scripts), which keeps the previous step's gradients alive through the forward")
    cudnn_benchmark: bool = Field(False, description="torch.backends.cudnn.benchmark (default false, as in "
                                  "PyTorch): the first step of each convolution shape times cuDNN's plans, then "
                                  "empties the allocator's cache")
    distributed: DistributedSpec = Field(default_factory=DistributedSpec, description="data-parallel training "
                                         "over several GPUs: the answers are per rank")


class CustomGPUSpec(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=CUSTOM_NAME_PATTERN,
                      description="not a catalog card's name or description, in any case", examples=["my-card"])
    memory_bytes: int = Field(ge=2**20, le=2**44, description="capacity as nvidia-smi reports it")
    compute_capability: str = Field("8.0", pattern=r"^\d{1,2}\.\d$", examples=["8.0"])
    context_bytes: int | None = Field(None, ge=0, le=2**36,
                                      description=f"CUDA context; default {DEFAULT_CONTEXT_BYTES // 2**20} MiB")

    @field_validator("name")
    @classmethod
    def _not_a_catalog_name(cls, v: str) -> str:
        problem = custom_name_problem(v)
        if problem:
            raise ValueError(problem)
        return v


def _gpu_kind(value: Any) -> str | None:
    """A ``gpus`` entry's branch by its JSON type, so an error names the field of the branch it was meant for."""
    if isinstance(value, str):
        return "str"
    return "CustomGPUSpec" if isinstance(value, (dict, CustomGPUSpec)) else None


GPUEntry = Annotated[
    Annotated[str, Tag("str")] | Annotated[CustomGPUSpec, Tag("CustomGPUSpec")],
    Discriminator(_gpu_kind, custom_error_type="gpu_entry", custom_error_message=(
        "a valid string or an object {name, memory_bytes, compute_capability}: a catalog name or a custom card")),
]


class PlannerSpec(BaseModel):
    model_config = _STRICT
    align: bool = Field(True, description="round the recommendation down to a multiple of 8 when it costs < 10%")
    confirm: ConfirmMode = Field(
        ConfirmMode.TOP, strict=False, description="how the affine trace's answers are confirmed by full "
        "simulations: 'top' (one per group of cards sharing a trace, just past the group's largest max, must "
        "equal the synthesized step exactly), 'every-card' (at every card's max and max + 1), 'none' (the fit "
        "is checked at one more batch only)")
    reserve_bytes: int = Field(DEFAULT_RESERVE_BYTES, ge=0, le=2**40,
                               description="kept free on every card besides the CUDA context (safety margin)")
    headroom: float = Field(DEFAULT_HEADROOM, ge=0.0, lt=1.0, examples=[0.10], description=(
        "recommended_batch_size is the largest batch that fits with its device peak (reserved + CUDA context) "
        "at most (1 - headroom) of the usable memory (capacity - CUDA context - reserve_bytes); max_batch_size "
        "stays the simulator's exact answer. 0.10 covers the largest error seen against published runs (+11 %)"))
    curve_points: int = Field(10, ge=0, le=50, description="about this many batch sizes in the memory curve "
                              "(powers of two, then 3 x 2^k, up to the max; 0: no curve)")
    data_parallel_ranks: int = Field(1, ge=1, le=65536)
    target_global_batch: int | None = Field(None, ge=1, le=MAX_GLOBAL_BATCH,
                                            description="plan accumulation for this batch")
    base_lr: float | None = Field(None, gt=0, le=MAX_BASE_LR, description="a learning rate tuned at base_batch "
                                  "(with batch_schedule, at its first stage when base_batch is not given)")
    base_batch: int | None = Field(None, ge=1, le=2**30)
    batch_schedule: list[Annotated[int, Field(ge=1, le=MAX_GLOBAL_BATCH)]] | None = Field(
        None, min_length=1, max_length=MAX_STAGES, examples=[[256, 512, 1024, 2048, 4096]], description=(
            "global batch sizes, one per stage of a schedule that grows the batch: per card and stage "
            "results[].batch_schedule gives the micro-batch (at most the recommended batch) x accumulation x "
            "ranks that reaches it, the step time and, with base_lr, the learning rate; from the same steps as "
            "the rest of the answer (no simulation of its own)"))
    dataset_size: int | None = Field(None, ge=1, le=2**48, description="samples per epoch")
    max_epoch_seconds: float | None = Field(None, gt=0)
    efficiency: float = Field(DEFAULT_EFFICIENCY, gt=0, le=1,
                              description="fraction of the card's peak FLOP/s a step reaches")
    max_seq_len: bool = Field(False, description="text models: also search the largest seq_len that fits at "
                              "batch_size (or the smallest batch); full simulations, slower")
    suggestions: bool = Field(True, description="when the smallest batch does not fit a card on one GPU, search "
                              "the cheapest changes that make it fit (results[].suggestions; several full "
                              "simulations, an FSDP world search among them); false skips them")


class EstimateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, allow_inf_nan=False)
    model: ModelSpec = Field(description="the model to train, by its source: 'transformers' (a preset or an inline "
                             "config.json), 'torchvision' or 'timm' (a registry name); GET /models lists the names")
    input: InputSpec = Field(default_factory=InputSpec, description="one sample's shape: seq_len for text models, "
                             "image_size (and num_frames, num_objects) for vision models; a field left out is the "
                             "model's default, named in the answer's assumptions")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="how the step trains: precision, "
                                   "optimizer, gradient checkpointing, accumulation, data-parallel strategy")
    gpus: list[GPUEntry] | None = Field(
        None, min_length=1, max_length=MAX_CARDS, description="catalog names or custom cards; null: the whole catalog")
    batch_size: int | None = Field(None, ge=1, le=MAX_BATCH, description="also report memory at exactly this batch")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="how the answer is searched and what "
                                 "it adds: headroom and alignment of the recommendation, confirmations, the memory "
                                 "curve, accumulation, learning-rate and epoch-time advice, suggestions")
    validate_step: bool = Field(False, alias="validate", description="on a GPU node: also run one real CUDA step "
                                "at the first card's max batch and report it measured (503 without a GPU)")


def check_request(req: EstimateRequest, *, allow_local_code: bool = False) -> EstimateRequest:
    """The rules the schema cannot state, on a request pydantic already validated (FastAPI's body):
    no local code unless allowed, and the request names only what its model source allows (each source's
    ``check_names``: allow-lists, a preset or a config, no paths or URLs; estimator/models/allowed.py)."""
    source = source_of(req.model)
    if source.local_code and not allow_local_code:
        remote = [name for name, s in sources().items() if not s.local_code]
        raise SpecError("model.source", source.name, f"{', '.join(remote[:-1])} or {remote[-1]} ({source.name} "
                        "factories run only from the library or the CLI's --model, never from a request)")
    for name in ("config", "kwargs"):
        if isinstance(getattr(req.model, name, None), dict):
            _check_json(getattr(req.model, name), f"model.{name}", 0)
    source.check_names(req.model)
    _check_distributed(req)
    return req


def _check_distributed(req: EstimateRequest) -> None:
    """A distributed section that says what it means: options only for their strategy, one world size."""
    d = req.training.distributed
    path = "training.distributed"
    if d.strategy == "none":
        if d.world_size != 1:
            raise SpecError(f"{path}.world_size", d.world_size, "1 with strategy 'none' (name a strategy: ddp, "
                            "fsdp or zero1)")
    # options other than the defaults only for their strategy (a dumped request, a profile's, names them all)
    if d.fsdp != FSDPSpec() and d.strategy != "fsdp":
        raise SpecError(f"{path}.fsdp", d.fsdp.model_dump(), f"no fsdp options with strategy '{d.strategy}'")
    if d.ddp != DDPSpec() and d.strategy not in ("ddp", "zero1"):
        raise SpecError(f"{path}.ddp", d.ddp.model_dump(), f"no ddp options with strategy '{d.strategy}'")
    raf = d.fsdp.reshard_after_forward
    if not isinstance(raf, bool):
        if raf < 1:
            raise SpecError(f"{path}.fsdp.reshard_after_forward", raf, "true, false or an integer >= 1")
        if d.world_size == "auto":
            raise SpecError(f"{path}.fsdp.reshard_after_forward", raf, "true or false with world_size 'auto' (an "
                            "integer must divide the world size, which the search varies)")
        if raf > d.world_size or d.world_size % raf:
            raise SpecError(f"{path}.fsdp.reshard_after_forward", raf,
                            f"true, false, or a divisor of world_size ({d.world_size})")
    if d.fsdp.param_dtype is not None and req.training.precision != "fp32":
        raise SpecError("training.precision", req.training.precision, "'fp32' with fsdp.param_dtype set: FSDP2 "
                        "casts for compute without autocast, and keeps the sharded parameters and the optimizer "
                        "state in fp32 (torchtitan's recipe)")
    if req.validate_step and d.strategy != "none":
        raise SpecError("validate", True, "false with training.distributed: validation runs one real CUDA step "
                        "on this node, and a distributed step needs all its ranks")
    ranks = req.planner.data_parallel_ranks
    if d.strategy != "none" and ranks != 1 and ranks != d.world_size:
        expected = "1 with world_size 'auto'" if d.world_size == "auto" else f"1 or the world size ({d.world_size})"
        raise SpecError("planner.data_parallel_ranks", ranks, f"{expected} with training.distributed: the world "
                        "size is the data-parallel ranks")


def _check_json(value: Any, path: str, depth: int) -> None:
    """A request's free-form JSON (kwargs, an inline config): finite numbers, bounded nesting."""
    if depth > MAX_JSON_DEPTH:
        raise SpecError(path, "(nested deeper)", f"JSON nested at most {MAX_JSON_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, repr(value), "a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]", depth + 1)
