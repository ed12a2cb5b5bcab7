"""Parameter-efficient and quantized fine-tuning of a transformers model: ``model.peft`` and ``model.quantization``.

>>> PeftSpec.model_validate({"r": 16, "target_modules": "all-linear"}).alpha
16
>>> QuantizationSpec.model_validate({"method": "bnb-4bit"}).quant_type                 # doctest: +SKIP
'nf4'

The sections are torch-free (the request schema reads them where no torch is loaded); ``quantize`` and ``adapt``
build with the libraries' own code on the meta model, in the order a QLoRA script runs them:
transformers' bitsandbytes integration (``replace_with_bnb_linear`` with the modules its quantizer leaves
unconverted: ``HfQuantizer.get_modules_to_not_convert``), peft's ``prepare_model_for_kbit_training``, then peft's
``LoraConfig`` and ``get_peft_model`` (DoRA is ``use_dora``). The quantized weights themselves are made when the
model reaches the (virtual) device: estimator/simulate/virtual_gpu/bnb.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field

from estimator.errors import MissingExtraError, SpecError
from estimator.models.spec import STRICT

if TYPE_CHECKING:
    import torch

Task = str  # the transformers source's task names (causal-lm, ...)
# peft's TaskType for each task: which PeftModel subclass wraps the model (its forward, its modules_to_save)
_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM", "sequence-classification": "SEQ_CLS"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class PeftSpec(BaseModel):
    model_config = STRICT
    method: Literal["lora", "dora"] = Field("lora", description="'lora', or 'dora' (LoraConfig.use_dora: a "
                                            "magnitude vector per adapted layer and its weight-norm temporaries)")
    r: int = Field(8, ge=1, le=4096, description="LoraConfig.r: the adapters' rank")
    alpha: int = Field(16, ge=1, le=65536, description="LoraConfig.lora_alpha (scales the update by alpha/r)")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoraConfig.lora_dropout on each adapter's input "
                           "(above 0 a mask and a copy of the input are kept for backward)")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | Literal["all-linear"] | None = \
        Field(None, max_length=256, description="the modules adapted: names (a module whose name ends with one), "
              "'all-linear' (every linear layer but the output head), or null: peft's default for the model type",
              examples=["all-linear"])
    modules_to_save: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=256, description="modules trained in full beside the adapters "
        "(LoraConfig.modules_to_save: a trainable copy of each)")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="LoraConfig.bias: which biases train")


class Bnb4bitSpec(BaseModel):
    model_config = STRICT
    method: Literal["bnb-4bit"]
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="BitsAndBytesConfig.bnb_4bit_quant_type")
    double_quant: bool = Field(True, description="bnb_4bit_use_double_quant: the absmax quantized again to 8 bits "
                               "(one byte per 64-block, fp32 per 256 of those)")
    compute_dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="bnb_4bit_compute_dtype: the "
                                                          "dequantized weights' dtype in the matmuls")
    skip_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, max_length=256, description="llm_int8_skip_modules: linear layers left unquantized; null: as "
        "transformers leaves them (the output head, tied weights), [] quantizes the head too (as LitGPT does)")
    prepare_for_kbit_training: bool = Field(True, description="peft's prepare_model_for_kbit_training, as its "
                                            "examples call it: the unquantized parameters (norms, embeddings, head) "
                                            "in fp32, the input embeddings' output requiring grad")


class Bnb8bitSpec(BaseModel):
    model_config = STRICT
    method: Literal["bnb-8bit"]
    threshold: float = Field(6.0, ge=0.0, le=1e4, description="llm_int8_threshold: LLM.int8()'s outlier threshold "
                             "(0: no mixed-precision decomposition)")
    skip_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, max_length=256, description="llm_int8_skip_modules (null: as transformers leaves them)")
    prepare_for_kbit_training: bool = Field(True, description="peft's prepare_model_for_kbit_training (see bnb-4bit)")


QuantizationSpec = Annotated[Bnb4bitSpec | Bnb8bitSpec, Field(discriminator="method")]


def check_fine_tuning(peft: PeftSpec | None, quantization: Bnb4bitSpec | Bnb8bitSpec | None) -> None:
    """The rules the sections cannot state alone: a quantized base trains only through adapters."""
    if quantization is not None and peft is None:
        raise SpecError("model.quantization", quantization.model_dump(), "with model.peft: a quantized base is "
                        "frozen, so only adapters (LoRA, DoRA) can train")


def _libraries() -> None:
    try:
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("peft", "model.peft and model.quantization", str(exc)) from exc


def quantize(model: Any, spec: Bnb4bitSpec | Bnb8bitSpec, lines: list[str]) -> Any:
    """The model's linear layers replaced by bitsandbytes' (on meta: nothing is quantized yet), as transformers'
    bitsandbytes quantizer does before loading weights; then ``prepare_model_for_kbit_training`` when asked."""
    _libraries()
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    four = spec.method == "bnb-4bit"
    if isinstance(spec, Bnb4bitSpec):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=spec.quant_type,
                                    bnb_4bit_use_double_quant=spec.double_quant,
                                    bnb_4bit_compute_dtype=getattr(torch, _DTYPES[spec.compute_dtype]),
                                    llm_int8_skip_modules=spec.skip_modules)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=spec.threshold,
                                    llm_int8_skip_modules=spec.skip_modules)
    skipped = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules,
                                                     getattr(model, "_keep_in_fp32_modules", None))
    before = _linears(model)
    model = replace_with_bnb_linear(model, modules_to_not_convert=skipped, quantization_config=config)
    converted = before - _linears(model)
    if not converted:
        raise SpecError("model.quantization.skip_modules", spec.skip_modules, "modules that leave at least one "
                        "linear layer to quantize")
    setattr(model, "is_loaded_in_4bit" if four else "is_loaded_in_8bit", True)  # what peft reads
    model.is_quantized = True
    what = (f"{spec.quant_type}{', double quant' if spec.double_quant else ''}, compute {spec.compute_dtype}"
            if isinstance(spec, Bnb4bitSpec) else f"LLM.int8(), threshold {spec.threshold}")
    lines.append(f"{spec.method} ({what}): {converted} linear layers quantized by bitsandbytes; left unquantized: "
                 f"{', '.join(sorted(skipped)) or 'none'}")
    if spec.prepare_for_kbit_training:
        from peft import prepare_model_for_kbit_training

        # checkpointing is the recipe's (training.gradient_checkpointing), not turned on here behind its back
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        lines.append("prepare_model_for_kbit_training: the unquantized parameters in fp32, the input embeddings' "
                     "output requires grad; gradient checkpointing as training.gradient_checkpointing says (PEFT's "
                     "examples turn it on)")
    return model


def _linears(model: torch.nn.Module) -> int:
    import torch

    return sum(type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D" for m in model.modules())


@contextlib.contextmanager
def _norms_on_meta() -> Iterator[None]:
    """DoRA's magnitude is the base weight's norm, which ``update_layer`` computes from the dequantized weight; on
    the meta device a bitsandbytes weight is not quantized yet (that happens on the device), so its meta tensor,
    of the full shape, is the weight."""
    import peft.tuners.lora.dora as dora

    original = dora.dequantize_module_weight

    def dequantize_module_weight(module: Any) -> Any:
        weight = getattr(module, "weight", None)
        if weight is not None and weight.device.type == "meta":
            return weight.data
        return original(module)

    dora.dequantize_module_weight = dequantize_module_weight
    try:
        yield
    finally:
        dora.dequantize_module_weight = original


def adapt(model: Any, spec: PeftSpec, task: Task, lines: list[str]) -> Any:
    """``get_peft_model`` with the request's ``LoraConfig``: the base frozen, the adapters (and
    ``modules_to_save``) trainable."""
    _libraries()
    from peft import LoraConfig, get_peft_model

    targets: Any = spec.target_modules
    try:
        config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                            modules_to_save=spec.modules_to_save or None, bias=spec.bias,
                            use_dora=spec.method == "dora", task_type=_TASK_TYPES.get(task),
                            # GPT-2's Conv1D keeps its weight transposed (peft would warn and set it itself)
                            fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()))
        with _norms_on_meta():
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        field = "model.peft.modules_to_save" if "modules_to_save" in str(exc) else "model.peft.target_modules"
        value = spec.modules_to_save if field.endswith("save") else targets
        raise SpecError(field, value, f"module names of this model, or 'all-linear' ({exc})") from exc
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    adapted = sorted({name.rsplit(".", 1)[-1] for name in
                      getattr(peft_model.peft_config["default"], "target_modules", None) or []})
    kind = "DoRA" if spec.method == "dora" else "LoRA"
    lines.append(f"{kind} (peft get_peft_model): r={spec.r}, alpha={spec.alpha}, "
                 f"dropout {spec.dropout:g} on {', '.join(adapted)}: {trainable:,} trainable parameters of {total:,}; "
                 "the base is frozen (no gradients, no optimizer state)")
    return peft_model
