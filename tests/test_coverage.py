"""The coverage sweep (estimator/testing/coverage.py): model types a user may bring simulate one step.

CI runs a fixed sample: a dozen transformers types over the four tasks and five of the seeded timm names. Each
simulates, or sits in estimator/testing/coverage_exclusions.json with its reason; an excluded type that simulates
now fails the test, so that the list only shrinks. The whole sweep (every type; ``make coverage`` prints its
figures) runs here only with ``BATCHFIT_COVERAGE=all``: it asserts that at least 95 % of the transformers types
and of the timm sample simulate, and that the exclusion list holds exactly the types that do not.
"""

from __future__ import annotations

import os

import pytest

from estimator.testing import coverage

pytestmark = pytest.mark.zoo

# Spread over the tasks and over the kinds of model: dense, MoE, hybrid linear attention, state space,
# encoder-only, encoder-decoder, vision transformer, convnet.
SAMPLE = [
    "causal-lm:llama", "causal-lm:gpt2", "causal-lm:mixtral", "causal-lm:qwen3_next", "causal-lm:falcon_mamba",
    "masked-lm:bert", "masked-lm:roberta", "masked-lm:deberta-v2",
    "seq2seq-lm:t5", "seq2seq-lm:bart",
    "image-classification:vit", "image-classification:convnext",
]
TIMM_IN_SAMPLE = 5


def _sample() -> list[str]:
    types = coverage.transformers_types()
    keys = [k for k in SAMPLE if k.split(":", 1)[1] in types[k.split(":", 1)[0]]]
    return keys + [f"timm:{n}" for n in coverage.timm_names()[:TIMM_IN_SAMPLE]]


@pytest.mark.unit
def test_layer_counts_and_per_layer_lists_are_cut_consistently() -> None:
    """llama: one count; t5: encoder and decoder counts; qwen3_next: its pattern (3 linear, 1 full) is kept
    whole, 4 layers, so that both kinds of layer are simulated."""
    assert coverage.derive_config("llama") == {"num_hidden_layers": 2, "model_type": "llama"}
    t5 = coverage.derive_config("t5", "seq2seq-lm")
    assert (t5["num_layers"], t5["num_decoder_layers"], t5["decoder_start_token_id"]) == (2, 2, 0)
    q = coverage.derive_config("qwen3_next")
    assert q["num_hidden_layers"] == len(q["layer_types"]) == 4
    assert set(q["layer_types"]) == {"linear_attention", "full_attention"}
    assert "id2label" not in coverage.derive_config("bart", "seq2seq-lm")  # keyed by label, not by layer
    g = coverage.derive_config("gemma3n_text")  # 4 sliding + 1 full making the cache, as many sharing it
    assert (g["num_hidden_layers"], g["num_kv_shared_layers"]) == (10, 5)


@pytest.mark.unit
def test_the_cut_keeps_sections_whole_periods_and_one_layer_of_an_indexed_kind() -> None:
    """dory: input + recurrent + output layers sum to the total, and its layer_types (an (attention, mlp) pair per
    layer, 3 sliding then 1 full) repeat every 8 entries; the config class accepts the cut (it checks the sum)."""
    from transformers import AutoConfig

    d = coverage.derive_config("dory")
    assert (d["num_hidden_layers"], d["n_input_layers"], d["n_recurrent_layers"], d["n_output_layers"]) == (8, 2, 4, 2)
    assert d["layer_types"] == ["sliding_attention", "mlp"] * 3 + ["full_attention", "mlp"]
    built = AutoConfig.for_model("dory", **{k: v for k, v in d.items() if k != "model_type"})
    assert (built.num_hidden_layers, built.n_recurrent_layers) == (4, 2)
    assert built.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    # a repeating pattern keeps a whole period even where a shorter prefix names every kind
    assert coverage._cut({"num_hidden_layers": 6, "layer_types": ["a", "b", "b"] * 2})["layer_types"] == ["a", "b", "b"]
    # indices of one kind of layer, all cut (bamba's attention at 9, 18, 27): the last layer kept is of that kind
    assert coverage._cut({"num_hidden_layers": 32, "attn_layer_indices": [9, 18, 27]})["attn_layer_indices"] == [1]
    assert coverage._cut({"num_hidden_layers": 32, "attn_layer_indices": [1, 9]})["attn_layer_indices"] == [1]
    assert "mlp_only_layers" not in coverage._cut({"num_hidden_layers": 32, "mlp_only_layers": []})


@pytest.mark.unit
def test_an_override_may_hold_for_one_task_and_set_the_input() -> None:
    """reformer: its causal LM needs is_decoder, its masked LM must not have it; both train only at
    seq_len = prod(axial_pos_shape)."""
    causal = coverage.transformers_request("causal-lm", "reformer")
    masked = coverage.transformers_request("masked-lm", "reformer")
    assert causal["model"]["config"]["is_decoder"] is True and "is_decoder" not in masked["model"]["config"]
    assert causal["input"] == masked["input"] == {"seq_len": 4096}
    assert coverage.transformers_request("causal-lm", "llama")["input"] == {"seq_len": coverage.SEQ_LEN}


@pytest.mark.unit
def test_exclusions_give_reasons() -> None:
    for key, reason in coverage.exclusions().items():
        assert ":" in key and isinstance(reason, str) and reason.strip(), key
    for key, entry in coverage.overrides().items():
        assert entry.get("reason", "").strip() and isinstance(entry.get("config"), dict), key


@pytest.mark.parametrize("key", _sample())
def test_sampled_type_simulates_or_is_excluded(key: str) -> None:
    outcome = coverage.run_one(key)
    excluded = coverage.exclusions()
    if outcome.status == "simulates":
        assert key not in excluded, f"{key} simulates now: drop it from coverage_exclusions.json"
    else:
        assert key in excluded, f"{key}: {outcome.status} {outcome.reason}"


@pytest.mark.skipif(os.environ.get("BATCHFIT_COVERAGE") != "all", reason="the whole sweep: BATCHFIT_COVERAGE=all")
def test_whole_sweep() -> None:
    outcomes = {o.key: o for o in coverage.sweep(coverage.all_keys(), timeout_s=300)}
    failing = {k for k, o in outcomes.items() if o.status != "simulates"}
    excluded = set(coverage.exclusions())
    assert failing - excluded == set(), {k: outcomes[k].reason for k in failing - excluded}
    assert excluded - failing == set(), f"excluded but simulating (or no longer swept): {excluded - failing}"
    for source in ("transformers", "timm"):
        keys = [k for k in outcomes if (k.startswith("timm:") == (source == "timm"))]
        share = sum(outcomes[k].status == "simulates" for k in keys) / len(keys)
        assert share >= 0.95, f"{source}: {share:.1%} simulate"
