"""Model builders: a request's ``model`` and ``input`` sections -> what the simulator runs.

>>> from estimator import parse_request                                          # doctest: +SKIP
>>> job = job_of(parse_request({"model": {"source": "timm", "name": "resnet18"}}))
>>> built = build(job.model, job.input)
>>> built.input, built.parameter_count
({'image_size': [3, 224, 224]}, 11689512)

Each source (torchvision, timm, transformers, a local factory) is a module
of ``sources/`` registered in ``registry.py``. Builders never download
weights or configs and never run a model's own code from a request:
torchvision and timm construct from their registries with ``weights=None`` /
``pretrained=False``; transformers models come from configs shipped in
``sources/transformers/presets/`` or given inline, through the library's own
classes (``auto_map`` is refused). A local ``package.module:factory`` is
imported only when the caller allows local code (library, CLI).

Torch-free at import: the builders import their libraries when they build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from estimator.models import registry

if TYPE_CHECKING:
    import torch

    from estimator.models.spec import InputSpec

# The workload a training step runs, written once: the simulation, a real CUDA step and a CPU step take these.
ModelFactory = Callable[[], "torch.nn.Module"]  # called under torch.device("meta") (or on the real device)
BatchFactory = Callable[[int, "torch.device"], tuple[Any, Any]]  # (batch size, device) -> (inputs, targets)
LossFn = Callable[[Any, Any], "torch.Tensor"]  # (outputs, targets) -> the scalar loss
# A loop whose loss is not loss_fn(model(x), y): (model, the batch factory's whole value) -> the scalar loss
StepFn = Callable[["torch.nn.Module", Any], "torch.Tensor"]
# The model's own optimizer (Lightning's configure_optimizers, the HF Trainer's): (the model on the device) -> it
OptimizerFn = Callable[["torch.nn.Module"], "torch.optim.Optimizer"]
# Once the model is on the (virtual) device: what a framework re-points there (Keras's variables, Lightning's device)
OnDevice = Callable[["torch.nn.Module"], None]


@dataclass(frozen=True)
class Depth:
    """A model whose blocks repeat (estimator/simulate/depth.py): how many (``layers``), the module path of
    their ``ModuleList`` (``container``, e.g. ``model.layers``) and the same model built with ``n`` of them
    (``at(n)``; None where that build's blocks are not the full model's, estimator/models/blocks.py).
    ``grows_by``: the (kind, base) of the rule such a model's steps usually grow by, where the builder knows one
    (it only orders the first search's simulations: estimator/simulate/depth.py)."""

    layers: int
    container: str
    at: Callable[[int], BuiltModel | None]
    grows_by: tuple[str, int] | None = None


@dataclass
class BuiltModel:
    """What the simulator needs: call ``factory()`` under ``torch.device("meta")``.

    ``worst_case``: data-dependent sizes at their maximum (detection; set by the simulation when a step turns
    out to need it). ``moe_routing``: tokens per expert in an eager experts loop (the virtual GPU follows it).
    ``max_seq_len``: the longest ``input.seq_len`` the model's positions allow (None: no position table).
    A step the user wrote (``estimator.models.user``) adds ``step_fn`` (then ``loss_fn`` is None and the batch
    factory's value is the whole batch), ``optimizer_fn`` (else the recipe's optimizer) and ``on_device``.
    """

    name: str
    factory: ModelFactory
    batch_factory: BatchFactory
    loss_fn: LossFn | None
    input: dict[str, Any]
    parameter_count: int
    assumptions: list[str] = field(default_factory=list)
    worst_case: bool = False
    moe_routing: str = "balanced"
    max_seq_len: int | None = None
    step_fn: StepFn | None = None
    optimizer_fn: OptimizerFn | None = None
    on_device: OnDevice | None = None
    depth: Depth | None = None  # blocks that repeat: a step simulated shallow and deepened

    def mark_worst_case(self) -> None:
        """A step of this model turned out to need the worst-case policy: every later simulation uses it."""
        self.worst_case = True


def build(model: Any, inp: InputSpec) -> BuiltModel:
    """Build a request's ``model`` section on the meta device for ``inp`` (checks names, kwargs, input limits)."""
    built: BuiltModel = registry.source_of(model).build(model, inp)
    return built


def model_sources() -> dict[str, Any]:
    """What each model source offers, as JSON data (``GET /models``)."""
    # ``registry.sources``, not a name imported here: importing the package ``estimator.models.sources`` binds
    # that name on this package
    return {name: s.listing() for name, s in registry.sources().items() if not s.local_code}
