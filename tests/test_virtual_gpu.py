"""The virtual GPU: answers like the card, restores torch, and fails clearly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from estimator.errors import DataDependentError, SimulationError, UnknownGPUError
from estimator.gpus import get_gpu
from estimator.pipeline import estimate_memory
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.simulate.virtual_gpu import NullObserver, VirtualGPU
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim


def _torch_state():
    import torch.optim.optimizer as optim

    return (
        torch.cuda.is_available(), torch.cuda.get_device_properties, torch.autograd.graph._engine_run_backward,
        torch.autograd._engine_run_backward, torch.Tensor.register_hook,
        torch.autograd.function.Function.__dict__["apply"], list(optim._foreach_supported_types),
        torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
        torch._C._autograd._top_saved_tensors_default_hooks(False), torch.nn.functional.scaled_dot_product_attention,
        "__deepcopy__" in vars(FakeTensor),
    )


def test_everything_patched_is_restored() -> None:
    before = _torch_state()
    mf, bf, lf = ZOO["mlp"]
    record_training(mf, bf, lf, 4, Recipe(precision="amp-fp16"), get_gpu("H100-80GB"))
    assert _torch_state() == before
    assert not torch.cuda.is_available()  # this host has no GPU


def test_device_queries_answer_for_the_card() -> None:
    with VirtualGPU(get_gpu("A100-80GB")):
        assert torch.cuda.is_available()
        assert torch.cuda.get_device_capability() == (8, 0)
        assert torch.cuda.get_device_properties(0).total_memory == 81920 * 2**20
        x = torch.empty(1024, device="cuda")
        assert x.is_cuda


def test_autocast_policy_is_cudas() -> None:
    meta = nn.Linear(8, 8, device="meta")  # built outside the fake mode (docs/DESIGN.md, fact 3)
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        lin = vgpu.materialize(meta)
        vgpu.autocast(torch.bfloat16)
        y = lin(torch.empty(2, 8, device="cuda"))
        z = F.layer_norm(y, (8,))
        vgpu.autocast(None)
    assert y.dtype == torch.bfloat16  # linear -> bf16
    assert z.dtype == torch.float32  # layer_norm -> fp32


@pytest.mark.parametrize("gpu, dtype, mask, op", [
    ("H100-80GB", torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    ("A100-80GB", torch.float32, False, "_scaled_dot_product_efficient_attention"),
    ("H100-80GB", torch.bfloat16, True, "_scaled_dot_product_efficient_attention"),
    ("V100-16GB", torch.bfloat16, False, "bmm"),  # no bf16 kernels below sm80: math
])
def test_attention_backend_is_the_cards(gpu, dtype, mask, op) -> None:
    seen = []

    class Ops(NullObserver):
        def on_op(self, func, args, kwargs, out) -> None:
            seen.append(func._schema.name.split("::")[-1])

    with VirtualGPU(get_gpu(gpu), observer=Ops()):
        q = torch.empty(2, 8, 128, 64, device="cuda", dtype=dtype, requires_grad=True)
        m = torch.zeros(128, 128, device="cuda", dtype=torch.bool) if mask else None
        F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    assert op in seen


def test_optimizer_defaults_to_foreach_on_gpu() -> None:
    mf, bf, lf = ZOO["mlp"]
    gpu_ops = {a.op for a in record_training(mf, bf, lf, 4, Recipe(), get_gpu("A100-80GB")).allocations}
    cpu_ops = {a.op for a in record_training(mf, bf, lf, 4, Recipe(), None).allocations}
    assert "_foreach_sqrt" in gpu_ops  # real GPUs default to foreach (docs/DESIGN.md, fact 6)
    assert "_foreach_sqrt" not in cpu_ops  # CPUs take the single-tensor path


def test_unknown_gpu_suggests_close_names() -> None:
    mf, bf, lf = ZOO["mlp"]
    with pytest.raises(UnknownGPUError) as err:
        estimate_memory(mf, bf, lf, 4, gpu="A100-80G")
    assert err.value.field == "gpus" and "A100-80GB" in err.value.suggestions


class ItemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent control flow
            return y
        return -y


class BrokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x.view(3, 7))


def _batch(b, d):
    return torch.empty(b, 4, device=d), torch.zeros(b, dtype=torch.long, device=d)


def test_data_dependent_model_is_a_typed_error() -> None:
    with pytest.raises(DataDependentError) as err:
        estimate_memory(ItemModel, _batch, F.cross_entropy, 2, gpu="A100-80GB", worst_case=False)
    assert "forward" in err.value.where


def test_data_dependent_model_runs_at_its_worst_case_by_default() -> None:
    report = estimate_memory(ItemModel, _batch, F.cross_entropy, 2, gpu="A100-80GB")
    assert report.allocated_peak_bytes > 0
    assert "data-dependent ops at their worst case: .item() in ItemModel" in report.assumptions


def test_failing_forward_names_phase_and_module() -> None:
    with pytest.raises(SimulationError) as err:
        estimate_memory(BrokenModel, _batch, F.cross_entropy, 2, gpu="A100-80GB")
    assert err.value.where.startswith("forward")


def test_report_fields_and_capacity() -> None:
    mf, bf, lf = ZOO["mlp"]
    r = estimate_memory(mf, bf, lf, 64, gpu="T4-16GB")
    assert r.allocated_peak_bytes <= r.reserved_peak_bytes < r.device_peak_bytes
    assert r.device_peak_bytes - r.reserved_peak_bytes == r.context_bytes
    assert r.fits and r.breakdown.parameters > 0 and r.peak_phase
    assert r.breakdown.total() == r.allocated_peak_bytes


class EmptiesTheCache(nn.Module):
    """Frees a large temporary, then calls torch.cuda.empty_cache() (some training scripts do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1024, 10)

    def forward(self, x):
        big = torch.relu(x.repeat(1, 16))  # (B, 16384) fp32: at B = 512, 32 MiB, and 32 MiB more for the relu
        del big
        torch.cuda.empty_cache()
        return self.fc(x)


def test_the_models_own_empty_cache_releases_the_cached_segments() -> None:
    from estimator.replay.allocator import AllocatorConfig, replay_sized

    def batch(b, device):
        return torch.empty(b, 1024, device=device), torch.zeros(b, dtype=torch.long, device=device)

    report = estimate_memory(EmptiesTheCache, batch, F.cross_entropy, 512, gpu=get_gpu("A100-80GB"))
    trace = report.trace
    calls = [k for k, a in enumerate(trace.allocations) if a.category == "empty_cache"]
    assert [(trace.allocations[k].op, trace.allocations[k].nbytes) for k in calls] == \
        [("torch.cuda.empty_cache", 0)] * 2  # once per step
    sizes, cats = trace.sizes(get_gpu("A100-80GB").cublas_workspace_bytes), trace.categories()
    honoured = replay_sized(trace.events, sizes, cats, AllocatorConfig())
    ignored = replay_sized(trace.events, sizes, ["temporary" if c == "empty_cache" else c for c in cats],
                           AllocatorConfig())
    after = trace.events.index((True, calls[0]))
    # the two freed 32 MiB blocks were whole cached segments: released, 64 MiB less reserved
    assert ignored.reserved[after] - honoured.reserved[after] == 64 * 2**20


def test_amp_bf16_with_checkpointing_on_a_card_that_emulates_bf16() -> None:
    """torch.cuda.is_bf16_supported() is true on a T4 (emulated): autocast in bf16, and checkpoint's recompute,
    run there as on the card."""
    recipe = Recipe(precision="amp-bf16", gradient_checkpointing=True)
    mf, bf, lf = ZOO["checkpoint"]
    report = estimate_memory(mf, bf, lf, 4, recipe=recipe, gpu=get_gpu("T4-16GB"))
    assert report.fits
    with VirtualGPU(get_gpu("T4-16GB")):
        assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)


def test_autocasts_bf16_question_leaves_the_step_the_same_on_every_card() -> None:
    """autocast asks torch.cuda.is_bf16_supported() each time it is entered (checkpoint's recompute enters it
    again): true on every card, so the step asked nothing of the card and the planner shares it between cards
    (the simulator's signature); the native question (including_emulation=False) depends on the card."""
    recipe = Recipe(precision="amp-bf16", gradient_checkpointing=True)
    mf, bf, lf = ZOO["checkpoint"]
    a100, h100 = (record_training(mf, bf, lf, 4, recipe, get_gpu(name)) for name in ("A100-80GB", "H100-80GB"))
    assert a100.card_queries == h100.card_queries == []
    assert (a100.events, a100.sizes(0), a100.categories()) == (h100.events, h100.sizes(0), h100.categories())
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        torch.cuda.is_bf16_supported()
        assert vgpu.card_queries == []
        torch.cuda.is_bf16_supported(including_emulation=False)
        assert vgpu.card_queries == ["is_bf16_supported"]


class _SharedChild(nn.Module):
    """One Linear registered under two parents (CoaT's shared_cpe / shared_crpe): Module._apply's recursion
    reaches it twice, the second time with fake parameters, which torch can only swap (and cannot: weakref)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(8, 8)
        self.a, self.b = nn.Sequential(shared), nn.Sequential(shared, nn.Linear(8, 8))

    def forward(self, x):
        return self.b(self.a(x))


class _CastsInForward(nn.Module):
    """switch_transformers' router: ``self.classifier = self.classifier.to(self.dtype)`` in its forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.classifier, self.dtype = nn.Linear(8, 8), dtype

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).float()


def test_a_module_shared_by_two_parents_materializes_once() -> None:
    meta = _SharedChild().to("meta")
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        model = vgpu.materialize(meta)
        assert model.a[0] is model.b[0] and model.a[0].weight.device.type == "cuda"
    trace = record_training(_SharedChild, lambda b, d: (torch.empty(b, 8, device=d), None),
                            lambda out, _: out.sum(), 2, Recipe(), get_gpu("A100-80GB"))
    params = [a for a in trace.allocations if a.category == "parameter"]
    assert len(params) == 4  # two Linears' weight and bias, the shared one once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forward_that_converts_its_own_submodule(dtype) -> None:
    # a real CUDA parameter is converted in place (param.data = ...): the same Parameter, the optimizer's
    meta = nn.Linear(8, 8, device="meta")
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        lin = vgpu.materialize(meta)
        weight = lin.weight
        assert lin.to(dtype) is lin and lin.weight is weight and weight.dtype == dtype
    trace = record_training(lambda: _CastsInForward(dtype), lambda b, d: (torch.empty(b, 8, device=d), None),
                            lambda out, _: out.sum(), 2, Recipe(), get_gpu("A100-80GB"))
    assert trace.events


def test_a_value_check_passes_as_on_the_valid_batch() -> None:
    # torch._check_tensor_all (transformers' torch_compilable_check, Siglip2's spatial_shapes > 0) reads a value
    class Checks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            torch._check_tensor_all(x.abs() >= 0)
            return self.lin(x)

    trace = record_training(Checks, lambda b, d: (torch.empty(b, 8, device=d), None), lambda out, _: out.sum(),
                            2, Recipe(), get_gpu("A100-80GB"))
    assert trace.events
    with VirtualGPU(get_gpu("A100-80GB")), pytest.raises(DataDependentError):
        bool((torch.empty(4, device="cuda") > 0).all())  # any other read still has no value


def test_a_0d_tensor_formats_by_its_value_as_on_the_card() -> None:
    # switch_transformers' experts loop: self[f"expert_{expert_idx[0]}"]; a tensor subclass formats as its repr
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        index = torch.empty((), dtype=torch.long, device="cuda")
        with vgpu.allowing_item():  # where batchfit knows the value (a step counter reads 1)
            assert f"expert_{index}" == "expert_1" and f"{index:02d}" == "01"
        assert f"{torch.empty(2, device='cuda')}".startswith("FakeTensor")  # not 0-d: torch's own format
        # a value the simulation does not know reads nothing: torch's format, no DataDependentError (a message
        # built eagerly, f"tokens: {n}" in a check that passes, must not send the step to the worst case)
        assert f"tokens: {index}".startswith("tokens: FakeTensor")


class _State:
    """An object holding tensors, as a model's cache layers do."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.head = buf[:, :256]  # a view: a deepcopy copies its whole storage, shared with buf's copy
        self.scale = torch.tensor(2.0)  # a CPU scalar made in forward: a fake tensor with a real constant


class DeepCopiesState(nn.Module):
    """Deep-copies a tensor-holding object in its forward (DoryModel copies its recurrent cache layers so)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1024, 10)

    def forward(self, x):
        state = copy.deepcopy(_State(torch.zeros(x.shape[0], 1024, device=x.device)))
        assert state.buf.is_cuda and state.buf.shape == (x.shape[0], 1024) and state.scale.item() == 2.0
        assert state.head.untyped_storage()._cdata == state.buf.untyped_storage()._cdata
        return self.fc(x + state.buf + state.head.sum() * state.scale)


def test_a_deepcopy_in_forward_is_a_fake_cuda_tensor_whose_memory_is_recorded() -> None:
    def batch(b, device):
        return torch.empty(b, 1024, device=device), torch.zeros(b, dtype=torch.long, device=device)

    b = 64
    trace = record_training(DeepCopiesState, batch, F.cross_entropy, b, Recipe(), get_gpu("A100-80GB"))
    copies = [a for a in trace.allocations if a.op == "clone" and a.phase == "forward"]
    steps = len({a.iteration for a in trace.allocations if a.phase == "forward"})
    assert steps >= 1 and [a.nbytes for a in copies] == [b * 1024 * 4] * steps  # buf's copy; the view shares it
    with VirtualGPU(get_gpu("A100-80GB")) as vgpu:
        x = torch.empty(3, 5, device="cuda")
        y = copy.deepcopy(x)
        assert y.fake_mode is x.fake_mode is vgpu._fake and y.is_cuda and y.shape == x.shape
        assert y.untyped_storage()._cdata != x.untyped_storage()._cdata
