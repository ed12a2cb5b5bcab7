"""What the planner answers: one frozen dataclass per concept, served by the API as they are.

The HTTP service and ``batchfit estimate --json`` serialise these with
pydantic (``to_json``); the descriptions below are the API's documentation
(``GET /docs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from estimator.plan.advice import AccumulationPlan, CurvePoint, LearningRate
from estimator.plan.schedule import ScheduleStage
from estimator.replay.report import Breakdown, MemoryAtBatch


class SearchMethod(StrEnum):
    """How a card's max batch was found."""

    AFFINE_CHECKED = "affine-checked"  # replays of the affine trace; a full simulation just past the max equals it
    AFFINE_CONFIRMED = "affine-confirmed"  # replays, then full simulations at max and max + 1 agree
    AFFINE = "affine"  # replays of the affine trace, its fit checked at one small batch
    FULL = "full"  # full simulations only (the step is not affine in the batch, or nothing fits)
    PROFILE = "profile"  # replays of a portable profile's affine trace: no model code, no simulation


@dataclass(frozen=True)
class Search:
    """How the max was found; ``checked_batch``: the batch of the full simulation that checked it."""

    method: SearchMethod
    checked_batch: Annotated[int | None, Field(description="with 'affine-checked': the batch of the full "
                                               "simulation that reproduced the affine trace exactly")] = None


class WarningCode(StrEnum):
    """What a warning is about; clients branch on the code, never on the message."""

    BATCH_ONE_CANNOT_TRAIN = "batch-one-cannot-train"  # batch norm refuses one value per channel
    BATCH_SIZE_DOES_NOT_FIT = "batch-size-does-not-fit"  # the request's batch_size, on a card
    DOES_NOT_FIT = "does-not-fit"  # not even the smallest batch fits on a card
    NO_RECOMMENDATION = "no-recommendation"  # the smallest batch fits, but not within the headroom
    NOT_AFFINE = "not-affine"  # the step's ops or sizes change with the batch: full simulations
    CHECK_DIFFERS = "check-differs"  # a full simulation differs from the affine trace: full simulations
    CONFIRMATION_DIFFERS = "confirmation-differs"  # 'every-card': a card's full simulations disagree
    NOT_MODELLED = "not-modelled"  # part of the step the simulation does not run


@dataclass(frozen=True)
class Note:
    """A warning: its ``code`` for programs, its ``message`` for people."""

    code: WarningCode
    message: str


@dataclass(frozen=True)
class Suggestion:
    """A change to the request with which a card that had no recommended batch gets one (the headroom met),
    checked by full simulations; the max and recommended batch (per rank) it reaches there."""

    change: Annotated[dict[str, Any], Field(description="request fields (dotted paths) and their new values, "
                                            "e.g. {'training.gradient_checkpointing': true}")]
    description: Annotated[str, Field(description="the change in words, e.g. 'FSDP (fully_shard per block) "
                                      "over 4 ranks'; with it a batch is recommended on the card")]
    max_batch_size: Annotated[int | None, Field(description="the max batch with the change")] = None
    recommended_batch_size: Annotated[int | None, Field(description="the recommended batch with the change")] = None
    world_size: Annotated[int, Field(description="ranks with the change (the batches are per rank)")] = 1
    changes_method: Annotated[bool, Field(description="the change trains another way (adapters, an 8-bit "
                                          "optimizer), not only with another recipe: check its quality")] = False


@dataclass(frozen=True, kw_only=True)
class GPUResult:
    gpu: str
    capacity_bytes: Annotated[int, Field(description="the card's memory as nvidia-smi reports it")]
    min_batch_size: Annotated[int, Field(description="smallest batch that trains (2 when batch norm sees 1x1 "
                                         "maps)")] = 1
    max_batch_size: Annotated[int | None, Field(description="largest batch whose simulated step never fails; "
                                                "null: not even the smallest")]
    recommended_batch_size: Annotated[int | None, Field(description="the largest batch (aligned, see "
                                                        "planner.align) that fits with planner.headroom of the "
                                                        "usable memory kept free; null when not even the "
                                                        "smallest batch does")]
    search: Annotated[Search, Field(description="how the max was found")]
    memory: Annotated[MemoryAtBatch, Field(description="memory at batch_size, else at the max (else at the "
                                           "smallest batch)")]
    max_memory: Annotated[MemoryAtBatch | None, Field(description="memory at max_batch_size")] = None
    recommended_memory: Annotated[MemoryAtBatch | None, Field(
        description="memory at recommended_batch_size with the allocator held to the headroom (an allocator "
                    "left free caches more, as it does at the max)")] = None
    curve: Annotated[list[CurvePoint], Field(description="device peak at batch sizes up to the max")] = field(
        default_factory=list)
    step_seconds: Annotated[float | None, Field(description="one optimizer step at the recommended batch")] = None
    epoch_seconds: Annotated[float | None, Field(description="one epoch of dataset_size at the recommended "
                                                 "batch")] = None
    meets_epoch_limit: Annotated[bool | None, Field(description="epoch_seconds <= planner.max_epoch_seconds at "
                                                    "the recommended batch; null unless both are known")] = None
    max_tokens_per_batch: Annotated[int | None, Field(description="text models: max_batch_size x seq_len")] = None
    max_seq_len: Annotated[int | None, Field(description="text models, when planner.max_seq_len: the largest "
                                             "seq_len that fits at batch_size (or the smallest batch)")] = None
    accumulation: Annotated[AccumulationPlan | None, Field(description="with planner.target_global_batch: the "
                                                           "fewest accumulation steps that reach it at a micro-batch "
                                                           "that fits")] = None
    learning_rate: LearningRate | None = None
    batch_schedule: Annotated[list[ScheduleStage], Field(description="with planner.batch_schedule: per stage "
                                                         "the micro-batch x accumulation x ranks that reaches its "
                                                         "global batch at the recommended memory, the step time "
                                                         "and the learning rate; [] without, or when no batch is "
                                                         "recommended")] = field(default_factory=list)
    world_size: Annotated[int, Field(description="ranks of the data-parallel step (training.distributed); the "
                                     "batch sizes above are each rank's micro-batch")] = 1
    global_batch_size: Annotated[int | None, Field(description="recommended_batch_size x world_size x "
                                                   "training.grad_accumulation_steps")] = None
    min_world_size: Annotated[int | None, Field(description="with world_size 'auto': the fewest ranks (up to "
                                                "1024) at which the smallest batch fits this card; null when "
                                                "not even 1024 do")] = None
    recommended_world_size: Annotated[int | None, Field(
        description="with world_size 'auto': the fewest ranks (up to 1024) at which a batch is recommended (the "
                    "headroom met) on this card, the world this result answers at; null when not even 1024 do "
                    "(the result then answers at min_world_size)")] = None
    suggestions: Annotated[list[Suggestion], Field(description="when one GPU recommends no batch (not even the "
                                                   "smallest fits with the headroom): changes with which one is "
                                                   "recommended, cheapest first, each checked by simulations")] = \
        field(default_factory=list)


@dataclass(frozen=True)
class Provenance:
    batchfit: str
    torch: str
    catalog: str
    seconds: float
    simulations: Annotated[int, Field(description="full training-step simulations run")]


@dataclass(frozen=True, kw_only=True)
class EstimateResponse:
    results: Annotated[list[GPUResult], Field(description="one per card of the request's gpus (the whole catalog "
                                              "without), in its order")]
    breakdown: Annotated[Breakdown, Field(description="bytes live at the allocated peak, by category")]
    per_sample_bytes: Annotated[int, Field(description="allocated peak growth per sample, first card (line "
                                           "through the peaks at the smallest batch + 1 and at its max)")]
    fixed_bytes: Annotated[int, Field(description="that line's value at batch 0")]
    parameter_count: Annotated[int, Field(description="the model's parameters, tied weights once "
                                          "(sum of numel over model.parameters())")] = 0
    flops_per_sample: Annotated[int, Field(description="forward + backward FLOPs per sample "
                                           "(torch.utils.flop_counter)")] = 0
    assumptions: Annotated[list[str], Field(description="what the estimate took for what the request left out "
                                            "or the simulation cannot know (defaults, kernels, CUDA context, "
                                            "margins), for people")] = field(default_factory=list)
    warnings: Annotated[list[Note], Field(description="what limits the answer (a card that does not fit, a step "
                                          "simulated in full, a part not modelled): a code for programs, a message "
                                          "for people")] = field(default_factory=list)
    provenance: Provenance


_RESPONSE = TypeAdapter(EstimateResponse)


def to_json(response: EstimateResponse) -> dict[str, Any]:
    """The response as JSON data (what ``POST /estimate`` returns)."""
    data: dict[str, Any] = _RESPONSE.dump_python(response, mode="json")
    return data


def to_json_text(response: EstimateResponse, indent: int | None = None) -> str:
    return _RESPONSE.dump_json(response, indent=indent).decode()
