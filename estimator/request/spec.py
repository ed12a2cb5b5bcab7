"""The estimate request (docs/API.md; the service serves its schema at ``GET /docs``), with its limits.

>>> req = parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"]})
>>> req.training.precision, req.gpus
('fp32', ['T4-16GB'])

Every bad value becomes a ``SpecError`` naming the field path (``model.name``,
``gpus[1]``), the value and what was expected; pydantic's own errors are
translated here, at one seam (``parse_request``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from estimator.errors import SpecError
from estimator.gpus import CUSTOM_NAME_PATTERN, DEFAULT_CONTEXT_BYTES, custom_name_problem
from estimator.plan.advice import DEFAULT_EFFICIENCY
from estimator.plan.search import DEFAULT_HEADROOM, DEFAULT_RESERVE_BYTES
from estimator.plan.strategy import ConfirmMode
from estimator.request.allowed import check_request_names
from estimator.request.limits import (
    MAX_BASE_LR,
    MAX_BATCH,
    MAX_CARDS,
    MAX_CHANNELS,
    MAX_FRAMES,
    MAX_JSON_DEPTH,
    MAX_OBJECTS,
    MAX_SEQ_LEN,
    MAX_SIDE,
    MIN_SIDE,
)
from estimator.request.recipe import (
    MAX_WORLD_SIZE,
    Checkpointing,
    LowPrecision,
    OptimizerName,
    Precision,
    Strategy,
    ZeroGradAt,
)

# The heads a transformers model can train, and its attention kernels.
Task = Literal["causal-lm", "masked-lm", "sequence-classification", "seq2seq-lm", "image-classification"]
AttnImplementation = Literal["eager", "sdpa"]
# transformers' ExpertsInterface (integrations/moe.py) without the ones that fetch kernels (deepgemm, sonicmoe)
ExpertsImplementation = Literal["eager", "batched_mm", "grouped_mm"]
MoeRouting = Literal["balanced", "worst-case"]

# NaN and infinities are refused in every typed field (a finite number is expected everywhere)
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# JSON-only kwargs: no callables, no objects, so nothing in a request is code.
JSONValue = None | bool | int | float | str | list[Any] | dict[str, Any]


class TorchvisionModel(BaseModel):
    model_config = _STRICT
    source: Literal["torchvision"]
    name: str = Field(description="torchvision's model name", examples=["resnet50"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict, description="constructor arguments",
                                         examples=[{"num_classes": 10}])


class TimmModel(BaseModel):
    model_config = _STRICT
    source: Literal["timm"]
    name: str = Field(description="a name in timm.list_models()", examples=["convnext_tiny"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict, description="passed to timm.create_model")


class TransformersModel(BaseModel):
    model_config = _STRICT
    source: Literal["transformers"]
    preset: str | None = Field(None, description="a config shipped with batchfit", examples=["bert-large-uncased"])
    config: dict[str, JSONValue] | None = Field(
        None, description="an inline config.json; overrides the preset's keys or stands alone (needs model_type)")
    task: Task | None = Field(None, description="the head to train; default: the preset's own task")
    attn_implementation: AttnImplementation | None = Field(
        None, description="transformers' attention kernel; null: the one transformers picks for the model's class "
        "(sdpa where the class supports it, else eager)", examples=["eager"])
    experts_implementation: ExpertsImplementation | None = Field(
        None, description="a mixture-of-experts model's experts kernel; null: the one transformers picks for the "
        "class (grouped_mm where it can choose, else its own eager loop)", examples=["batched_mm"])
    moe_routing: MoeRouting = Field(
        "balanced", description="tokens per expert, which a real router decides from the data: balanced (tokens x "
        "top-k spread evenly over the experts) or worst-case (every token to the same top-k experts)")


class CustomModel(BaseModel):
    """A local ``package.module:factory``; library and CLI only, refused over HTTP."""

    model_config = _STRICT
    source: Literal["custom"]
    factory: str = Field(description="package.module:callable returning an nn.Module", examples=["mypkg.nets:make"])
    kwargs: dict[str, JSONValue] = Field(default_factory=dict)


ModelSpec = Annotated[TorchvisionModel | TimmModel | TransformersModel | CustomModel, Field(discriminator="source")]


class InputSpec(BaseModel):
    model_config = _STRICT
    image_size: list[int] | None = Field(None, description="[C, H, W] for vision models", examples=[[3, 224, 224]])
    num_frames: int | None = Field(None, ge=1, le=MAX_FRAMES, description="frames per clip for video models")
    seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN, description="tokens per sample for text models")
    target_seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN, description="decoder tokens for seq2seq")
    num_objects: int | None = Field(None, ge=1, le=MAX_OBJECTS, description="annotated objects per image for detection")

    @field_validator("image_size")
    @classmethod
    def _sane_image(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) != 3:
            raise ValueError("a list of 3 integers [C, H, W]")
        c, h, w = v
        if not 1 <= c <= MAX_CHANNELS:
            raise ValueError(f"[C, H, W] with 1 <= C <= {MAX_CHANNELS}")
        if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
            raise ValueError(f"[C, H, W] with H and W from {MIN_SIDE} to {MAX_SIDE}")
        return v


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
    target_global_batch: int | None = Field(None, ge=1, le=2**30, description="plan accumulation for this batch")
    base_lr: float | None = Field(None, gt=0, le=MAX_BASE_LR, description="a learning rate tuned at base_batch")
    base_batch: int | None = Field(None, ge=1, le=2**30)
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
    model: ModelSpec
    input: InputSpec = Field(default_factory=InputSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    gpus: list[GPUEntry] | None = Field(
        None, min_length=1, max_length=MAX_CARDS, description="catalog names or custom cards; null: the whole catalog")
    batch_size: int | None = Field(None, ge=1, le=MAX_BATCH, description="also report memory at exactly this batch")
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    validate_step: bool = Field(False, alias="validate", description="on a GPU node: also run one real CUDA step "
                                "at the first card's max batch and report it measured (503 without a GPU)")


# --- the seam -----------------------------------------------------------------

_BRANCHES = {"torchvision", "timm", "transformers", "custom", "str", "int", "float", "bool", "CustomGPUSpec"}


def _is_branch(part: object) -> bool:
    """A union branch name pydantic puts in an error's location, not a field."""
    return isinstance(part, str) and (part in _BRANCHES or part.startswith(("literal[", "list[", "dict[")))


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_branch(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _lookup(data: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        elif _is_branch(part):
            continue
        else:
            return None
    return data


def parse_request(data: Any, *, allow_local_code: bool = False) -> EstimateRequest:
    """Validate a decoded JSON request; ``SpecError`` names the first bad field."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SpecError("(body)", data[:80], f"a JSON object ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise SpecError("(body)", data, "a JSON object with at least 'model'")
    try:
        req = EstimateRequest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A union reports one error per branch: keep the deepest (the branch
        # the value was meant for); equally deep ones are alternatives.
        first = _path(errors[0]["loc"])
        same = [e for e in errors if _path(e["loc"]).startswith(first)] or errors[:1]
        deepest = max(len(e["loc"]) for e in same)
        chosen = [e for e in same if len(e["loc"]) == deepest]
        err = chosen[0]
        loc = tuple(err["loc"])
        value = None if err["type"] == "missing" else err.get("input", _lookup(data, loc))
        expected = " or ".join(dict.fromkeys(_expected(e) for e in chosen))
        raise SpecError(_path(loc) or "(body)", value, expected) from exc
    return check_request(req, allow_local_code=allow_local_code)


def check_request(req: EstimateRequest, *, allow_local_code: bool = False) -> EstimateRequest:
    """The rules the schema cannot state, on a request pydantic already validated (FastAPI's body):
    no local code unless allowed, a transformers model names a preset or a config, and the request
    names only what it may (estimator/request/allowed.py)."""
    if isinstance(req.model, CustomModel) and not allow_local_code:
        raise SpecError("model.source", "custom", "torchvision, timm or transformers (custom factories run "
                        "only from the library or the CLI's --model, never from a request)")
    if isinstance(req.model, TransformersModel) and req.model.preset is None and req.model.config is None:
        raise SpecError("model.preset", None, "a preset name or an inline config (or both)")
    free = ("config", req.model.config) if isinstance(req.model, TransformersModel) else ("kwargs", req.model.kwargs)
    _check_json(free[1], f"model.{free[0]}", 0)
    check_request_names(req.model)  # allow-lists: kwargs, config fields, no paths or URLs
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


def _expected(err: Mapping[str, Any]) -> str:
    kind, ctx, msg = err["type"], err.get("ctx", {}), err["msg"]
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "extra_forbidden":
        return "no such field (the request's fields are listed at GET /docs)"
    if kind in ("literal_error", "enum"):
        return f"one of {ctx.get('expected', '')}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return msg.replace("Input should be ", "a number ")
    if kind == "union_tag_invalid":
        return f"model.source one of {ctx.get('expected_tags', '')}"
    if kind == "union_tag_not_found":
        return "a 'source' field: torchvision, timm or transformers"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "model_type" or kind == "dict_type":
        return "an object {name, memory_bytes, compute_capability}" if "CustomGPUSpec" in err["loc"] else "an object"
    return msg.replace("Input should be ", "")


def describe_validation_error(err: dict[str, Any]) -> SpecError:
    """One pydantic error (FastAPI's, its location under ``body``) as a ``SpecError``: field, value, expected."""
    loc = tuple(err["loc"])
    loc = loc[1:] if loc and loc[0] == "body" else loc
    value = None if err["type"] == "missing" else err.get("input")
    return SpecError(_path(loc) or "(body)", value, _expected(err))
