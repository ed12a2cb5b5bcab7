"""Mixture-of-experts: the experts kernel the card runs, and tokens per expert (``model.moe_routing``).

docs/DESIGN.md, fact 21. One tiny Mixtral layer (hidden 64, intermediate 128, 4 experts, top-2, fp32),
one sequence of S = 16 tokens, so each simulation takes seconds. transformers 5.x's eager experts loop
(``MixtralExperts.forward``) gathers each expert's tokens with ``nonzero``, a size the data decides;
grouped_mm (the default) sorts all S x k = 32 (token, expert) pairs and only its offsets depend on routing.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import A100_40 as A100
from support import build_request

from estimator.errors import SpecError
from estimator.pipeline import estimate
from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training

pytestmark = pytest.mark.sim


MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 1000, "max_position_embeddings": 256}
EXPERTS = "model.layers.0.mlp.experts"
F32, LONG = 4, 8
S, K, E, H, INTER = 16, 2, 4, 64, 128  # tokens, top-k, experts, hidden, intermediate


def _request(config: dict[str, Any], seq_len: int = S, gpu: str = "A100-40GB", **model: Any) -> Any:
    return parse_request({"model": {"source": "transformers", "config": config, "task": "causal-lm", **model},
                          "input": {"seq_len": seq_len}, "gpus": [gpu]})


def _forward(impl: str, routing: str) -> list[tuple[str, int]]:
    """(op, bytes) of each allocation the experts module makes in the first forward, batch 1, fp32."""
    built = build_request(_request(MIXTRAL, experts_implementation=impl, moe_routing=routing))
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, 1, Recipe(), A100,
                            routing=built.moe_routing)
    return [(a.op, a.nbytes) for a in trace.allocations
            if a.iteration == 0 and a.phase == "forward" and a.module.startswith(EXPERTS)]


def _expert(tokens: int) -> list[tuple[str, int]]:
    """One pass of the eager loop's body for an expert that receives ``tokens`` tokens."""
    return [
        ("eq", 1),                               # expert_idx == num_experts: a 0-d bool
        ("nonzero", tokens * 2 * LONG),          # torch.where(expert_mask[e]): (tokens, 2) indices
        ("index", tokens * H * F32),             # hidden_states[token_idx]
        ("mm", tokens * 2 * INTER * F32),            # linear(current_state, gate_up_proj[e]): (tokens, 2I)
        ("silu", tokens * INTER * F32),              # act_fn(gate)
        ("mul", tokens * INTER * F32),               # * up
        ("mm", tokens * H * F32),                # linear(., down_proj[e]): (tokens, H)
        ("index", tokens * F32),                 # top_k_weights[token_idx, top_k_pos, None]
        ("mul", tokens * H * F32),               # the weighted output, index_add_'ed in place
    ]


# Before the loop: final_hidden_states = zeros_like(hidden) (S, H); one_hot(top_k_index, E + 1) decomposes
# to arange(E + 1) (int64), eq of (S, k, 1) with it (bool), and the cast to int64 (S, k, E + 1); the mask's
# sum over tokens and slots (E + 1,) int64, greater than 0 (bool) and its nonzero: (experts hit, 1) int64.
def _prologue(hit: int) -> list[tuple[str, int]]:
    return [("zeros_like", S * H * F32), ("arange", (E + 1) * LONG), ("eq", S * K * (E + 1)),
            ("_to_copy", S * K * (E + 1) * LONG), ("sum", (E + 1) * LONG), ("gt", E + 1), ("nonzero", hit * LONG)]


def test_eager_balanced_spreads_tokens_times_top_k_over_the_experts() -> None:
    # 16 tokens x top-2 = 32 pairs over 4 experts: all 4 hit, 8 tokens each
    assert _forward("eager", "balanced") == _prologue(E) + _expert(S * K // E) * E


def test_eager_worst_case_sends_every_token_to_the_same_top_k_experts() -> None:
    # 2 experts hit, each with all 16 tokens: every per-expert buffer twice the balanced one, half as many
    assert _forward("eager", "worst-case") == _prologue(K) + _expert(S) * K


def test_grouped_mm_buffers_do_not_depend_on_routing() -> None:
    pairs = S * K
    derived = [
        ("sort", pairs * LONG), ("sort", pairs * LONG),   # sort(expert_ids): values, perm
        ("floor_divide", pairs * LONG),                   # perm // k
        ("index", pairs * H * F32),                       # hidden_states[perm // k]: (S k, H)
        ("index", pairs * F32),                           # sample_weights[perm]
        ("_to_copy", pairs * 4),                          # expert_ids_g.int() for histc
        ("histc", E * 4), ("cumsum", E * 4),              # tokens per expert, offsets (int32)
        ("_grouped_mm", pairs * 2 * INTER * F32),             # up: (S k, 2I), fp32 (the fallback kernel)
        ("silu", pairs * INTER * F32), ("mul", pairs * INTER * F32),
        ("_grouped_mm", pairs * H * F32),                 # down: (S k, H)
        ("mul", pairs * H * F32),                         # * sample_weights
        ("empty_like", pairs * LONG), ("arange", pairs * LONG),  # inv_perm
        ("index", pairs * H * F32),                       # weighted_out[inv_perm]
        ("sum", S * H * F32),                             # .view(S, k, H).sum(1)
    ]
    assert _forward("grouped_mm", "balanced") == derived
    assert _forward("grouped_mm", "worst-case") == derived


def test_routing_and_experts_kernel_are_in_the_assumptions() -> None:
    assert [a for a in build_request(_request(MIXTRAL)).assumptions if "expert" in a] == [
        "experts: grouped_mm (transformers' default for MixtralForCausalLM, 1 MoE layer)",
        "moe_routing: balanced (2 of 4 experts per token, tokens x 2 / 4 per expert; the buffers' sizes do not "
        "depend on routing, only the offsets' values)"]


def test_amp_with_fp32_master_weights_runs_grouped_mm_in_fp32() -> None:
    # a real GPU runs it (torch's CUDA kernel takes fp32 and loops over the experts); the meta function refused
    request = _request({**MIXTRAL, "num_hidden_layers": 2}, seq_len=128)
    request = request.model_copy(update={"batch_size": 2, "training": request.training.model_copy(
        update={"precision": "amp-bf16"})})
    response = estimate(request)
    memory = response.results[0].memory
    assert memory is not None and memory.allocated_peak_bytes > 0
    assert "experts on A100-40GB: torch._grouped_mm runs its fallback, one mm per expert, in fp32" in \
        response.assumptions


@pytest.mark.parametrize("gpu, path", [
    ("A100-40GB", "its fallback, one mm per expert, in bf16; CUTLASS's needs sm90 or sm100, this card is sm80"),
    ("H100-80GB", "CUTLASS's grouped GEMM (bf16 on sm90)"),
])
def test_pure_bf16_takes_the_path_of_the_card(gpu: str, path: str) -> None:
    request = _request(MIXTRAL, gpu=gpu)
    request = request.model_copy(update={"batch_size": 2, "training": request.training.model_copy(
        update={"precision": "bf16"})})
    response = estimate(request)
    assert response.results[0].memory is not None
    assert f"experts on {gpu}: torch._grouped_mm runs {path}" in response.assumptions


def test_an_experts_kernel_on_a_model_without_experts_is_the_requests_error() -> None:
    gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
    with pytest.raises(SpecError) as err:
        estimate(_request(gpt2, experts_implementation="batched_mm"))
    assert err.value.field == "model.experts_implementation"
    assert "GPT2LMHeadModel has no experts kernel to choose" in str(err.value)


@pytest.mark.parametrize("field, value", [("experts_implementation", "deepgemm"), ("moe_routing", "random")])
def test_unknown_values_are_refused(field: str, value: str) -> None:
    with pytest.raises(SpecError):
        _request(MIXTRAL, **{field: value})


# JetMoE (its own gate, no experts kernel): JetMoeTopKGating scatters ones at each token's top-k into a
# (tokens, experts) zeros tensor, sums over the tokens and reads the counts (``expert_size.tolist()``) to split
# the sorted tokens between the experts (``split_with_sizes``); then one F.linear per expert.
JETMOE = {"model_type": "jetmoe", "num_hidden_layers": 1, "hidden_size": H, "intermediate_size": INTER,
          "num_local_experts": E, "num_experts_per_tok": K, "kv_channels": 16, "num_key_value_heads": 2,
          "vocab_size": 1000, "max_position_embeddings": 256}


def _jetmoe_expert_rows(routing: str) -> list[int]:
    """Rows of each expert's input projection in the MoE MLP (its F.linear output: rows x 2 I fp32)."""
    built = build_request(_request(JETMOE, moe_routing=routing))
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, 1, Recipe(), A100,
                            routing=built.moe_routing)
    return [a.nbytes // (2 * INTER * F32) for a in trace.allocations
            if a.iteration == 0 and a.phase == "forward" and a.module == "model.layers.0.mlp.input_linear"
            and a.op == "mm"]


def test_jetmoe_split_sizes_follow_balanced_routing() -> None:
    # 16 tokens x top-2 = 32 (token, expert) pairs over 4 experts: 8 rows each, summing to the split's input
    assert _jetmoe_expert_rows("balanced") == [S * K // E] * E


def test_jetmoe_split_sizes_follow_worst_case_routing() -> None:
    # every token to the same 2 experts: 16 rows each, and the other experts' empty splits allocate nothing
    assert _jetmoe_expert_rows("worst-case") == [S] * K


def test_jetmoe_routing_is_in_the_assumptions() -> None:
    assert [a for a in build_request(_request(JETMOE)).assumptions if "expert" in a] == [
        "moe_routing: balanced (2 of 4 experts per token, tokens x 2 / 4 per expert; JetMoeTopKGating's split "
        "sizes, 2 gates)"]


# Switch Transformers (its own top-1 router, no experts kernel): SwitchTransformersTop1Router makes
# one_hot(argmax) over (batch, seq) and drops the tokens past ``expert_capacity`` in each sequence
# (``mask * (cumsum(mask, dim=-2) <= capacity)``); the experts loop then gathers each expert's tokens with
# ``torch.where(expert_mask[e])``: a (tokens, 2) int64 nonzero. Batch 2 of 16 tokens, 4 experts, capacity 5.
SWITCH = {"model_type": "switch_transformers", "num_layers": 2, "num_decoder_layers": 2,
          "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1, "d_model": H, "d_ff": INTER, "d_kv": 16,
          "num_heads": 4, "num_experts": E, "expert_capacity": 5, "vocab_size": 1000, "decoder_start_token_id": 0}
SWITCH_EXPERTS = "encoder.block.1.layer.1.mlp.experts"


def _switch_nonzero_rows(routing: str) -> list[int]:
    """Rows of each nonzero in the encoder's sparse MLP: first the experts hit, then each expert's tokens."""
    request = parse_request({"model": {"source": "transformers", "config": SWITCH, "task": "seq2seq-lm",
                                       "moe_routing": routing}, "input": {"seq_len": S}, "gpus": ["A100-40GB"]})
    built = build_request(request)
    trace = record_training(built.factory, built.batch_factory, built.loss_fn, 2, Recipe(), A100,
                            routing=built.moe_routing)
    found = [a for a in trace.allocations if a.iteration == 0 and a.phase == "forward"
             and a.module == SWITCH_EXPERTS and a.op == "nonzero"]
    return [found[0].nbytes // LONG] + [a.nbytes // (2 * LONG) for a in found[1:]]


def test_switch_balanced_routing_spreads_each_sequence_within_capacity() -> None:
    # 16 tokens of a sequence over 4 experts: 4 each (under the capacity of 5), twice for the batch of 2
    assert _switch_nonzero_rows("balanced") == [E] + [2 * S // E] * E


def test_switch_worst_case_routing_fills_the_experts_to_their_capacity() -> None:
    # Sending every token to one expert would route only 5 of each sequence's 16 (the rest dropped): less than
    # balanced. The most a capacity router can route fills the experts in turn: 5, 5, 5 and the last 1 of each
    # sequence, 4 experts hit, twice for the batch of 2.
    assert _switch_nonzero_rows("worst-case") == [E, 2 * 5, 2 * 5, 2 * 5, 2 * 1]
