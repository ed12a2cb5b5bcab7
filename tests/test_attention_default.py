"""``model.attn_implementation`` null: the kernel transformers itself picks for the class.

transformers (modeling_utils.py, ``PreTrainedModel.get_correct_attn_implementation``) tries sdpa when not told
and falls back to eager for a class whose ``_supports_sdpa`` is False (bloom, gemma2, mamba, ...), where
batchfit used to force sdpa and fail. A named kernel the class cannot run is the request's 422. The models are
tiny (1 layer, hidden 64) so that each simulation takes seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import A100_40 as A100
from support import build_request

from estimator.errors import SpecError
from estimator.pipeline import estimate
from estimator.replay.report import report_from_trace
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training

pytestmark = pytest.mark.sim


GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
# bloom has no SDPA in the installed transformers (BloomForCausalLM._supports_sdpa is False)
BLOOM = {"model_type": "bloom", "n_layer": 1, "hidden_size": 64, "n_head": 4, "vocab_size": 1000}
# an encoder-decoder whose top class supports SDPA, and whose decoder (roformer) does not
ENC_DEC = {"model_type": "encoder-decoder", "decoder_start_token_id": 0, "pad_token_id": 0,
           "encoder": {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                       "intermediate_size": 128, "vocab_size": 1000},
           "decoder": {"model_type": "roformer", "num_hidden_layers": 1, "hidden_size": 64, "embedding_size": 64,
                       "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000, "is_decoder": True,
                       "add_cross_attention": True}}


def _request(config: dict[str, Any], attn: str | None = None, task: str = "causal-lm", **extra: Any) -> Any:
    model: dict[str, Any] = {"source": "transformers", "config": config, "task": task}
    if attn is not None:
        model["attn_implementation"] = attn
    return parse_request({"model": model, "input": {"seq_len": 128}, "gpus": ["A100-40GB"], **extra})


def _peak(config: dict[str, Any], attn: str | None) -> int:
    built = build_request(_request(config, attn))
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, 2, Recipe(), A100)
    return report_from_trace(trace, 2, A100).allocated_peak_bytes


def _attention(assumptions: list[str]) -> list[str]:
    return [line for line in assumptions if line.startswith("attention:")]


def test_the_default_is_null() -> None:
    assert _request(GPT2).model.attn_implementation is None


def test_a_class_with_sdpa_gets_sdpa_as_before() -> None:
    built = build_request(_request(GPT2))
    assert _attention(built.assumptions) == ["attention: sdpa (transformers' default for GPT2LMHeadModel)"]
    assert _attention(build_request(_request(GPT2, "eager")).assumptions) == [
        "attention: eager (model.attn_implementation, on GPT2LMHeadModel)"]
    # the default simulates exactly what "sdpa" did (the old default); eager keeps (B, H, S, S) probabilities
    default, sdpa, eager = _peak(GPT2, None), _peak(GPT2, "sdpa"), _peak(GPT2, "eager")
    assert default == sdpa
    assert eager > sdpa


def test_a_class_without_sdpa_simulates_with_eager() -> None:
    response = estimate(_request(BLOOM, batch_size=2))
    assert response.results[0].memory is not None and response.results[0].memory.allocated_peak_bytes > 0
    assert _attention(response.assumptions) == [
        "attention: eager (transformers' default for BloomForCausalLM, which has no SDPA)"]
    assert _peak(BLOOM, None) == _peak(BLOOM, "eager")


@pytest.mark.parametrize("through", ["build", "estimate"])
def test_a_named_kernel_the_class_lacks_is_the_requests_error(through: str) -> None:
    request = _request(BLOOM, "sdpa")
    with pytest.raises(SpecError) as info:
        build_request(request) if through == "build" else estimate(request)
    assert info.value.field == "model.attn_implementation" and info.value.value == "sdpa"
    assert info.value.expected.startswith("one BloomForCausalLM supports: eager (")


def test_a_sub_model_without_sdpa() -> None:
    # transformers resolves each sub-model's kernel on its own: the default runs eager in the decoder only
    built = build_request(_request(ENC_DEC, task="seq2seq-lm"))
    assert _attention(built.assumptions) == [
        "attention: sdpa (transformers' default for EncoderDecoderModel); eager in RoFormerForCausalLM"]
    # naming sdpa fails in the decoder's __init__ (the top class passes the check): still the request's error
    with pytest.raises(SpecError) as info:
        build_request(_request(ENC_DEC, "sdpa", task="seq2seq-lm"))
    assert info.value.field == "model.attn_implementation"
    assert "RoFormerForCausalLM" in info.value.expected


def test_a_kernel_batchfit_does_not_offer_is_refused_when_parsed() -> None:
    with pytest.raises(SpecError) as info:
        _request(GPT2, "flex_attention")
    assert info.value.field == "model.attn_implementation"
