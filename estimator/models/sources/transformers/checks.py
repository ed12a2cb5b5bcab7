"""What a transformers request may ask of its model class, checked before the build, and the assumption lines
that say which attention kernel, experts kernel, routing and fused kernels the built model runs.

>>> attention_line(model, None)                                                  # doctest: +SKIP
'attention: sdpa (transformers' default for LlamaForCausalLM)'
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any, get_args

from estimator.errors import SpecError
from estimator.models.allowed import check_config
from estimator.models.building import describe
from estimator.models.sources.transformers import AttnImplementation

if TYPE_CHECKING:
    import torch

    from estimator.models.sources.transformers import TransformersModel

# What a config default's type asks of a request's value (bool before int: a bool is an int).
def check_config_names(config: dict[str, Any]) -> None:
    """estimator/models/allowed.py's config rules, against the installed transformers and timm registries."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def is_timm_model(name: str) -> bool:
        import timm

        return bool(timm.is_model(name))

    check_config(config, "model.config", known_types=CONFIG_MAPPING.keys(), is_timm_model=is_timm_model)


_KINDS: tuple[tuple[type, tuple[type, ...], str], ...] = (
    (bool, (bool,), "true or false"), (int, (int,), "an integer"), (float, (int, float), "a number"),
    (str, (str,), "a string"), (list, (list,), "a list"), (dict, (dict,), "an object"),
)


def _fits(value: Any, accepted: tuple[type, ...]) -> bool:
    """``isinstance``, except that true and false are no integers or numbers."""
    return isinstance(value, accepted) and not (isinstance(value, bool) and int in accepted and bool not in accepted)


def check_values(config_class: type, given: dict[str, Any]) -> None:
    """The request's config values against the config class, before anything is built: its declared field
    types where it has them (transformers' strict configs), else the type of its ``__init__`` default."""
    defaults = {p.name: p.default for p in inspect.signature(config_class).parameters.values()
                if p.default is not inspect.Parameter.empty}
    validators = getattr(config_class, "__validators__", {})
    for key, value in given.items():
        default = defaults.get(key)
        accepted, kind = next(((a, what) for t, a, what in _KINDS if isinstance(default, t)), ((object,), ""))
        for validate in validators.get(key, ()):
            try:
                validate(value)
            except (TypeError, ValueError) as exc:
                why = describe(exc)
                raise SpecError(f"model.config.{key}", value, why if _fits(value, accepted) else f"{kind} ({why})") \
                    from exc
        if key not in validators and not _fits(value, accepted):
            raise SpecError(f"model.config.{key}", value, f"{kind}, as {config_class.__name__}'s default {default!r}")
    architectures = given.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise SpecError("model.config.architectures", architectures,
                        "a list of transformers class names, e.g. ['GPT2LMHeadModel']")


# The class flag that says a model class can run each named kernel ("eager" needs none).
_ATTN_FLAGS = {"sdpa": "_supports_sdpa"}
# The ValueError transformers raises when a (sub-)model class cannot run the kernel named
# (modeling_utils.py, PreTrainedModel._sdpa_can_dispatch).
NO_KERNEL = re.compile(r"^(\w+) does not support an attention implementation")


def _attn_supported(model_class: type) -> list[str]:
    """The kernels of ``model.attn_implementation`` that ``model_class`` can run."""
    return [impl for impl in get_args(AttnImplementation)
            if impl not in _ATTN_FLAGS or getattr(model_class, _ATTN_FLAGS[impl], False)]


def check_attn(model_class: type, named: str | None) -> None:
    """A named kernel the class cannot run is the request's error, before transformers raises it."""
    supported = _attn_supported(model_class)
    if named is not None and named not in supported:
        raise SpecError("model.attn_implementation", named,
                        f"one {model_class.__name__} supports: {', '.join(supported)} "
                        "(or null: transformers' default for the class)")


def attention_line(model: torch.nn.Module, named: str | None) -> str:
    """The kernel the built model runs, read back from its config (transformers resolved it in ``__init__``),
    and any sub-model that resolved another one (a sub-model class without SDPA falls back on its own)."""
    from transformers import PreTrainedModel

    used = getattr(model.config, "_attn_implementation", None)
    top = type(model).__name__
    why = f"model.attn_implementation, on {top}" if named is not None else (
        f"transformers' default for {top}" + ("" if used == "sdpa" else ", which has no SDPA"))
    seen, others = {id(model.config)}, []
    for m in model.modules():  # outermost first: one line per sub-config, named by the model that owns it
        if isinstance(m, PreTrainedModel) and id(m.config) not in seen:
            seen.add(id(m.config))
            if (own := getattr(m.config, "_attn_implementation", None)) != used:
                others.append(f"; {own} in {type(m).__name__}")
    return f"attention: {used} ({why})" + "".join(others)


def check_experts(model_class: type, named: str | None) -> None:
    """A named experts kernel on a class that cannot switch one (no ``@use_experts_implementation``) is the
    request's error: transformers raises for grouped_mm and ignores the others."""
    if named is not None and not getattr(model_class, "_can_set_experts_implementation", lambda: False)():
        raise SpecError("model.experts_implementation", named,
                        f"null ({model_class.__name__} has no experts kernel to choose)")


def check_trains(model_class: type[torch.nn.Module], model_type: str, task: str) -> None:
    """A text class whose forward takes no ``labels`` computes no loss, so there is no training step of its own to
    simulate (batchfit's text tasks train on the model's loss): the request's error, named before the build.

    Gemma 4's assistants are so: draft models for assisted decoding, whose forward takes the hidden states and
    KV states of the model they draft for (``inputs_embeds``, ``shared_kv_states``) and returns logits only."""
    params = inspect.signature(model_class.forward).parameters
    if "labels" in params:
        return
    fed = " (an assisted-decoding draft model: the model it drafts for feeds it inputs_embeds and " \
          "shared_kv_states)" if "shared_kv_states" in params else ""
    raise SpecError("model.config.model_type", model_type,
                    f"a model that trains on its own: {model_class.__name__}, its {task} class, takes no labels and "
                    f"computes no loss{fed}")


# Top-k gates outside transformers' experts kernels whose tokens per expert the simulation's routing answers
# (virtual_gpu/moe.py, ``Routing``: JetMoE's split sizes, in its MoE MLP and its mixture of attention heads;
# Switch Transformers' top-1 router with its per-sequence expert capacity).
_ROUTED_GATES = ("JetMoeTopKGating", "SwitchTransformersTop1Router")


def experts_lines(model: torch.nn.Module, spec: TransformersModel) -> list[str]:
    """The experts kernel the built model runs and the routing policy, for a mixture-of-experts model.

    Experts are the modules ``@use_experts_implementation`` decorates (they carry ``num_experts`` and
    ``_is_expert_parallel``); the router's ``top_k`` (or the config's ``num_experts_per_tok``) says how many
    experts each token goes to. A model without them whose gates are in ``_ROUTED_GATES`` gets the routing
    line alone (it has no experts kernel to choose)."""
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]
    gates = [m for m in model.modules() if type(m).__name__ in _ROUTED_GATES]
    if not experts and not gates:
        return []
    lines, kept = [], ""
    if experts:
        config = model.config
        used = getattr(experts[0].config, "_experts_implementation", None) or "eager"
        why = "model.experts_implementation" if spec.experts_implementation else "transformers' default"
        n = experts[0].num_experts
        k = next((m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)),
                 getattr(config, "num_experts_per_tok", None))
        layers = f"{len(experts)} MoE layer" + ("s" if len(experts) > 1 else "")
        lines.append(f"experts: {used} ({why} for {type(model).__name__}, {layers})")
        kept = ("; the buffers' sizes do not depend on routing, only the offsets' values" if used == "grouped_mm"
                else "; the buffers' sizes do not depend on routing" if used == "batched_mm" else "")
    else:
        n, k = gates[0].num_experts, getattr(gates[0], "top_k", 1)
        capacity = getattr(gates[0], "expert_capacity", None)
        what = "split sizes" if capacity is None else f"expert capacity ({capacity} tokens per sequence)"
        kept = f"; {type(gates[0]).__name__}'s {what}, {len(gates)} gate" + ("s" if len(gates) > 1 else "")
    share = f"{k} of {n} experts per token" if isinstance(k, int) else f"{n} experts"
    if spec.moe_routing == "balanced":
        spread = f"tokens x {k} / {n} per expert" if isinstance(k, int) else "tokens spread evenly"
    else:
        spread = ("the experts filled in turn to their capacity" if gates and not experts
                  and getattr(gates[0], "expert_capacity", None) is not None
                  else "every token to the same expert" if k == 1 else f"every token to the same {k} experts"
                  if isinstance(k, int) else "every token to the same experts")
    lines.append(f"moe_routing: {spec.moe_routing} ({share}, {spread}{kept})")
    return lines


# The pip distribution of each optional kernel package (transformers' own _PACKAGE_TO_DISTRIBUTION names only fla).
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}


def kernel_lines(model: torch.nn.Module, name: str) -> list[str]:
    """Which path the optional fused kernels of a state-space or linear-attention model take.

    transformers wraps each such function in ``use_kernel_func_from_hub_with_fallback`` (integrations/
    hub_kernels.py): the original package (mamba-ssm, causal-conv1d, flash-linear-attention) when it imports,
    otherwise the module's reference torch function, whatever the device (a Hub kernel only when
    ``use_kernels`` is asked for). The wrapper keeps its choice in its closure (``is_new_implementation``), so
    the functions of the model's own modeling modules say what both this simulation and a GPU node without
    those packages run: the torch path, whose intermediates (the whole scan's states, the chunked delta rule's
    blocks) the fused kernels would recompute in their backward instead of keeping."""
    import sys

    torch_path: dict[str, list[str]] = {}
    fused: dict[str, list[str]] = {}
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for value in vars(module).values():
            closure = getattr(value, "__closure__", None)
            if not inspect.isfunction(value) or not closure:
                continue
            try:
                free = dict(zip(value.__code__.co_freevars, (c.cell_contents for c in closure), strict=True))
            except ValueError:  # a cell not yet filled (a closure over a name assigned later): not a wrapper
                continue
            package, func = free.get("package"), free.get("func_name")
            if isinstance(package, str) and isinstance(func, str) and "is_new_implementation" in free:
                dist = _DISTRIBUTIONS.get(package, package)
                (fused if free["is_new_implementation"] else torch_path).setdefault(dist, []).append(func)
    lines = []
    if torch_path:
        funcs = ", ".join(sorted({f for fs in torch_path.values() for f in fs}))
        lines.append(f"{name}: the torch path for {funcs} ({', '.join(sorted(torch_path))} not installed, "
                     "as on a GPU node without them); the fused kernels would use less memory")
    if fused:
        lines.append(f"{name}: the installed {', '.join(sorted(fused))} kernels "
                     f"({', '.join(sorted({f for fs in fused.values() for f in fs}))})")
    return lines
