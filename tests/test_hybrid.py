"""Hybrid and state-space transformers models: the torch path without the fused kernels, and the training cache.

mamba-ssm, causal-conv1d and flash-linear-attention are not installed here (nor, usually, on a training node):
transformers then runs each kernel's reference torch function on every device (integrations/hub_kernels.py,
``use_kernel_func_from_hub_with_fallback``), which is what the simulation runs too; the builder says so in its
assumptions. Hybrids whose forward reads ``use_cache`` from the config (``merge_with_config_defaults``) build a
``DynamicCache`` during training too, unless gradient checkpointing is on; the simulation builds it as well, and a
real CPU step of one such model checks the bytes.

Each type's config is its config class's defaults with the layer count cut to two and every per-layer list cut
consistently, keeping at least one attention layer: a cut that leaves only linear-attention layers makes
transformers' own ``DynamicCache.get_seq_length`` raise (no attention layer to read a length from), in training
as in generation.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

import estimator
from estimator.measure.cpu import real_cpu_peak
from estimator.pipeline import estimate_memory
from estimator.simulate.recipe import Recipe
from estimator.testing.zoo import _lm_loss, _tokens

pytestmark = pytest.mark.sim

LAYERS = 2
ATTENTION = ("full_attention", "attention", "hybrid", "indexed_attention", "sliding_attention")

# Configs whose attention layers are placed by something other than a per-layer list. zamba ties its shared
# attention block's weights across hybrid layers and so needs two of them (layers 2 and 3 of 4): with one the tie
# matches nothing and transformers refuses the config.
OVERRIDES: dict[str, dict[str, Any]] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [LAYERS - 1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}
WHOLE: dict[str, dict[str, Any]] = {  # configs given whole (the layer count is not num_hidden_layers alone)
    "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention"]},  # len() is the layer count
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 1, "attn_layer_offset": 0},
    "recurrent_gemma": {"num_hidden_layers": 2, "block_types": ["recurrent", "attention"]},  # pattern repeats
}

# Each type that simulates, with the fused-kernel package its assumption line names (besides causal-conv1d).
MAMBA, FLA, CONV = "mamba-ssm", "flash-linear-attention", "causal-conv1d"
HYBRIDS = {
    "bailing_hybrid": FLA, "bamba": MAMBA, "falcon_h1": MAMBA, "falcon_mamba": MAMBA, "granitemoehybrid": MAMBA,
    "jamba": MAMBA, "kimi_linear": FLA, "lara_mini": FLA, "lfm2": CONV, "lfm2_moe": CONV, "lfm3": CONV,
    "mamba": MAMBA, "mamba2": MAMBA, "nemotron_h": MAMBA, "olmo_hybrid": FLA, "qwen3_5": FLA, "qwen3_5_moe": FLA,
    "qwen3_next": FLA, "zamba": MAMBA, "zamba2": MAMBA,
}


def cut_config(model_type: str, layers: int = LAYERS) -> dict[str, Any]:
    """The config class's defaults with ``layers`` layers, every per-layer list cut to match, one attention
    layer at least (a nested text config is cut the same way)."""
    from transformers import AutoConfig

    if model_type in WHOLE:
        return {**WHOLE[model_type], "model_type": model_type}
    top = AutoConfig.for_model(model_type)
    text = top.get_text_config()
    defaults = text.to_dict()
    total = defaults.get("num_hidden_layers")
    config: dict[str, Any] = {"num_hidden_layers": layers}
    for key, value in defaults.items():
        if isinstance(value, list) and isinstance(total, int) and len(value) == total:
            cut = value[:layers]
            if key in ("layer_types", "layers_block_type") and not any(v in ATTENTION for v in cut):
                cut[-1] = next((v for v in value if v in ATTENTION), "full_attention")
            config[key] = cut
    if model_type == "lfm2":
        config["full_attn_idxs"] = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
    if model_type == "zamba2":
        config["hybrid_layer_ids"] = [i for i, t in enumerate(config["layers_block_type"]) if t == "hybrid"]
    config.update(OVERRIDES.get(model_type, {}))
    return {"text_config": config, "model_type": model_type} if text is not top else {**config,
                                                                                        "model_type": model_type}


def _request(config: dict[str, Any]) -> Any:
    return estimator.parse_request({
        "model": {"source": "transformers", "config": config, "task": "causal-lm"},
        "input": {"seq_len": 64},
        "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw"}},
        "gpus": ["A100-80GB"], "batch_size": 2,
        "planner": {"curve_points": 0, "confirm": "none", "suggestions": False}})


# CI runs one type per kernel family (about 25 s each at the config classes' default sizes); `make coverage`
# (BATCHFIT_COVERAGE=all) runs every type.
SAMPLE = ("mamba", "qwen3_next", "lfm2")
TYPES = sorted(HYBRIDS) if os.environ.get("BATCHFIT_COVERAGE") == "all" else SAMPLE


@pytest.mark.parametrize("model_type", TYPES)
def test_hybrid_simulates_with_torch_path(model_type: str) -> None:
    result = estimator.estimate(_request(cut_config(model_type)))
    lines = [a for a in result.assumptions if a.startswith(f"{model_type}: the torch path")]
    assert len(lines) == 1, result.assumptions
    assert HYBRIDS[model_type] in lines[0] and CONV in lines[0] and "not installed" in lines[0]
    assert result.results[0].max_batch_size is not None and result.results[0].memory.allocated_peak_bytes > 0


def test_recurrent_gemma_simulates_with_attention_kept() -> None:
    """RecurrentGemma's RG-LRU is plain torch (no optional kernel, no torch-path line); the default block pattern
    (recurrent, recurrent, attention) cut to two layers has no attention layer, so the cut keeps one."""
    result = estimator.estimate(_request(cut_config("recurrent_gemma")))
    assert not [a for a in result.assumptions if "torch path" in a]
    assert result.results[0].max_batch_size is not None


def test_only_linear_attention_layers_is_transformers_own_error() -> None:
    """The sweep's crude cut (two linear-attention layers, no attention layer): the cache has no length to give."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_next", **_TINY, layer_types=["linear_attention"] * 2)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="get_seq_length"):
        model(torch.zeros(1, 8, dtype=torch.long))


_TINY: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, vocab_size=256, mlp_only_layers=[0, 1], intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=64)


def _tiny_qwen3_next() -> torch.nn.Module:
    """A 2-layer Qwen3-Next (one gated-delta-rule layer, one attention layer, dense MLPs: no routing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_next", **_TINY, layer_types=["linear_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def test_training_forward_builds_cache() -> None:
    """use_cache comes from the config in training (merge_with_config_defaults): the output carries a cache."""
    model = _tiny_qwen3_next().train()
    out = model(torch.zeros(1, 8, dtype=torch.long))
    assert type(out.past_key_values).__name__ == "DynamicCache"


def test_cpu_truth_hybrid_with_training_cache() -> None:
    """The CPU-target prediction of a hybrid whose training forward builds a cache, against a real CPU step."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    factories = (_tiny_qwen3_next, _tokens(256, 32), _lm_loss)
    recipe = Recipe(optimizer="adamw")
    predicted = estimate_memory(*factories, 4, recipe=recipe, gpu=None).allocated_peak_bytes
    measured = real_cpu_peak("qwen3_next", recipe, factories=factories)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
