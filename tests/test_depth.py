"""Deep models simulated shallow (estimator/simulate/depth.py): the deepened trace is the full simulation's, event
for event, or the full simulation runs."""

from __future__ import annotations

import dataclasses

import pytest

from estimator.gpus import get_gpu
from estimator.models import build
from estimator.pipeline import estimate, job_of
from estimator.plan.periodic import NotPeriodic, drifting, repeated
from estimator.request.parse import parse_request
from estimator.simulate import depth
from estimator.simulate.block_tokens import BlockCodec
from estimator.simulate.depth import Deepener, _rule
from estimator.simulate.record import record_built
from estimator.trace import Allocation, Trace

pytestmark = pytest.mark.sim


@pytest.fixture(autouse=True)
def _no_world_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's distributed steps search their own rule (``_WORLD_RULES``: none from another test's)."""
    monkeypatch.setattr(depth, "_WORLD_RULES", {})

A100 = get_gpu("A100-80GB")
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "num_hidden_layers": 16}
CAUSAL = {"source": "transformers", "task": "causal-lm", "config": LLAMA}
GPT2 = {"source": "transformers", "task": "causal-lm",
        "config": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 9, "vocab_size": 256,
                   "n_positions": 128}}
BERT = {"source": "transformers", "task": "sequence-classification",
        "config": {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_hidden_layers": 12, "vocab_size": 256}}
LORA = {"method": "lora", "r": 4, "target_modules": "all-linear"}

# name -> (model, training): each deepened at batch 1, then at batches 2 and 5 by the rule found at 1
CASES = {
    "llama amp-bf16": (CAUSAL, {"precision": "amp-bf16"}),
    "llama fp32 sgd": (CAUSAL, {"optimizer": {"name": "sgd"}}),
    "llama checkpointing": (CAUSAL, {"precision": "amp-fp16", "gradient_checkpointing": True}),
    "llama selective checkpointing": (CAUSAL, {"precision": "amp-bf16", "gradient_checkpointing": "selective"}),
    "llama accumulation": (CAUSAL, {"precision": "amp-bf16", "grad_accumulation_steps": 2}),
    # the last block keeps its gathered parameters (torchtitan): depth 1 is not like the others
    "llama fsdp": (CAUSAL, {"precision": "fp32", "distributed": {"strategy": "fsdp", "world_size": 4,
                                                                 "fsdp": {"param_dtype": "bf16"}}}),
    "llama lora": ({**CAUSAL, "peft": LORA}, {"precision": "amp-bf16"}),
    # a merged optimizer segment whose insertion point drifts: depths 1 to 5 the first time
    "llama qlora paged": ({**CAUSAL, "peft": LORA, "quantization": {"method": "bnb-4bit"}},
                          {"precision": "amp-bf16", "gradient_checkpointing": True,
                           "optimizer": {"name": "paged_adamw8bit"}}),
    "gpt2 eager": ({**GPT2, "attn_implementation": "eager"}, {}),
    # the top block's incoming gradient comes from the pooler, the others' from the block above
    "bert sequence classification": (BERT, {"precision": "amp-fp16"}),
}


def _built(model: dict, training: dict, seq_len: int = 32):
    job = job_of(parse_request({"model": model, "input": {"seq_len": seq_len}, "training": training}))
    return build(job.model, job.input), job.recipe


def _same(full: Trace, deep: Trace) -> None:
    assert deep.events == full.events
    assert deep.allocations == full.allocations
    assert deep.flops == full.flops
    assert deep.assumptions[:-1] == full.assumptions  # and one line more: how it was simulated
    assert "deepened" in deep.assumptions[-1]
    assert (deep.unsupported, deep.sdpa_calls, deep.card_queries, deep.capability_thresholds) == (
        full.unsupported, full.sdpa_calls, full.card_queries, full.capability_thresholds)


def _shallow_depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The depths each shallow simulation from now on runs at, in order (all in this process: no spare core)."""
    from estimator.simulate import background

    monkeypatch.setattr(background, "spare_core", lambda: False)
    asked: list[int] = []
    shallow = Deepener._shallow

    def counted(self, n, *args, **kwargs):
        asked.append(n)
        return shallow(self, n, *args, **kwargs)

    monkeypatch.setattr(Deepener, "_shallow", counted)
    return asked


@pytest.mark.parametrize("name", list(CASES))
def test_a_deepened_step_is_the_full_simulation_event_for_event(name: str) -> None:
    model, training = CASES[name]
    built, recipe = _built(model, training)
    deepener = Deepener(built)
    for batch in (1, 2, 5):  # batch 1 takes other paths in places: the rule found there must hold at 2 and 5
        deep = deepener.record(batch, recipe, A100)
        assert deepener.periodic, f"{name} at batch {batch} was simulated in full"
        _same(record_built(built, batch, recipe, A100), deep)


def test_the_depth_is_found_from_the_config() -> None:
    built, _ = _built(CAUSAL, {})
    assert built.depth is not None and (built.depth.layers, built.depth.container) == (16, "model.layers")
    built, _ = _built(GPT2, {})
    assert built.depth is not None and (built.depth.layers, built.depth.container) == (9, "transformer.h")
    # a per-layer list would not follow a copied config's depth: no shortcut
    built, _ = _built({**CAUSAL, "config": {**LLAMA, "model_type": "qwen2", "max_window_layers": 16,
                                            "layer_types": ["full_attention"] * 16}}, {})
    assert built.depth is None


DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 256,
            "num_hidden_layers": 10, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
            "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
            "v_head_dim": 16}
# blocks that differ by their index with no per-layer list: a model built with 1 to 5 blocks would have only the
# first kind (dense MLPs; no adapter on down_proj), and a trace grown from them would miss the others' memory
UNLIKE = {
    "deepseek dense below experts": {"source": "transformers", "task": "causal-lm",
                                     "config": {**DEEPSEEK, "first_k_dense_replace": 5}},
    "lora on the last block's down_proj": {**CAUSAL, "peft": {"method": "lora", "r": 4,
                                                              "target_modules": ["q_proj", "layers.15.mlp.down_proj"]}},
}


@pytest.mark.parametrize("name", list(UNLIKE))
def test_blocks_that_differ_by_their_index_are_simulated_in_full(name: str) -> None:
    built, recipe = _built(UNLIKE[name], {"precision": "amp-bf16"})
    assert built.depth is None
    trace = Deepener(built).record(2, recipe, A100)
    assert trace.allocations == record_built(built, 2, recipe, A100).allocations
    assert not any("deepened" in line for line in trace.assumptions)


def test_a_shallow_build_unlike_the_full_model_is_not_used() -> None:
    built, recipe = _built(CAUSAL, {})
    assert built.depth is not None
    assert built.depth.at(3) is not None  # like blocks: the shallow build stands for the full one
    offered = built.depth.at
    # a build at another depth whose blocks or other modules are not the full model's is refused (at gives None)
    built.depth = dataclasses.replace(built.depth, at=lambda n: None if n == 2 else offered(n))
    deepener = Deepener(built)
    trace = deepener.record(1, recipe, A100)
    assert deepener.periodic is False and not any("deepened" in line for line in trace.assumptions)


def test_a_block_signature_leaves_the_index_out_and_keeps_the_rest() -> None:
    import torch

    from estimator.models import blocks

    class Block(torch.nn.Module):
        def __init__(self, layer_idx: int, width: int = 4, window: int | None = None) -> None:
            super().__init__()
            self.layer_idx, self.window = layer_idx, window
            self.proj = torch.nn.Linear(width, width)

    assert blocks.signature(Block(0)) == blocks.signature(Block(7))
    assert blocks.signature(Block(0)) != blocks.signature(Block(0, width=8))
    assert blocks.signature(Block(0)) != blocks.signature(Block(0, window=16))  # a sliding window by index
    frozen = Block(0)
    frozen.proj.weight.requires_grad_(False)
    assert blocks.signature(frozen) != blocks.signature(Block(0))
    model = torch.nn.Sequential(torch.nn.ModuleList([Block(0), Block(1)]))
    assert blocks.container_in(model, "0", 2) == "0" and blocks.alike(model, "0") is not None
    model[0].append(Block(2, window=16))
    assert blocks.alike(model, "0") is None


def test_a_prefetched_simulation_hands_its_rule_to_the_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    from estimator.simulate import background
    from estimator.simulate.source import Simulator

    built, recipe = _built(CAUSAL, {"precision": "amp-bf16"})
    monkeypatch.setattr(background, "enabled", lambda: True)
    simulator = Simulator(built, recipe)
    simulator.prefetch(2, A100)
    shallow = []  # the parent's own shallow simulations, from here on (the child was forked before)

    def counted(built, batch, recipe, gpu, notes=()):
        shallow.append(batch)
        return record_built(built, batch, recipe, gpu, notes=notes)

    monkeypatch.setattr(depth, "record_built", counted)
    monkeypatch.setattr(background, "spare_core", lambda: False)  # every shallow simulation here, counted
    trace, runs = simulator.simulate(2, A100)  # collected from the child, which searched the rule
    assert runs == 1 and shallow == [] and simulator.deepener.periodic and simulator.deepener.rule is not None
    _same(record_built(built, 2, recipe, A100), trace)
    learnt = simulator.deepener.rule
    simulator.deepener.learn((False, None, {}))  # what the parent knows stands
    assert simulator.deepener.rule is learnt
    _same(record_built(built, 1, recipe, A100), simulator.simulate(1, A100)[0])
    assert shallow == [1, 1]  # by the rule: depths 1 and 2 alone, no search


def test_what_groups_blocks_is_simulated_in_full() -> None:
    built, recipe = _built(CAUSAL, {"distributed": {"strategy": "ddp", "world_size": 2}})
    assert not depth.worth_it(built, recipe)  # DDP's 25 MiB buckets span blocks
    deepener = Deepener(built)
    trace = deepener.record(2, recipe, A100)
    assert deepener.periodic is None and not any("deepened" in line for line in trace.assumptions)


def test_a_shallow_model_is_simulated_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    built, recipe = _built(CAUSAL, {})
    monkeypatch.setattr(depth, "MIN_LAYERS", 17)  # 16 blocks: under the limit
    assert not depth.worth_it(built, recipe)


def test_the_planner_answers_the_same_with_and_without_the_shortcut(monkeypatch: pytest.MonkeyPatch) -> None:
    request = {"model": CAUSAL, "input": {"seq_len": 64}, "training": {"precision": "amp-bf16"},
               "gpus": ["T4-16GB", "A100-80GB"], "planner": {"suggestions": False}}
    deep = estimate(parse_request(request))
    monkeypatch.setattr(depth, "MIN_LAYERS", 10**6)
    full = estimate(parse_request(request))
    assert any("deepened" in line for line in deep.assumptions)
    assert not any("deepened" in line for line in full.assumptions)
    # every number of every card (max, memory, curve, seconds); the reports' notes but the deepened line
    assert _without_deepened(deep.results) == _without_deepened(full.results)
    assert deep.provenance.simulations == full.provenance.simulations


def _without_deepened(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _without_deepened(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_deepened(v) for v in value if not (isinstance(v, str) and "deepened" in v)]
    return value


# The rules on token sequences: ``a``, ``b`` stand for one block's events in two runs (forward, then optimizer)


def test_a_run_at_a_junction_grows_right() -> None:
    # A^n B^n: the alignment may insert "AB" at the junction, which a repeated rule would insert twice there
    tokens = {n: ["s"] + ["a"] * n + ["b"] * n + ["e"] for n in range(1, 6)}
    want = ["s"] + ["a"] * 30 + ["b"] * 30 + ["e"]
    rule = _rule(tokens, None)
    assert rule.grown(tokens[rule.base], 30 - rule.base) == want


def test_a_repeated_rule_is_checked_by_its_third_depth() -> None:
    tokens = {1: ["s", "a", "e"], 2: ["s", "a", "a", "e"], 3: ["s", "a", "a", "a", "e"]}
    rule = repeated(1, tokens[1], tokens[2])
    assert rule.grown(tokens[1], 2) == tokens[3]
    assert rule.grown(tokens[1], 7) == ["s"] + ["a"] * 8 + ["e"]


def test_what_does_not_repeat_is_refused() -> None:
    # a block whose events change with depth (a bucket that grows): a replacement, not an insertion
    grows = {n: ["s", ("bucket", n), "e"] for n in range(1, 6)}
    with pytest.raises(NotPeriodic):
        _rule(grows, None)
    # two blocks at depth 3 where the rule from 1 to 2 says three
    # a run that grows quadratically (an all-to-all of every pair of blocks)
    square = {n: ["a"] * n + ["c"] * (n * n) for n in range(1, 6)}
    with pytest.raises(NotPeriodic):
        _rule(square, None)
    with pytest.raises(NotPeriodic):
        drifting(2, ["a"], ["a", "x"], ["a", "x", "yy", "z"])


def test_tokens_round_trip_and_name_each_block() -> None:
    # two blocks: a forward activation per block (up), freed in backward (down, the newest first)
    allocations = [Allocation(64, "forward", f"m.layers.{k}.mlp", "mm", 0, "activation") for k in range(2)]
    trace = Trace(allocations, [(True, 0), (True, 1), (False, 1), (False, 0)])
    codec = BlockCodec("m.layers")
    tokens = codec.tokens(trace, 2)
    kind = (64, "forward", "m.layers.#.mlp", "mm", "activation", 0, 0)
    assert tokens == [("A", kind, "first"), ("A", kind, 1), ("F", kind, ("newest", 0)), ("F", kind, ("newest", 0))]
    assert codec.decode(tokens, 2) == (trace.allocations, trace.events)
    # the same tokens a block deeper name the third block
    three = tokens[:2] + [("A", kind, 1), ("F", kind, ("newest", 0))] + tokens[2:]
    names = [a.module for a in codec.decode(three, 3)[0]]
    assert names == ["m.layers.0.mlp", "m.layers.1.mlp", "m.layers.2.mlp"]


def test_a_queue_is_read_alike_at_every_depth_with_ties_as_the_oldest() -> None:
    """Gradients freed in a queue (the optimizer's order): at depth 1 each kind's only free is both its newest
    and its oldest. Read as the newest, a block more inserts frees of another name before it, a block more again
    puts them elsewhere (no rule from depth 1); read as the oldest, each block inserts the same tokens at the
    same place, and a rule holds from depth 1. ``deepen`` tries that reading where the first finds none."""
    def queue(n: int) -> Trace:
        grads = [Allocation(64, "backward", f"m.layers.{k}.lora_A", "mm", 0, "gradient") for k in range(n)]
        return Trace(grads, [(True, k) for k in range(n)] + [(False, k) for k in range(n)])

    def rule_of(ties: str):
        codec = BlockCodec("m.layers", ties)
        tokens = {n: codec.tokens(queue(n), n) for n in range(1, 4)}
        assert all(codec.decode(tokens[n], n) == (queue(n).allocations, queue(n).events) for n in tokens)
        try:
            return _rule(tokens, None)
        except NotPeriodic:
            return None

    oldest = rule_of("oldest")
    assert oldest is not None and (oldest.kind, oldest.base) == ("repeated", 1)
    assert rule_of("newest") is None
    trace, rule = depth.deepen({n: queue(n) for n in range(1, 4)}, "m.layers", 12)
    assert (trace.allocations, trace.events) == (queue(12).allocations, queue(12).events)
    assert rule.reading == "oldest"


def test_the_shallow_depths_are_split_between_two_cores_evenly() -> None:
    def lanes(*depths: int) -> tuple[list[int], list[int]]:
        here, child = depth._lanes([(1, n) for n in depths])
        return [n for _, n in here], [n for _, n in child]

    assert lanes(1, 2, 3) == ([1, 2], [3])  # costs 2 + 3 here, 4 in the child
    assert lanes(2, 3) == ([2], [3])
    assert lanes(2, 3, 4, 5) == ([3, 4], [2, 5])
    assert lanes(4) == ([], [4])
    # FSDP's first search (depths 2 to 4 at batch 1) with batch 2's depths 2 and 3: 10 here, 9 in the child, which
    # holds the deepest and as few of batch 1's as an even split allows; each lane batch 1's first
    assert depth._lanes([(1, 2), (1, 3), (1, 4), (2, 2), (2, 3)]) == (
        [(1, 2), (1, 3), (2, 2)], [(1, 4), (2, 3)])


def test_a_search_split_over_a_child_and_its_family_hint_give_the_full_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first search with a spare core simulates its deepest shallow depths in a forked child: the same trace.
    The rule it found tells the next simulator of the model and recipe family which depths to simulate first:
    the ones the rule is checked on, all at once, with no round that finds too few."""
    from estimator.simulate import background

    monkeypatch.setattr(depth, "_FOUND", {})
    monkeypatch.setattr(background, "enabled", lambda: True)
    forked = []

    class Counted(background.Background):
        def __init__(self, fn) -> None:
            forked.append(fn)
            super().__init__(fn)

    monkeypatch.setattr(background, "Background", Counted)
    model, training = CASES["llama fsdp"]  # its rule needs depth 4: the search's first round finds too few
    built, recipe = _built(model, training)
    first = Deepener(built)
    _same(record_built(built, 1, recipe, A100), first.record(1, recipe, A100))
    assert forked and first.rule is not None
    family = depth._family(built, recipe)
    assert depth._FOUND[family] == (first.rule.kind, first.rule.base)

    asked = _shallow_depths(monkeypatch)
    monkeypatch.setattr(depth, "_WORLD_RULES", {})  # the rule itself (another world's) would take two depths
    second = Deepener(built)
    _same(record_built(built, 1, recipe, A100), second.record(1, recipe, A100))
    assert asked == list(depth._checked_on(*depth._FOUND[family])) and 1 not in asked


@pytest.mark.parametrize("name, ties, deepest", [
    ("llama lora", ("newest",), 5), ("llama lora", depth.TIES, 4), ("bert sequence classification", depth.TIES, 4)])
def test_the_depth_after_the_next_runs_beside_it_and_is_dropped_when_not_needed(
        name: str, ties: tuple[str, ...], deepest: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A search one depth short simulates the depth after the next in a child beside it: LoRA's drifting rule
    read with ties as the newest only (depths 1 to 5) takes both; read with ties as the oldest too (depths 1 to
    4), as BERT's rule at 2 (depth 4), the child simulating 5 is killed."""
    from estimator.simulate import background

    monkeypatch.setattr(depth, "_FOUND", {})
    monkeypatch.setattr(depth, "TIES", ties)
    monkeypatch.setattr(background, "enabled", lambda: True)
    forked: list[background.Background] = []

    class Counted(background.Background):
        def __init__(self, fn) -> None:
            super().__init__(fn)
            forked.append(self)

    monkeypatch.setattr(background, "Background", Counted)
    model, training = CASES[name]
    if name.startswith("bert"):  # 16 blocks: depths 1 to 5 cost fewer than the full model's
        model = {**model, "config": {**model["config"], "num_hidden_layers": 16}}
    built, recipe = _built(model, training)
    assert built.depth is not None
    built.depth = dataclasses.replace(built.depth, grows_by=None)  # no hint from the builder: a search from 1 to 3
    deepener = Deepener(built)
    _same(record_built(built, 1, recipe, A100), deepener.record(1, recipe, A100))
    rule = deepener.rule
    assert rule is not None and max(depth._checked_on(rule.kind, rule.base)) == deepest
    assert len(forked) == 2  # the first round's deepest depth, then the one ahead of depth 4
    assert all(job.pid is None for job in forked)  # collected, or killed and reaped


def test_adapters_start_the_first_search_at_the_depths_their_rule_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with LoRA's adapters grows by a drifting rule at 2: its builder says so (``Depth.grows_by``), and
    the first search simulates depths 1 to 4 at once (split over two cores where one is spare), not 1 to 3 and
    then 4."""

    monkeypatch.setattr(depth, "_FOUND", {})
    asked = _shallow_depths(monkeypatch)
    model, training = CASES["llama lora"]
    built, recipe = _built(model, training)
    assert built.depth is not None and built.depth.grows_by == ("drifting", 2)
    deepener = Deepener(built)
    assert deepener._plan(recipe) == (range(1, 5), range(2, 4))
    _same(record_built(built, 1, recipe, A100), deepener.record(1, recipe, A100))
    assert asked == [1, 2, 3, 4]
    assert deepener.rule is not None and (deepener.rule.kind, deepener.rule.base) == ("drifting", 2)
    _same(record_built(built, 2, recipe, A100), deepener.record(2, recipe, A100))
    assert asked == [1, 2, 3, 4, 2, 3]  # another batch: the rule's two depths


def test_a_hint_that_skips_the_depth_a_rule_needs_still_finds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family's hint only orders the simulations: QLoRA with paged AdamW grows by a drifting rule at 2 (depths
    1 to 4); told to start at 2 to 4, the search simulates depth 1 too and finds the same step."""
    from estimator.simulate import background

    model, training = CASES["llama qlora paged"]
    built, recipe = _built(model, training)
    monkeypatch.setattr(depth, "_FOUND", {depth._family(built, recipe): ("repeated", 2)})
    monkeypatch.setattr(background, "spare_core", lambda: False)
    deepener = Deepener(built)
    _same(record_built(built, 1, recipe, A100), deepener.record(1, recipe, A100))
    assert deepener.rule is not None and (deepener.rule.kind, deepener.rule.base) == ("drifting", 2)
    assert depth._FOUND[depth._family(built, recipe)] == ("drifting", 2)


def test_another_world_follows_the_rule_found_at_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP over another number of ranks (a world-size search's next probe; a rank of uneven shards) is the same
    program with other shard sizes: its first simulation follows the rule found at the first world, from the two
    depths a later batch simulates, and gives the full simulation's step."""

    monkeypatch.setattr(depth, "_FOUND", {})
    asked = _shallow_depths(monkeypatch)
    model, training = CASES["llama fsdp"]
    built, recipe = _built(model, training)
    d = recipe.distributed
    first = Deepener(built)
    _same(record_built(built, 1, recipe, A100), first.record(1, recipe, A100))
    assert asked == [2, 3, 4] and first.rule is not None
    seen = {}
    for world, rank in ((2, 0), (3, 0), (3, 2), (8, 7)):
        asked.clear()
        other = dataclasses.replace(recipe, distributed=d.at(world, rank))
        deepener = Deepener(built)
        _same(record_built(built, 1, other, A100), deepener.record(1, other, A100))
        seen[world, rank] = list(asked)
        assert deepener.rule is not None
        asked.clear()
        _same(record_built(built, 2, other, A100), deepener.record(2, other, A100))
        assert asked == [2, 3]
    # the last ranks of uneven shards step otherwise (their shards' tokens differ): the rule is searched again
    # from the depths it was checked on, as at a batch whose alignment came out otherwise
    # (and the first world's rule stays the one to follow: rank 2 of 3's does not replace it)
    assert seen == {(2, 0): [2, 3], (3, 0): [2, 3], (3, 2): [2, 3, 4], (8, 7): [2, 3]}


def test_a_world_rule_is_keyed_by_all_but_the_world_and_kept_bounded() -> None:
    """The key leaves out the world size and rank only (a step at another input or recipe searches its own), and
    is made without checking the strategy at another world (an integer reshard_after_forward must divide it)."""
    model, training = CASES["llama fsdp"]
    training = {**training, "distributed": {**training["distributed"], "world_size": 8,
                                            "fsdp": {"param_dtype": "bf16", "reshard_after_forward": 2}}}
    built, recipe = _built(model, training)
    d = recipe.distributed
    key = depth._worlds(built, recipe)
    assert depth._worlds(built, dataclasses.replace(recipe, distributed=d.at(4, 3))) == key
    longer, _ = _built(model, training, seq_len=64)
    assert depth._worlds(longer, recipe) != key
    assert depth._worlds(built, dataclasses.replace(recipe, gradient_checkpointing=True)) != key
    table = {n: n for n in range(depth.MAX_FAMILIES + 3)}
    depth._bounded(table)
    assert list(table) == list(range(3, depth.MAX_FAMILIES + 3))  # the oldest forgotten


def test_the_family_table_keeps_its_bound_whoever_adds_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child's families, learnt by the parent, count against ``MAX_FAMILIES`` as the parent's own do."""
    monkeypatch.setattr(depth, "_FOUND", {("old", n): ("repeated", 1) for n in range(depth.MAX_FAMILIES)})
    deepener = Deepener(_built(CAUSAL, {})[0])
    deepener.learn((None, None, {("new", 1): ("repeated", 2), ("new", 2): ("drifting", 3)}))
    assert len(depth._FOUND) == depth.MAX_FAMILIES
    assert ("old", 0) not in depth._FOUND and ("old", 1) not in depth._FOUND
    assert depth._FOUND[("new", 2)] == ("drifting", 3)


def test_the_second_batch_is_simulated_in_the_first_search_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Told that batch 2 comes next (``Simulator.prefetch_second``), a first search with a spare core simulates
    batch 2's depths (those of the rule it is likely to find) in the same split; batch 2 then simulates nothing
    more, and both steps are the full simulations, event for event."""
    from estimator.simulate import background
    from estimator.simulate.source import Simulator

    monkeypatch.setattr(depth, "_FOUND", {})
    monkeypatch.setattr(background, "enabled", lambda: True)
    model, training = CASES["llama fsdp"]  # no family known: the prior, a repeated rule at 2 (again: 2 and 3)
    built, recipe = _built(model, training)
    simulator = Simulator(built, recipe)
    simulator.prefetch_second(2, A100)
    assert not simulator._pending  # no second search beside the first
    first, _ = simulator.simulate(1, A100)
    rule = simulator.deepener.rule
    assert rule is not None and (rule.kind, rule.base) == ("repeated", 2)
    assert sorted(simulator.deepener._early) == [(2, 2), (2, 3)]

    asked: list[tuple[int, int]] = []
    shallow = Deepener._shallow

    def counted(self, n, batch, *args, **kwargs):
        asked.append((batch, n))
        return shallow(self, n, batch, *args, **kwargs)

    monkeypatch.setattr(Deepener, "_shallow", counted)
    second, runs = simulator.simulate(2, A100)
    assert runs == 1 and asked == [] and not simulator.deepener._early  # taken, not simulated again
    _same(record_built(built, 1, simulator.recipe, A100), first)
    _same(record_built(built, 2, simulator.recipe, A100), second)


def test_early_depths_of_another_recipe_or_card_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shallow trace simulated early is used only for the batch, depth, recipe, card and notes it ran with."""
    from estimator.simulate import background

    monkeypatch.setattr(background, "spare_core", lambda: False)  # every shallow simulation here, counted
    model, training = CASES["llama amp-bf16"]
    built, recipe = _built(model, training)
    deepener = Deepener(built)
    trace = record_built(built, 2, recipe, A100)  # any trace: what matters is whether it is taken
    other = dataclasses.replace(recipe, optimizer="sgd")
    deepener._early[2, 1] = (other, A100, ()), trace
    deepener._early[2, 2] = (recipe, get_gpu("H100-80GB"), ()), trace
    deepener._early[2, 3] = (recipe, A100, ()), trace
    asked: list[int] = []

    def fake(n, batch, recipe, gpu, notes):
        asked.append(n)
        return trace

    deepener._shallow = fake  # type: ignore[method-assign]
    got = deepener._shallows([1, 2, 3], 2, recipe, A100, ())
    assert asked == [1, 2] and all(t is trace for t in got.values()) and not deepener._early
