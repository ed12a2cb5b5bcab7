"""What a job may ask and what the planner is asked: every bound and default, and the planner's options.

>>> PlanOptions().headroom, ConfirmMode("top")
(0.1, <ConfirmMode.TOP: 'top'>)

The contract between the request (``estimator.request``, which states these
bounds and defaults in its schema and fills the options from a request in
``job_of``) and the layers below it, which apply them: the builders check
inputs against the bounds, the planner (``estimator.plan``) takes
``PlanOptions``. Like ``estimator.trace``, the contract between the
simulation and the planner, it imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# --- bounds: what a request may ask for, each defined once ----------------------------------------

MAX_BATCH = 2**20
MAX_SEQ_LEN = 2**20
# Sane inputs: up to 64 channels and 8192 px a side (whole-slide tiles, 8K
# frames); a 16x16 px minimum lets every torchvision/timm stem run.
MAX_CHANNELS = 64
MIN_SIDE, MAX_SIDE = 16, 8192
MAX_FRAMES = 512
MAX_OBJECTS = 1024  # annotated objects per image (detection)
MAX_CARDS = 64  # cards in one request
MAX_WORLD_SIZE = 1024
# A base learning rate above 10 is no recipe's; the bound keeps the scaled LR (base_lr x global batch /
# base_batch, the ratio at most 2^36) finite, where base_lr 1e308 made it inf (answered as null).
MAX_BASE_LR = 10.0
MAX_STAGES = 64  # stages of a batch-size schedule
MAX_GLOBAL_BATCH = 2**30
MAX_JSON_DEPTH = 32  # nesting of a request's free-form JSON (model kwargs, an inline config)

# --- the planner's defaults ----------------------------------------------------------------------

# Kept free besides the catalog's CUDA context: published context sizes for
# one card differ by up to ~200 MiB across drivers and CUDA versions
# (gpus.py), and the caching allocator cannot use the last partial segment.
DEFAULT_RESERVE_BYTES = 256 * 2**20
# The real peak was above the prediction by up to 11 % in published runs
# (16 runs: 12 above, typically by 2-6 %). A batch that fits in (1 - h) of
# the usable memory survives an error e when (1 + e)(1 - h) <= 1: h = 0.10
# covers e = 11 %.
DEFAULT_HEADROOM = 0.10
# Model FLOPs utilization a well-tuned training step reaches: PaLM reports 46%
# (Chowdhery et al. 2022, table 3), GPT-3-style dense training 30-50%
# (Narayanan et al. 2021); 0.4 unless the caller knows better.
DEFAULT_EFFICIENCY = 0.4


class ConfirmMode(StrEnum):
    """How the affine trace's answers are confirmed by full simulations (``planner.confirm``)."""

    TOP = "top"  # one full simulation per group, just past its largest max, must equal the synthesized step
    EVERY_CARD = "every-card"  # full simulations at every card's max and max + 1
    NONE = "none"  # the fit is checked at one more batch only


# --- the planner's options ----------------------------------------------------------------------

@dataclass(frozen=True)
class AdviceOptions:
    """The request's wishes for advice (its ``planner`` section, with the optimizer and precision)."""

    optimizer: str = "adamw"
    compute: str = "fp32"  # the dtype the matmuls run in: "bf16" or "fp16" (tensor cores) or "fp32"
    compute_from: str = "training.precision fp32"  # the request's field that says so, for the assumption line
    curve_points: int = 10
    efficiency: float = DEFAULT_EFFICIENCY
    ranks: int = 1
    dataset_size: int | None = None
    max_epoch_seconds: float | None = None
    target_global_batch: int | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    seq_len: int | None = None  # tokens per sample, as the model was built (the planner sets it)
    batch_schedule: tuple[int, ...] = ()  # global batches, one per stage (estimator/plan/schedule.py)
    accumulation: int = 1  # training.grad_accumulation_steps: the micro-batches of one simulated step

    @property
    def low_precision(self) -> bool:
        """The matmuls run on 16-bit tensor cores: the card's bf16/fp16 peak times them, not its fp32 peak."""
        return self.compute != "fp32"


@dataclass(frozen=True)
class Levers:
    """The training choices a fit suggestion may change, as the request sets them."""

    checkpointing: bool = False
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: bool = False  # SGD with momentum keeps a state per parameter
    foreach: bool | None = None  # optimizer.foreach as the request sets it (None: PyTorch's default)
    strategy: str = "none"
    adaptable: bool = False  # the model can take adapters and quantization (a transformers model, peft installed)
    peft: bool = False  # the request trains adapters already (model.peft)
    quantized: bool = False  # its base is quantized already (model.quantization)


@dataclass(frozen=True)
class PlanOptions:
    """Everything the planner is asked for one job (``estimator.plan.answer``).

    ``world_size`` None is ``"auto"``: per card the fewest ranks at which the
    smallest batch fits. ``ranks`` are the data-parallel ranks of the global
    batch (the world size of a distributed step). ``zero_grad_at`` only words
    an assumption line.
    """

    batch_size: int | None = None
    align: bool = True
    confirm: ConfirmMode = ConfirmMode.TOP
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    headroom: float = DEFAULT_HEADROOM
    suggestions: bool = True
    max_seq_len: bool = False
    strategy: str = "none"
    world_size: int | None = 1
    grad_accumulation_steps: int = 1
    zero_grad_at: str = "step-start"
    advice: AdviceOptions = field(default_factory=AdviceOptions)
    levers: Levers = field(default_factory=Levers)
