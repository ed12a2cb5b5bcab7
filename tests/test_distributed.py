"""Multi-GPU steps: DDP, FSDP2 and ZeRO-1 simulated per rank under torch's fake process group.

Hand-derived cases (bytes worked out in the comments), the request's rules, the allocator's per-stream
pools, and the planner's world sizes. Real multi-process CPU runs are in tests/test_distributed_truth.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support import A100_80 as A100

from estimator.errors import SpecError
from estimator.pipeline import estimate, estimate_memory
from estimator.replay.allocator import AllocatorConfig, replay_sized
from estimator.request.parse import parse_request
from estimator.simulate.distributed import candidate_ranks, uneven_shards, zero_partition_sizes
from estimator.simulate.recipe import Distributed, Recipe
from estimator.simulate.record import record_training
from estimator.trace import Category, Phase

pytestmark = pytest.mark.sim
MIB = 2**20


class Stack(nn.Module):
    """``layers`` Linear(width, width) blocks then a Linear(width, out) head: parameters in a known order."""

    def __init__(self, layers: int = 8, width: int = 1024, out: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _batch(width: int):
    def make(b: int, device: torch.device):
        return torch.empty(b, width, device=device), torch.zeros(b, dtype=torch.long, device=device)
    return make


def _ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _trace(d: Distributed, *, layers: int = 8, width: int = 1024, out: int = 10, batch: int = 4,
           optimizer: str = "adamw", gpu=A100, **recipe: object):
    r = Recipe(optimizer=optimizer, distributed=d, **recipe)  # type: ignore[arg-type]
    return record_training(lambda: Stack(layers, width, out), _batch(width), _ce, batch, r, gpu)


def _comm(trace, iteration: int | None = None, phase: str | None = None) -> list[int]:
    return [a.nbytes for a in trace.allocations if a.category == Category.COMMUNICATION
            and (iteration is None or a.iteration == iteration) and (phase is None or a.phase == phase)]


# --- DDP ------------------------------------------------------------------------------------------------

def test_ddp_buckets_hand_derived() -> None:
    """Stack(8 x Linear(1024, 1024), head Linear(1024, 10)), fp32, world 2, bucket_cap_mb null (DDP's default).

    Gradient bytes: each block 1024*1024*4 = 4 MiB weight + 4 KiB bias = 4,198,400; the head
    10*1024*4 + 10*4 = 40,960 + 40 = 41,000. All: 8 * 4,198,400 + 41,000 = 33,628,200.

    At construction DDP puts every gradient in one bucket (find_unused_parameters off: limits
    [sys.maxsize]): one flat tensor of 33,628,200 B, allocated in setup.

    After the first backward it rebuilds in the order gradients became ready: the head's first (the
    last layer's gradients come first), then blocks 7, 6, ... 0. Limits [1 MiB, 25 MiB]: a bucket
    closes once it reaches its limit. Bucket 0: head (41,000 B) + block 7's two (4,198,400) -> 4,239,400
    >= 1 MiB, closed. Then 25 MiB = 26,214,400 B: blocks 6..1 are 6 * 4,198,400 = 25,190,400 < 25 MiB,
    block 0 makes it 29,388,800 >= 25 MiB: bucket 1 = 29,388,800 B. So iteration 1 allocates
    [4,239,400, 29,388,800] (which tensor of a layer comes first does not change the sums).
    """
    trace = _trace(Distributed("ddp", 2))
    assert _comm(trace, 0, Phase.SETUP) == [33_628_200]
    assert sorted(_comm(trace, 1)) == [4_239_400, 29_388_800]
    # the buckets are a second copy of the gradients: as many bytes as the gradients, live through the step
    assert sum(_comm(trace, 1)) == 8 * 4_198_400 + 41_000


def test_ddp_bucket_cap_given_caps_the_first_bucket_too() -> None:
    """bucket_cap_mb: 8 (given): DDP's _BucketCapacityConfig uses 8 MiB for the first bucket as well.
    Ready order head, b7, b6, ...: head + b7 + b6 = 41,000 + 8,396,800 = 8,437,800 >= 8 MiB (8,388,608):
    closed; the same for b5 + b4 (8,396,800 >= 8 MiB), b3 + b2, b1 + b0."""
    trace = _trace(Distributed("ddp", 2, bucket_cap_mb=8))
    assert sorted(_comm(trace, 1)) == sorted([8_437_800, 8_396_800, 8_396_800, 8_396_800])


def test_ddp_costs_the_buckets_and_bucket_views_save_them() -> None:
    none = estimate_memory(lambda: Stack(), _batch(1024), _ce, 4, recipe=Recipe(), gpu=A100)
    ddp = estimate_memory(lambda: Stack(), _batch(1024), _ce, 4,
                          recipe=Recipe(distributed=Distributed("ddp", 2)), gpu=A100)
    views = estimate_memory(lambda: Stack(), _batch(1024), _ce, 4,
                            recipe=Recipe(distributed=Distributed("ddp", 2, gradient_as_bucket_view=True)), gpu=A100)
    grads = 8 * 4_198_400 + 41_000
    # peak allocated: DDP holds one more copy of the gradients (within the allocator's rounding)
    assert abs(ddp.allocated_peak_bytes - none.allocated_peak_bytes - grads) <= MIB
    # with bucket views the gradients are the buckets: no second copy
    assert views.allocated_peak_bytes < none.allocated_peak_bytes + grads / 4
    assert ddp.breakdown.communication > 0 and views.breakdown.gradients > 0


def test_ddp_matches_real_ddp_bucket_sizes() -> None:
    """The simulated Reducer rebuilds the buckets real DDP rebuilds (gloo, one process, CPU)."""
    import os
    import tempfile

    from estimator.simulate.step import prepare, run_steps

    model = Stack(4, 512)
    recipe = Recipe(distributed=Distributed("ddp", 1, bucket_cap_mb=1))
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            training = prepare(model, recipe, torch.device("cpu"))
            run_steps(training, _batch(512), _ce, 4, recipe, torch.device("cpu"))
            buckets = training.model.reducer._get_zeros_like_grad_buckets()  # copies shaped like its buckets
            real = sorted(b.buffer().numel() * b.buffer().element_size() for b in buckets)
        finally:
            dist.destroy_process_group()
    trace = record_training(lambda: Stack(4, 512), _batch(512), _ce, 4, recipe, None)
    assert sorted(_comm(trace, 1)) == real
    assert len(real) > 1  # rebuilt: more than the one bucket of the first iteration


# --- FSDP2 ----------------------------------------------------------------------------------------------

def test_fsdp_shards_hand_derived_uneven() -> None:
    """Stack(2 x Linear(64, 64), head Linear(64, 10)) over 4 ranks, fp32.

    fully_shard splits dim 0 with torch.chunk into ceil(rows / 4) rows and pads every rank's shard to
    that: a block weight (64 x 64) -> 16 x 64 x 4 = 4,096 B per rank; a block bias (64) -> 16 x 4 = 64 B;
    the head weight (10 x 64): ceil(10 / 4) = 3 rows -> 3 x 64 x 4 = 768 B (rank 3 holds 1 real row,
    padded); the head bias (10) -> 3 x 4 = 12 B. Every rank allocates the padded size.
    """
    trace = _trace(Distributed("fsdp", 4), layers=2, width=64, out=10)
    sharded = sorted(a.nbytes for a in trace.allocations if a.phase == Phase.SETUP and a.category == "parameter")
    assert sharded == sorted([4096, 64, 4096, 64, 768, 12])
    # the head's 10 rows do not divide by 4: rank 0 and the last rank are both candidates
    from estimator.models.meta import build_on_meta

    meta = build_on_meta(lambda: Stack(2, 64, 10))
    assert uneven_shards(meta, 4) and candidate_ranks(meta, Distributed("fsdp", 4)) == [0, 3]
    assert candidate_ranks(build_on_meta(lambda: Stack(2, 64, 8)), Distributed("fsdp", 4)) == [0]


def test_fsdp_gathers_and_frees_parameters() -> None:
    """Each block's parameters are gathered before its forward (an all-gather output on FSDP's stream, the
    unsharded parameters refilled in place) and freed after it; sharded grads and states are 1/world."""
    trace = _trace(Distributed("fsdp", 4))
    assert dist.is_initialized() is False  # the fake process group is gone
    assert trace.streams() is not None and max(trace.streams() or [0]) > 0
    # AdamW state: 2 x 4 B per parameter, over 4 ranks (8 blocks 1024 x 1024 divide evenly; the
    # head's 10 rows pad to 3 per rank): 8 * (256 * 1024 + 256) * 8 + (3 * 1024 + 3) * 8
    states = sum(a.nbytes for a in trace.allocations if a.category == Category.OPTIMIZER_STATE)
    assert states == 8 * (256 * 1024 + 256) * 8 + (3 * 1024 + 3) * 8
    gathered = [a for a in trace.allocations if a.op == "resize_" and a.category == Category.PARAMETER]
    assert gathered  # refilled in the second iteration
    single = _trace(Distributed())
    # FSDP over 4 needs less than one GPU for the same step (states and grads sharded)
    assert trace.live_peak()[0] < single.live_peak()[0]


def test_fsdp_reshard_after_forward_orders_memory() -> None:
    """true frees each block's gathered parameters after its forward; 2 keeps them sharded over 2 ranks
    (half of each block, a second mesh FSDP2 builds itself); false keeps them whole until backward."""
    peaks = {raf: _trace(Distributed("fsdp", 4, reshard_after_forward=raf), layers=4, width=512).live_peak()[0]
             for raf in (True, 2, False)}
    assert peaks[True] < peaks[2] < peaks[False]
    # false keeps the 3 resharding blocks' parameters gathered through the end of the forward: up to
    # 3 x (512 x 512 + 512) x 4 B more than true (whose own peak, in backward, holds the block running and
    # the one FSDP prefetches): more than one block, at most three
    block = (512 * 512 + 512) * 4
    assert block < peaks[False] - peaks[True] <= 3 * block


def test_fsdp_param_dtype_requires_fp32_precision() -> None:
    with pytest.raises(SpecError, match="training.precision"):
        Recipe(precision="amp-bf16", distributed=Distributed("fsdp", 2, param_dtype="bf16"))
    trace = _trace(Distributed("fsdp", 2, param_dtype="bf16", reduce_dtype="fp32"), layers=2, width=256)
    # the gathered parameters are bf16: a block's weight (256 x 256) and bias (256), 2 B each, are gathered
    # as one buffer each (FSDP's all_gather_outputs per parameter): 131,072 and 512 B, not fp32's 262,144
    gathered = sorted({a.nbytes for a in trace.allocations if a.category == Category.PARAMETER
                       and a.phase == Phase.FORWARD})
    assert 256 * 256 * 2 in gathered and 256 * 2 in gathered
    assert 256 * 256 * 4 not in gathered


# --- ZeRO-1 ---------------------------------------------------------------------------------------------

def test_zero1_state_shard_hand_derived() -> None:
    """Stack(3 x Linear(256, 256), head Linear(256, 10)) over 2 ranks with AdamW.

    ZeroRedundancyOptimizer sorts parameters by numel, largest first, and gives each to the rank with the
    fewest so far: weights 65,536 (x3) then head weight 2,560, then biases 256 (x3), head bias 10.
    w -> r0 (65,536), w -> r1 (65,536), w -> r0 (131,072), head w -> r1 (68,096), b -> r1 (68,352),
    b -> r1 (68,608), b -> r1 (68,864), head b -> r1 (68,874). Rank 0 holds 131,072 parameters, rank 1
    68,874: rank 0 keeps the most state, 131,072 x 2 states x 4 B = 1,048,576 B of AdamW state.
    """
    from estimator.models.meta import build_on_meta

    meta = build_on_meta(lambda: Stack(3, 256, 10))
    assert zero_partition_sizes(meta, 2) == [131_072, 68_874]
    assert candidate_ranks(meta, Distributed("zero1", 2)) == [0]
    trace = _trace(Distributed("zero1", 2), layers=3, width=256)
    assert sum(a.nbytes for a in trace.allocations if a.category == Category.OPTIMIZER_STATE) == 1_048_576
    rank1 = _trace(Distributed("zero1", 2, rank=1), layers=3, width=256)
    assert sum(a.nbytes for a in rank1.allocations if a.category == Category.OPTIMIZER_STATE) == 68_874 * 8


# --- the allocator's streams ----------------------------------------------------------------------------

def test_allocator_keeps_a_pool_per_stream() -> None:
    """A 12 MiB block (its own 12 MiB segment: above 10 MiB, rounded to 2 MiB) freed by stream 1 is not
    handed to stream 0's 12 MiB request (a second segment), but is to stream 1's."""
    events = [(True, 0), (False, 0), (True, 1)]
    sizes, cats = [12 * MIB, 12 * MIB], ["temporary", "temporary"]
    same = replay_sized(events, sizes, cats, AllocatorConfig(), streams=[1, 1])
    other = replay_sized(events, sizes, cats, AllocatorConfig(), streams=[1, 0])
    default = replay_sized(events, sizes, cats, AllocatorConfig())
    assert same.reserved_peak == default.reserved_peak == 12 * MIB
    assert other.reserved_peak == 24 * MIB
    assert same.segments_allocated == 1 and other.segments_allocated == 2


def test_one_gpu_trace_has_no_streams() -> None:
    assert _trace(Distributed(), layers=2, width=64).streams() is None


def test_a_distributed_simulation_puts_torch_back() -> None:
    stream, event, engine = torch.cuda.Stream, torch.cuda.Event, torch.autograd.Variable._execution_engine
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"]
    _trace(Distributed("fsdp", 2), layers=2, width=64)
    _trace(Distributed("ddp", 2), layers=2, width=64)
    assert (torch.cuda.Stream, torch.cuda.Event, torch.autograd.Variable._execution_engine) == (stream, event, engine)
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"] is propagate
    assert not dist.is_initialized()


# --- the request ----------------------------------------------------------------------------------------

_MODEL = {"source": "torchvision", "name": "resnet18"}


@pytest.mark.parametrize(("distributed", "field"), [
    ({"world_size": 4}, "training.distributed.world_size"),
    ({"strategy": "ddp", "fsdp": {"reshard_after_forward": False}}, "training.distributed.fsdp"),
    ({"strategy": "fsdp", "ddp": {"bucket_cap_mb": 10}}, "training.distributed.ddp"),
    ({"strategy": "fsdp", "world_size": 6, "fsdp": {"reshard_after_forward": 4}},
     "training.distributed.fsdp.reshard_after_forward"),
    ({"strategy": "fsdp", "world_size": 2048}, "training.distributed.world_size"),
    ({"strategy": "fsdp", "world_size": 0}, "training.distributed.world_size"),
    ({"strategy": "pipeline"}, "training.distributed.strategy"),
    ({"strategy": "ddp", "ddp": {"bucket_cap_mb": 0}}, "training.distributed.ddp.bucket_cap_mb"),
    ({"strategy": "fsdp", "world_size": "auto", "fsdp": {"reshard_after_forward": 2}},
     "training.distributed.fsdp.reshard_after_forward"),
])
def test_bad_distributed_requests_name_the_field(distributed: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_request({"model": _MODEL, "training": {"distributed": distributed}})
    assert err.value.field == field


def test_param_dtype_needs_fp32_and_ranks_agree() -> None:
    with pytest.raises(SpecError) as err:
        parse_request({"model": _MODEL, "training": {"precision": "amp-bf16", "distributed": {
            "strategy": "fsdp", "world_size": 2, "fsdp": {"param_dtype": "bf16"}}}})
    assert err.value.field == "training.precision"
    with pytest.raises(SpecError) as err:
        parse_request({"model": _MODEL, "planner": {"data_parallel_ranks": 4},
                       "training": {"distributed": {"strategy": "ddp", "world_size": 2}}})
    assert err.value.field == "planner.data_parallel_ranks"
    ok = parse_request({"model": _MODEL, "training": {"distributed": {"strategy": "fsdp", "world_size": "auto"}}})
    assert ok.training.distributed.world_size == "auto"


def test_distributed_recipe_rules() -> None:
    with pytest.raises(SpecError):
        Distributed("fsdp", 4, rank=4)
    with pytest.raises(SpecError, match="reshard_after_forward"):  # 4 does not divide 6
        Distributed("fsdp", 8, reshard_after_forward=4).at(6)
    moved = Distributed("ddp", 2, gradient_as_bucket_view=True).at(3, rank=2)
    assert (moved.world_size, moved.rank, moved.gradient_as_bucket_view) == (3, 2, True)


# --- the planner ----------------------------------------------------------------------------------------

_GPT2 = {"source": "transformers", "preset": "gpt2"}


@pytest.mark.sim_slow  # several world sizes, each its own simulations
def test_distributed_results_carry_world_and_global_batch() -> None:
    response = estimate(parse_request({
        "model": _GPT2, "input": {"seq_len": 64}, "gpus": ["A100-80GB"],
        "training": {"grad_accumulation_steps": 2, "distributed": {"strategy": "fsdp", "world_size": 4}},
        "planner": {"target_global_batch": 4096, "curve_points": 0}}))
    r = response.results[0]
    assert r.world_size == 4 and r.recommended_batch_size is not None
    assert r.global_batch_size == r.recommended_batch_size * 4 * 2
    assert r.accumulation is not None and r.accumulation.ranks == 4
    assert any("fully_shard" in a for a in response.assumptions)
    assert any("NCCL" in a for a in response.assumptions)


@pytest.mark.sim_slow  # several world sizes, each its own simulations
def test_world_size_auto_finds_the_fewest_ranks() -> None:
    """gpt2 (124 M parameters), fp32 AdamW: 16 B per parameter of state alone, about 2 GB; a 2.5 GB card
    (less its 450 MiB context and the 256 MiB reserve) cannot hold it on one rank, but can once FSDP
    shards it. The answer is checked around: one rank fewer does not fit."""
    card = {"name": "small-card", "memory_bytes": int(2.5 * 2**30), "compute_capability": "8.0"}
    request = parse_request({"model": _GPT2, "input": {"seq_len": 32}, "gpus": [card, "A100-80GB", card],
                             "training": {"distributed": {"strategy": "fsdp", "world_size": "auto"}},
                             "planner": {"curve_points": 0}})
    response = estimate(request)
    # the cards in the request's order, each with its own world (a card named twice, twice)
    assert [g.gpu for g in response.results] == ["small-card", "A100-80GB", "small-card"]
    assert response.results[1].min_world_size == 1 and response.results[1].world_size == 1
    assert response.results[0] == response.results[2]
    r = response.results[0]
    assert r.min_world_size is not None and r.min_world_size > 1
    # the answer is at the fewest ranks at which a batch is recommended (the headroom met), at least as many
    assert r.recommended_world_size is not None and r.recommended_world_size >= r.min_world_size
    assert r.world_size == r.recommended_world_size and r.recommended_batch_size is not None

    def at(world: int):
        return estimate(parse_request({**request.model_dump(mode="json", by_alias=True, exclude_none=True),
                                       "gpus": [card], "training": {"distributed": {
                                           "strategy": "fsdp", "world_size": world}}})).results[0]
    assert at(r.min_world_size - 1).max_batch_size is None
    if r.recommended_world_size > r.min_world_size:
        assert at(r.recommended_world_size - 1).recommended_batch_size is None


@pytest.mark.sim_slow  # several world sizes, each its own simulations
def test_single_gpu_that_does_not_fit_gets_checked_suggestions() -> None:
    """gpt2 on a 2.5 GB card: no single lever leaves room for the headroom, so the suggestions are their
    combination and FSDP; each, applied, gives the recommended batch it says (suggestions land on a
    recommended batch, not on a bare fit)."""
    card = {"name": "small-card", "memory_bytes": int(2.5 * 2**30), "compute_capability": "8.0"}
    # a second card whose name contains the first's: each warning names its own card's fix, once
    longer = {**card, "name": "small-card-2"}
    request = parse_request({"model": _GPT2, "input": {"seq_len": 32}, "gpus": [card, longer],
                             "planner": {"curve_points": 0}})
    response = estimate(request)
    r = response.results[0]
    assert r.max_batch_size is None
    changes = [s.change for s in r.suggestions]
    assert {"training.gradient_checkpointing": True, "training.optimizer.foreach": False,
            "training.precision": "bf16"} in changes
    assert any(c.get("training.distributed.strategy") == "fsdp" for c in changes)
    unfit = [w.message for w in response.warnings if w.code == "does-not-fit"]
    assert len(unfit) == 2 and all(m.count("it fits with") == 1 and "GiB usable" in m for m in unfit)
    assert response.results[1].suggestions == r.suggestions  # alike cards: the same checked changes
    # each suggestion, applied, recommends the batch it says
    for suggestion in r.suggestions:
        doc = request.model_dump(mode="json", by_alias=True, exclude_none=True)
        doc["gpus"] = [card]
        for path, value in suggestion.change.items():
            *parents, last = path.split(".")
            at = doc
            for name in parents:
                at = at.setdefault(name, {})
            at[last] = value
        checked = estimate(parse_request(doc)).results[0]
        assert checked.recommended_batch_size == suggestion.recommended_batch_size is not None
        assert checked.max_batch_size == suggestion.max_batch_size


@pytest.mark.sim_slow  # FSDP world searches
def test_a_stack_that_cannot_run_under_fsdp_is_suggested_without_its_last_lever(monkeypatch) -> None:
    """torch's Adafactor raises under FSDP2 (an in-place pow_ on a sharded parameter's norm): a stack with it is
    tried again without it, instead of failing the whole answer (llama-3-8b on a T4 did)."""
    from estimator.errors import SimulationError
    from estimator.options import PlanOptions
    from estimator.pipeline import _sources
    from estimator.plan.suggest import Suggester, levers, stacked
    from estimator.plan.worlds import Worlds

    tried = []
    min_world = Worlds.min_world

    def refusing(self, card, batch, **kwargs):
        tried.append(dict(self.base))
        if "training.optimizer.name" in self.base:
            raise SimulationError("RuntimeError: aten.pow_.Scalar: in-place operations that require placement "
                                  "changes are not supported", "optimizer")
        return min_world(self, card, batch, **kwargs)

    monkeypatch.setattr(Worlds, "min_world", refusing)
    request = parse_request({"model": _GPT2, "input": {"seq_len": 32}, "gpus": ["T4-16GB"]})
    from estimator.models import build
    from estimator.request.adapt import job_of

    job = job_of(request)
    suggester = Suggester(_sources(request, build(job.model, job.input), None), PlanOptions(), 1, text_model=True)
    chosen = [lever for lever in levers(PlanOptions(), True) if not lever.method]
    assert stacked(chosen).change["training.optimizer.name"] == "adafactor"  # the last lever of the stack
    found = suggester._fsdp(chosen, job.cards[0])
    assert found is not None and found.world_size >= 2
    assert "training.optimizer.name" not in found.change
    assert [b.get("training.optimizer.name") for b in tried[:2]] == ["adafactor", None]  # then without it


def test_affine_traces_and_profiles_keep_streams() -> None:
    """An FSDP step's affine trace keeps each allocation's stream through JSON (a profile), its replay uses
    them, and a trace on other streams is not the same program."""
    from estimator.plan.affine import fit, from_json

    d = Distributed("fsdp", 2)
    t1, t2 = _trace(d, layers=2, width=64, batch=2), _trace(d, layers=2, width=64, batch=3)
    affine = fit([(2, t1), (3, t2)])
    assert affine is not None and affine.streams == t1.streams() and max(affine.streams or [0]) > 0
    again = from_json(affine.to_json())
    assert again.streams == affine.streams and again.matches(t2, 3)
    assert {e.stream for e in again.events_at(3, 0)} == set(affine.streams or [])
    moved = dataclasses.replace(affine, streams=[0] * len(affine.const))
    assert not moved.matches(t2, 3)
