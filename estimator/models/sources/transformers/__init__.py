"""transformers: presets shipped as config JSON, inline configs, five training tasks.

>>> sorted(presets())[:2]
['bert-base-uncased', 'bert-large-uncased']

Only transformers' own classes are used (``AutoModelFor*.from_config``); a
config carrying ``auto_map`` or ``trust_remote_code``, or naming another
model by name (a backbone, a timm model given by a path or a Hub id), is
refused at any depth (estimator/models/allowed.py), nothing is fetched
from the Hub. Each preset file names its source in ``_source``.

This module is the request section and the registration (torch-free); the
builder is ``build.py``, the per-architecture inputs ``text_inputs.py`` and
``image_inputs.py``, the kernel and routing checks ``checks.py``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, Field

from estimator.models.allowed import check_config, refuse_paths
from estimator.models.peft import PeftSpec, QuantizationSpec, check_fine_tuning
from estimator.models.registry import ModelSource, register
from estimator.models.spec import STRICT, InputSpec, JSONValue

if TYPE_CHECKING:
    from estimator.models import BuiltModel

# The heads a transformers model can train, and its attention kernels.
Task = Literal["causal-lm", "masked-lm", "sequence-classification", "seq2seq-lm", "image-classification"]
AttnImplementation = Literal["eager", "sdpa"]
# transformers' ExpertsInterface (integrations/moe.py) without the ones that fetch kernels (deepgemm, sonicmoe)
ExpertsImplementation = Literal["eager", "batched_mm", "grouped_mm"]
MoeRouting = Literal["balanced", "worst-case"]


class TransformersModel(BaseModel):
    model_config = STRICT
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
    peft: PeftSpec | None = Field(None, description="train adapters instead of the whole model: LoRA or DoRA "
                                       "through peft's own get_peft_model (the base frozen)",
                                       examples=[{"method": "lora", "r": 16, "target_modules": "all-linear"}])
    quantization: QuantizationSpec | None = Field(
        None, description="the frozen base's linear layers quantized by bitsandbytes (needs model.peft): 'bnb-4bit' "
        "(QLoRA's NF4) or 'bnb-8bit' (LLM.int8())", examples=[{"method": "bnb-4bit", "quant_type": "nf4"}])


@lru_cache(maxsize=1)
def presets() -> dict[str, dict[str, Any]]:
    """Preset name -> config dict (``_source`` kept, for provenance)."""
    out = {}
    for entry in resources.files(__name__).joinpath("presets").iterdir():
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text())
    return out


def _check_names(spec: TransformersModel) -> None:
    """The request's names, library-free (the builder checks the config again against transformers' registry)."""
    if spec.preset is None and spec.config is None:
        from estimator.errors import SpecError

        raise SpecError("model.preset", None, "a preset name or an inline config (or both)")
    if spec.preset is not None:
        refuse_paths(spec.preset, "model.preset")
        if spec.preset not in presets():
            from estimator.models.building import unknown_name

            hub = " (a Hub id is not fetched: paste its config.json as model.config)" if "/" in spec.preset else ""
            raise unknown_name("model.preset", spec.preset, sorted(presets()), f"a batchfit preset (GET /models){hub}")
    if spec.config is not None:
        check_config(spec.config)
    check_fine_tuning(spec.peft, spec.quantization)


def _build(spec: TransformersModel, inp: InputSpec) -> BuiltModel:
    from estimator.models.sources.transformers.build import build_transformers

    return build_transformers(spec, inp)


def _listing() -> dict[str, Any]:
    return {"presets": sorted(presets()), "tasks": list(get_args(Task)),
            "attn_implementation": list(get_args(AttnImplementation)),
            "experts_implementation": list(get_args(ExpertsImplementation)),
            "moe_routing": list(get_args(MoeRouting))}


register(ModelSource("transformers", TransformersModel, _build, _check_names, _listing,
                     libraries=("transformers", "peft", "bitsandbytes")))
