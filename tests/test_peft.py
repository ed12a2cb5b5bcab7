"""LoRA, DoRA, QLoRA and bitsandbytes' optimizers: peft's and bitsandbytes' own code on the virtual GPU, checked
against bytes derived by hand, against real CPU steps (LoRA), and through the request."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from estimator.errors import SpecError
from estimator.gpus import get_gpu
from estimator.measure.cpu import BATCH, real_cpu_peak
from estimator.models.peft import PeftSpec, adapt
from estimator.pipeline import estimate_memory
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO
from estimator.trace import Category, Phase, Trace

pytestmark = pytest.mark.sim

A100 = get_gpu("A100-80GB")
TOKENS = 2048  # rows of the layer's input: past bitsandbytes' 1536, where gemm_4bit dequantizes the weight


def _adapted(layer: torch.nn.Module, *, dora: bool = False) -> torch.nn.Module:
    """peft's LoRA (or DoRA) r=8 on the layer, as a request's ``model.peft`` builds it (estimator/models/peft.py)."""
    spec = PeftSpec(method="dora" if dora else "lora", r=8, alpha=16, dropout=0.0, target_modules=["0"])
    return adapt(torch.nn.Sequential(layer), spec, "", [])


def _nf4(double_quant: bool = True, dora: bool = False) -> torch.nn.Module:
    import bitsandbytes as bnb

    return _adapted(bnb.nn.Linear4bit(512, 1024, bias=False, compute_dtype=torch.bfloat16,
                                      compress_statistics=double_quant, quant_type="nf4"), dora=dora)


def _int8() -> torch.nn.Module:
    import bitsandbytes as bnb

    return _adapted(bnb.nn.Linear8bitLt(512, 1024, bias=False, has_fp16_weights=False, threshold=6.0))


def _layer_trace(factory, dtype: torch.dtype = torch.bfloat16, recipe: Recipe | None = None) -> Trace:
    """Two steps of one adapted layer on an A100; its input requires grad, as a layer past the first does."""
    return record_training(factory, lambda b, dev: (torch.empty(b, 512, dtype=dtype, device=dev, requires_grad=True),
                                                    None),
                           lambda out, _: out.float().sum(), TOKENS, recipe or Recipe(), A100)


def _bytes(trace: Trace, category: str, phase: str | None = None, iteration: int | None = None) -> list[int]:
    return sorted(a.nbytes for a in trace.allocations if a.category == category
                  and (phase is None or a.phase == phase) and (iteration is None or a.iteration == iteration))


def _ops(trace: Trace, phase: str, iteration: int = 1) -> Counter[tuple[str, int]]:
    return Counter((a.op, a.nbytes) for a in trace.allocations if a.phase == phase and a.iteration == iteration)


# --- one layer, to the byte -------------------------------------------------------------------------------------
# Linear4bit(512 -> 1024), NF4, double quant, compute bf16; LoRA r=8 in fp32. 512 * 1024 = 524,288 weights.
#   packed weight: 2 weights a byte            524,288 / 2     = 262,144 B uint8 (262144, 1)
#   absmax: one per 64-block, 8-bit with DQ    524,288 / 64    =   8,192 blocks -> 8,192 B uint8
#   nested absmax: fp32 per 256 absmax         8,192 / 256 * 4 =     128 B
#   nested code: the 8-bit dynamic map         256 * 4         =   1,024 B
#   offset: the absmax's mean, fp32 scalar                     =       4 B
#   code: the NF4 table                        16 * 4          =      64 B
#   LoRA A (8 x 512) fp32                      4,096 * 4       =  16,384 B
#   LoRA B (1024 x 8) fp32                     8,192 * 4       =  32,768 B
NF4_DQ_PARAMETERS = sorted([262_144, 8_192, 128, 1_024, 4, 64, 16_384, 32_768])
#   without DQ the absmax is fp32 per 64-block: 8,192 * 4 = 32,768 B, no nested state
NF4_PARAMETERS = sorted([262_144, 32_768, 64, 16_384, 32_768])
#   the dequantized weight, 1024 x 512 in bf16 = 1,048,576 B (forward: gemm_4bit's fallback past 1536 rows;
#   backward: MatMul4Bit's grad_A), and with DQ the absmax dequantized to fp32: 8,192 * 4 = 32,768 B
DEQUANTIZED = 1024 * 512 * 2
ABSMAX_FP32 = 8_192 * 4


def test_nf4_double_quant_storage_bytes() -> None:
    trace = _layer_trace(_nf4)
    assert _bytes(trace, Category.PARAMETER) == NF4_DQ_PARAMETERS
    # quantized on the card from a bf16 copy of the weight, freed at once (as from_pretrained does per tensor)
    assert ("empty", DEQUANTIZED) in _ops(trace, Phase.SETUP, 0)


def test_nf4_storage_bytes_without_double_quant() -> None:
    trace = _layer_trace(functools.partial(_nf4, double_quant=False))
    assert _bytes(trace, Category.PARAMETER) == NF4_PARAMETERS


def test_dequantized_temporaries_forward_and_backward() -> None:
    trace = _layer_trace(_nf4)
    forward = _ops(trace, Phase.FORWARD)
    # bitsandbytes' _dequant_linear_fallback: absmax_dq, absmax_dq + offset, then B_dq
    assert forward[("absmax_dq[gemm_4bit]", ABSMAX_FP32)] == 1
    assert forward[("absmax_plus_offset[gemm_4bit]", ABSMAX_FP32)] == 1
    assert forward[("B_dq[gemm_4bit]", DEQUANTIZED)] == 1
    # MatMul4Bit.backward: F.dequantize_4bit (nested absmax first), then grad_A = grad_output @ W (2048 x 512 bf16)
    backward = _ops(trace, Phase.BACKWARD)
    assert backward[("dequantize_blockwise", ABSMAX_FP32)] == 1
    assert backward[("dequantize_4bit", DEQUANTIZED)] == 1
    assert backward[("mm", TOKENS * 512 * 2)] == 1
    # each is a temporary, freed before the step ends: none is live after the second step
    assert all(a.category == Category.TEMPORARY for a in trace.allocations if a.op.endswith("[gemm_4bit]"))


def test_adapters_only_trained_base_frozen() -> None:
    trace = _layer_trace(_nf4)
    # gradients: LoRA A 16,384 B and B 32,768 B per step; none for the 4-bit base
    assert _bytes(trace, Category.GRADIENT, iteration=0) == [16_384, 32_768]
    # AdamW: exp_avg and exp_avg_sq of each adapter matrix, fp32
    assert _bytes(trace, Category.OPTIMIZER_STATE) == [16_384, 16_384, 32_768, 32_768]


# Linear8bitLt(512 -> 1024), LLM.int8() with threshold 6: Int8Params._quantize
#   CB: int8 1024 x 512 = 524,288 B; SCB: one fp32 scale per row, 1024 * 4 = 4,096 B
INT8_PARAMETERS = sorted([524_288, 4_096, 16_384, 32_768])


def test_int8_storage_and_kernel_bytes() -> None:
    trace = _layer_trace(_int8, dtype=torch.float16)
    assert _bytes(trace, Category.PARAMETER) == INT8_PARAMETERS
    forward = _ops(trace, Phase.FORWARD)
    # int8_vectorwise_quant of the fp16 input (2048 x 512): int8 rows 1,048,576 B, row stats 2048 * 4 = 8,192 B;
    # with the threshold, |A| (fp16, 2,097,152 B) and its outlier mask (bool, 1,048,576 B)
    assert forward[("int8_vectorwise_quant", 1_048_576)] == 1 and forward[("int8_vectorwise_quant", 8_192)] == 1
    assert forward[("abs[int8_vectorwise_quant]", 2_097_152)] == 1
    assert forward[("outlier_mask[int8_vectorwise_quant]", 1_048_576)] == 1
    # the int32 product 2048 x 1024 x 4 = 8,388,608 B inside int8_scaled_mm
    assert forward[("int8_matmul_int32[int8_mixed_scaled_mm]", 8_388_608)] == 1
    # backward: MatMul8bitLt dequantizes CB into A's dtype (fp16): 1,048,576 B
    assert _ops(trace, Phase.BACKWARD)[("_to_copy", 1_048_576)] == 1


def test_dora_adds_its_magnitude_and_norm_temporaries() -> None:
    lora, dora = _layer_trace(_nf4), _layer_trace(functools.partial(_nf4, dora=True))
    # DoRA's magnitude vector: one fp32 per output feature, 1024 * 4 = 4,096 B, trained (a gradient of its own)
    assert _bytes(dora, Category.PARAMETER) == sorted([*NF4_DQ_PARAMETERS, 4_096])
    assert _bytes(dora, Category.GRADIENT, iteration=0) == [4_096, 16_384, 32_768]
    # the weight norm dequantizes the base weight once more in each forward (peft's dora.py: W + scale * B @ A)
    dequant = ("dequantize_4bit", DEQUANTIZED)
    assert _ops(dora, Phase.FORWARD)[dequant] >= _ops(lora, Phase.FORWARD)[dequant] + 1
    assert report_from_trace(dora, TOKENS, A100).allocated_peak_bytes > \
        report_from_trace(lora, TOKENS, A100).allocated_peak_bytes


# --- bitsandbytes' optimizers ------------------------------------------------------------------------------------


def _big_lora() -> torch.nn.Module:
    """LoRA r=64 on a 2048 x 2048 linear: A and B have 131,072 elements each (>= 1e5: paged; >= 4096: 8-bit)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(torch.nn.Sequential(torch.nn.Linear(2048, 2048, bias=False)),
                          LoraConfig(r=64, lora_alpha=16, lora_dropout=0.0, target_modules=["0"]))


def _big_trace(optimizer: str) -> Trace:
    return record_training(_big_lora, lambda b, dev: (torch.empty(b, 2048, device=dev), None),
                           lambda out, _: out.sum(), 8, Recipe(optimizer=optimizer), A100)


# per adapter matrix of 131,072 elements, bitsandbytes' Optimizer2State.init_state:
#   state1, state2: uint8 131,072 B each; absmax1, absmax2: fp32 per 256-block, 512 * 4 = 2,048 B each;
#   qmap1, qmap2: 256 fp32 = 1,024 B each, made once and shared by every parameter
EIGHT_BIT = sorted([131_072] * 4 + [2_048] * 4 + [1_024] * 2)


def test_8bit_adamw_state_bytes() -> None:
    trace = _big_trace("adamw8bit")
    assert _bytes(trace, Category.OPTIMIZER_STATE) == EIGHT_BIT
    assert not _bytes(trace, Category.PAGED_OPTIMIZER_STATE)


def test_paged_state_is_its_own_category_and_outside_the_allocator() -> None:
    trace = _big_trace("paged_adamw8bit")
    # the uint8 states of both matrices live in managed memory; absmax and qmaps are ordinary allocations
    assert _bytes(trace, Category.PAGED_OPTIMIZER_STATE) == [131_072] * 4
    assert _bytes(trace, Category.OPTIMIZER_STATE) == sorted([2_048] * 4 + [1_024] * 2)
    report = report_from_trace(trace, 8, A100)
    assert report.breakdown.paged_optimizer_state == 4 * 131_072
    # not in torch.cuda.memory_reserved(); on the card all the same
    assert report.device_peak_bytes == report.reserved_peak_bytes + A100.context_bytes + 4 * 131_072
    assert any("paged optimizer state" in line for line in report.assumptions)
    # paged_adamw32bit: fp32 states of 131,072 * 4 = 524,288 B each, all paged
    assert _bytes(_big_trace("paged_adamw32bit"), Category.PAGED_OPTIMIZER_STATE) == [524_288] * 4


# --- CPU truth: LoRA trains for real on the CPU ------------------------------------------------------------------


def _lora_zoo(name: str):
    mf, bf, lf = ZOO[name]

    def model() -> torch.nn.Module:
        return adapt(mf(), PeftSpec(r=8, alpha=16, dropout=0.05, target_modules="all-linear"), "", [])

    return model, bf, lf


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_lora_cpu_prediction_matches_profiler(name: str) -> None:
    recipe = Recipe(optimizer="adamw")
    factories = _lora_zoo(name)
    report = estimate_memory(*factories, BATCH, recipe=recipe, gpu=None)
    measured = real_cpu_peak(name, recipe, factories=factories)
    assert abs(report.allocated_peak_bytes - measured) <= 0.01 * measured, (report.allocated_peak_bytes, measured)
    trainable = [p.numel() for p in factories[0]().parameters() if p.requires_grad]
    # fp32 AdamW state of the adapters only: 2 x 4 B a trainable parameter, and each one's step counter (a 4 B fp32
    # tensor, on the CPU target's device: on a card it stays on the host)
    state = sum(a.nbytes for a in report.trace.allocations if a.category == Category.OPTIMIZER_STATE)
    assert state == 8 * sum(trainable) + 4 * len(trainable)


# --- the request ---------------------------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
         "architectures": ["LlamaForCausalLM"]}


def _request(**model):
    return {"model": {"source": "transformers", "config": LLAMA, **model}, "input": {"seq_len": 128},
            "gpus": ["T4-16GB"], "batch_size": 2, "planner": {"suggestions": False, "curve_points": 0}}


@pytest.mark.parametrize(("model", "field"), [
    ({"peft": {"rank": 8}}, "model.peft.rank"),
    ({"peft": {"method": "ia3"}}, "model.peft.method"),
    ({"quantization": {"method": "bnb-4bit"}}, "model.quantization"),
    ({"peft": {}, "quantization": {"method": "bnb-4bit", "quant_type": "int4"}},
     "model.quantization.bnb-4bit.quant_type"),
    ({"peft": {}, "quantization": {"method": "gptq"}}, "model.quantization"),
])
def test_bad_fine_tuning_options_name_their_field(model: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_request(_request(**model))
    assert err.value.field == field


def test_unknown_target_module_is_refused_before_simulating() -> None:
    from estimator.pipeline import estimate

    with pytest.raises(SpecError) as err:
        estimate(parse_request(_request(peft={"target_modules": ["qkv_proj"]})))
    assert err.value.field == "model.peft.target_modules"


def test_qlora_request_answers_with_its_assumptions() -> None:
    from estimator.pipeline import estimate

    response = estimate(parse_request(_request(peft={"r": 16, "target_modules": "all-linear"},
                                               quantization={"method": "bnb-4bit"})))
    lines = "\n".join(response.assumptions)
    assert "bnb-4bit (nf4, double quant, compute bf16): 14 linear layers quantized" in lines
    assert "LoRA (peft get_peft_model): r=16" in lines
    assert response.results[0].memory is not None and response.results[0].memory.fits


# --- the planner and the allocator ---------------------------------------------------------------------------------


def test_an_unfit_full_fine_tune_is_offered_lora_qlora_and_8bit_adamw_as_changes_of_method() -> None:
    from estimator.pipeline import estimate

    # 56 MiB: full fp32 AdamW of this 2.1M-parameter model (16 B a parameter, 34 MB, and its activations) does not
    # fit with the headroom; each change of method below does, checked by its own simulation
    card = {"name": "small-card", "memory_bytes": 56 * 2**20, "context_bytes": 0}
    result = estimate(parse_request({"model": {"source": "transformers", "config": LLAMA}, "input": {"seq_len": 128},
                                     "gpus": [card], "planner": {"reserve_bytes": 0, "curve_points": 0}})).results[0]
    assert result.recommended_batch_size is None
    methods = {next(iter(s.change.values())).get("method", next(iter(s.change.values())).get("name")): s
               for s in result.suggestions if s.changes_method}
    assert {"adamw8bit", "lora"} <= set(methods)
    qlora = [s for s in result.suggestions if "model.quantization" in s.change]
    assert qlora and qlora[0].changes_method and qlora[0].change["model.quantization"]["method"] == "bnb-4bit"
    assert all(s.recommended_batch_size is not None for s in [*methods.values(), *qlora])


def test_the_levers_simulated_beside_each_other_suggest_what_one_at_a_time_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from estimator.pipeline import estimate
    from estimator.simulate import background

    # the suggester starts the next lever's step in a forked child while it searches this one's
    card = {"name": "small-card", "memory_bytes": 56 * 2**20, "context_bytes": 0}
    request = {"model": {"source": "transformers", "config": LLAMA}, "input": {"seq_len": 128}, "gpus": [card],
               "planner": {"reserve_bytes": 0, "curve_points": 0}}
    monkeypatch.setattr(background, "enabled", lambda: True)
    beside = estimate(parse_request(request))
    monkeypatch.setattr(background, "enabled", lambda: False)
    alone = estimate(parse_request(request))
    assert beside.results[0].suggestions and beside.results[0].suggestions == alone.results[0].suggestions
    assert beside.provenance.simulations == alone.provenance.simulations
    assert beside.warnings == alone.warnings


def test_levers_skip_what_the_request_already_does() -> None:
    from estimator.options import Levers, PlanOptions
    from estimator.plan.suggest import levers

    def changes(**pulled) -> list[str]:
        return [next(iter(lever.change)) for lever in levers(PlanOptions(levers=Levers(**pulled)), True)
                if lever.method]

    assert changes(adaptable=True) == ["training.optimizer", "model.peft", "model.peft"]
    assert changes(adaptable=True, peft=True) == ["training.optimizer", "model.quantization"]
    assert changes(adaptable=True, peft=True, quantized=True, optimizer="paged_adamw8bit") == []
    assert changes(adaptable=False) == []  # a torchvision model, or no peft extra


def test_managed_bytes_count_against_the_card_outside_reserved() -> None:
    from estimator.replay.allocator import AllocatorConfig, replay_sized

    # a 4 MiB paged buffer beside a 10 MiB tensor: reserved is the tensor's 10 MiB segment, the card holds 14 MiB
    events = [(True, 0), (True, 1), (False, 1), (False, 0)]
    sizes = [4 * 2**20, 10 * 2**20]
    categories = [Category.PAGED_OPTIMIZER_STATE, Category.ACTIVATION]
    free = replay_sized(events, sizes, categories, AllocatorConfig(), timelines=False)
    assert (free.reserved_peak, free.managed_peak, free.device_peak) == (10 * 2**20, 4 * 2**20, 14 * 2**20)
    assert free.breakdown_at_peak == {Category.PAGED_OPTIMIZER_STATE: 4 * 2**20, Category.ACTIVATION: 10 * 2**20}
    # 12 MiB of capacity: the segment fits alone, not beside the resident paged bytes
    assert not replay_sized(events, sizes, categories, AllocatorConfig(12 * 2**20), timelines=False).fits
    assert replay_sized(events, sizes, categories, AllocatorConfig(14 * 2**20), timelines=False).fits
