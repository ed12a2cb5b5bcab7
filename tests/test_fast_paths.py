"""The virtual GPU's shortcuts past torch's fake kernels record exactly what the general path records.

Four shortcuts make a fresh simulation ~2x faster (bench/simulate_speed.py):
the optimizers' elementwise ``_foreach_*`` ops, cuDNN batch norm's outputs,
cheaper FakeTensor dispatch-cache keys, and a cache hit's outputs made without
FakeTensor.__new__'s checks; then views the dispatch cache does not hold, and
DTensor's foreach strategies memoized per element under FSDP. Each is switched
off here and the traces compared allocation by allocation.
"""

from __future__ import annotations

import pytest
import torch
from support import A100_80 as A100
from support import build_request

from estimator.request.parse import parse_request
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.simulate.virtual_gpu import Shortcuts, VirtualGPU
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim


aten = torch.ops.aten


def _same(a, b) -> None:
    assert a.events == b.events
    assert [(x.nbytes, x.category, x.op, x.phase, x.module) for x in a.allocations] == \
        [(x.nbytes, x.category, x.op, x.phase, x.module) for x in b.allocations]


def _count_taken(monkeypatch, shortcut: str) -> list[int]:
    """How many outputs ``FakeMode.<shortcut>`` makes from now on (counted, not held: holding one would keep its
    storage alive), in a one-item list the caller reads after."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    taken = [0]
    original = getattr(FakeMode, shortcut)

    def counted(self, *args):
        out = original(self, *args)
        taken[0] += out is not NotImplemented
        return out

    monkeypatch.setattr(FakeMode, shortcut, counted)
    return taken


FOREACH_RECIPES = [
    ("sgd", {"momentum": 0.9}), ("sgd", {"momentum": 0.9, "nesterov": True}), ("adam", {}), ("adam", {"amsgrad": True}),
    ("adamw", {}), ("adamw", {"weight_decay": 0.1}), ("adagrad", {}), ("rmsprop", {"momentum": 0.9, "centered": True}),
]


@pytest.mark.parametrize("optimizer, kwargs", FOREACH_RECIPES)
@pytest.mark.parametrize("model, precision", [("conv", "fp32"), ("conv", "amp-fp16"), ("conv", "amp-bf16"),
                                              ("mlp", "bf16")])
def test_foreach_shortcut(optimizer, kwargs, model, precision) -> None:
    mf, bf, lf = ZOO[model]
    recipe = Recipe(optimizer=optimizer, optimizer_kwargs=kwargs, precision=precision)
    fast = record_training(mf, bf, lf, 4, recipe, A100)
    _same(fast, record_training(mf, bf, lf, 4, recipe, A100, shortcuts=Shortcuts(foreach=False)))


MODELS = [
    {"source": "torchvision", "name": "resnet18"},
    {"source": "torchvision", "name": "mobilenet_v3_small"},
    {"source": "timm", "name": "convnext_atto"},
    {"source": "transformers", "preset": "gpt2"},
]


@pytest.mark.zoo  # a sweep over models: the zoo tier
@pytest.mark.parametrize("model", MODELS, ids=[m.get("name") or m.get("preset") for m in MODELS])
@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "amp-bf16"])
def test_batch_norm_and_cache_key_shortcuts(model, precision) -> None:
    inp = {"seq_len": 64} if "preset" in model else {"image_size": [3, 64, 64]}
    b = build_request(parse_request({"model": model, "input": inp}))
    recipe = Recipe(precision=precision)
    fast = [record_training(b.factory, b.batch_factory, b.loss_fn, n, recipe, A100) for n in (3, 5)]
    slow = Shortcuts(batch_norm=False, cache_keys=False, cache_hits=False)
    for n, trace in zip((3, 5), fast, strict=True):
        _same(trace, record_training(b.factory, b.batch_factory, b.loss_fn, n, recipe, A100, shortcuts=slow))


LLAMA = {"source": "transformers", "task": "causal-lm",
         "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
                    "num_hidden_layers": 2}}


@pytest.mark.parametrize("training", [{"precision": "amp-bf16"}, {"precision": "fp32", "gradient_checkpointing":
                                                                  "selective"}])
def test_cache_hit_shortcut(training) -> None:
    """A cache hit's outputs (views of their input's storage included) made without FakeTensor.__new__: the same
    step as torch's own path makes them, on a transformer (most of its ops hit the dispatch cache)."""
    from estimator.pipeline import job_of

    job = job_of(parse_request({"model": LLAMA, "input": {"seq_len": 32}, "training": training}))
    b = build_request(parse_request({"model": LLAMA, "input": {"seq_len": 32}, "training": training}))
    fast = record_training(b.factory, b.batch_factory, b.loss_fn, 2, job.recipe, A100)
    _same(fast, record_training(b.factory, b.batch_factory, b.loss_fn, 2, job.recipe, A100,
                                shortcuts=Shortcuts(cache_hits=False)))


GPT2 = {"source": "transformers", "task": "causal-lm",
        "config": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256, "n_positions": 64}}


@pytest.mark.parametrize("model, training, shortcut", [
    (LLAMA, {"precision": "amp-bf16"}, "_unsafe_view"),
    (LLAMA, {"precision": "fp32", "gradient_checkpointing": "selective"}, "_unsafe_view"),
    (GPT2, {"precision": "amp-bf16"}, "_split"),  # its attention splits the fused projection
    (LLAMA, {"precision": "fp32", "distributed": {"strategy": "fsdp", "world_size": 2}}, "_split"),  # FSDP's shards
], ids=["llama-amp-bf16", "llama-selective", "gpt2-amp-bf16", "llama-fsdp"])
def test_view_shortcuts(model, training, shortcut, monkeypatch) -> None:
    """``_unsafe_view`` and ``split`` made without torch's Python kernels: the same step as torch's own path, on
    transformers (every batched matmul's output is reshaped by ``_unsafe_view``)."""
    from estimator.pipeline import job_of

    taken = _count_taken(monkeypatch, shortcut)
    request = parse_request({"model": model, "input": {"seq_len": 32}, "training": training})
    job, b = job_of(request), build_request(request)
    fast = record_training(b.factory, b.batch_factory, b.loss_fn, 2, job.recipe, A100)
    assert taken[0] >= 2  # at least once per layer (the second iteration's forward is written: iterations.py)
    _same(fast, record_training(b.factory, b.batch_factory, b.loss_fn, 2, job.recipe, A100,
                                shortcuts=Shortcuts(views=False)))


def _views(fast: bool) -> list:
    """What ``_unsafe_view``, ``split`` and ``split_with_sizes`` give for contiguous, strided, offset, inferred and
    empty inputs, or their errors."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    mode = FakeMode(shortcuts=Shortcuts(views=fast))
    got: list = []
    with mode:
        a = torch.empty(4, 6, 8, device="cuda", dtype=torch.bfloat16)
        freed = torch.empty(4, 6, device="cuda")
        freed.untyped_storage().resize_(0)
        split, sizes = aten.split.Tensor, aten.split_with_sizes.default
        cases = [
            (aten._unsafe_view, (a, [24, 8])), (aten._unsafe_view, (a[1:], [3, 48])), (aten._unsafe_view, (a, [-1])),
            (aten._unsafe_view, (a, (2, -1, 8))), (aten._unsafe_view, (a, [5, 8])),
            (aten._unsafe_view, (a.transpose(0, 1), [24, 8])), (aten._unsafe_view, (torch.empty(3), [3])),
            (aten._unsafe_view, (torch.empty(0, 5, device="cuda"), [0, -1, 5])),
            # contiguous, but not with contiguous strides: torch keeps the stride of a dimension it leaves alone
            (aten._unsafe_view, (torch.empty(6, 1, device="cuda").t(), [1, 6])),
            (aten._unsafe_view, (torch.empty(6, 1, device="cuda").t(), [1, 2, 3])),
            (aten._unsafe_view, (torch.empty(2, 3, 1, device="cuda").transpose(1, 2), [2, 1, 3])),
            (aten._unsafe_view, (aten._neg_view(a), [24, 8])), (split, (aten._neg_view(a), 3, 2)),
            (split, (a, 2)), (split, (a, 4, 1)), (split, (a.transpose(0, 1), 4, 1)), (split, (a[1:], 5, -1)),
            (split, (a, 9, 2)), (split, (a, 0)), (split, (torch.empty(0, 3, device="cuda"), 2)),
            (sizes, (a, [1, 3])), (sizes, (a, [2, 0, 4], 1)), (sizes, (a, [2, 3], 1)), (sizes, (a[:, 1], [5, 3], -1)),
            (split, (torch.empty(512, device="meta"), 128)), (split, (a,), {"split_size": 3, "dim": 1}),
            (split, (freed, 2)), (sizes, (freed, [1, 3])),  # a storage resized to 0, as FSDP frees a parameter
            (aten._unsafe_view, (torch.empty(6, 4, device="meta"), [24])),
        ]
        view = aten.view.default  # torch's fake kernel is _unsafe_view's, but its output is a view (autograd's)
        cases += [(view, args) for op, args, *_ in cases if op is aten._unsafe_view]
        cases += [(view, (torch.empty(1, 6, device="cuda"), [6, 1])), (view, (a, [4, 48, 1])),
                  (view, (torch.empty(2, 3, device="cuda"), [1, 6])), (view, (a[:, :3], [12, 8]))]
        detach = aten.detach.default
        cases += [(detach, (t,)) for t in (
            a, a[1:], a.transpose(0, 2), a[:, ::2], torch.empty(3, 1, device="cuda").expand(3, 4),
            torch.empty(0, 5, device="cuda"), torch.empty((), device="cuda"), aten._neg_view(a),
            torch.empty(6, 4, device="meta"), torch.empty(3, device="cuda", requires_grad=True))]
        for op, args, *kwargs in cases:
            try:
                out = op(*args, **(kwargs[0] if kwargs else {}))
            except Exception as exc:  # torch's own error, from either path
                got.append((type(exc).__name__, str(exc)))
                continue
            outs = out if isinstance(out, (list, tuple)) else [out]
            got.append([(type(o), o.shape, o.stride(), o.storage_offset(), o.untyped_storage().nbytes(),
                         torch._C._is_alias_of(o, args[0]), o._is_view(), o._base is None, o.device, o.dtype,
                         o.requires_grad, str(torch._C._dispatch_keys(o)), o.fake_mode is mode,
                         sorted(((k, v) for k, v in o.__dict__.items() if k != "fake_mode"), key=str)) for o in outs])
            with torch.no_grad():  # (a leaf that requires grad, too)
                args[0].add_(1)  # whose version counter each output shares
            got.append([(o._version, args[0]._version) for o in outs])
    return got


def test_a_view_shortcut_gives_what_torch_gives(monkeypatch) -> None:
    """The storage, offset, strides, version counter and state of each output, and the errors of inputs the
    shortcuts leave to torch, are torch's own."""
    taken = [_count_taken(monkeypatch, name) for name in ("_unsafe_view", "_split", "_detach")]
    fast = _views(True)
    assert all(t[0] >= 5 for t in taken), taken
    assert fast == _views(False)


@pytest.mark.parametrize("training", [
    {"precision": "fp32", "distributed": {"strategy": "fsdp", "world_size": 2}},
    {"precision": "fp32", "optimizer": {"name": "adamw", "weight_decay": 0.1},
     "distributed": {"strategy": "fsdp", "world_size": 4, "fsdp": {"param_dtype": "bf16"}}},
], ids=["fsdp-adam", "fsdp-adamw-bf16-params"])
def test_foreach_sharding_shortcut(training, monkeypatch) -> None:
    """DTensor's foreach strategies expanded once per distinct element: each op's strategy is the one torch's own
    expansion gives (compared on every foreach op of the step), the repeated layers' elements come from the memo,
    and the FSDP step records what it records without the memo."""
    from torch.distributed.tensor import debug

    from estimator.pipeline import job_of
    from estimator.simulate.distributed import foreach_sharding

    request = parse_request({"model": LLAMA, "input": {"seq_len": 32}, "training": training})
    job, b = job_of(request), build_request(request)

    def record(shortcuts: Shortcuts | None = None):
        foreach_sharding._MEMO.clear()
        debug._clear_sharding_prop_cache()  # torch's caches of whole ops (Python's, C++'s): every op worked out
        debug._clear_fast_path_sharding_prop_cache()
        return record_training(b.factory, b.batch_factory, b.loss_fn, 2, job.recipe, A100, shortcuts=shortcuts)

    memoized, ops, keys = foreach_sharding.memoized, [0], []

    def compared(expand):
        ours = memoized(expand)

        def both(mesh, schema, info, meta):
            mine, torchs = ours(mesh, schema, info, meta), expand(mesh, schema, info, meta)

            def strategy(op, args, kwargs):
                got = mine(op, args, kwargs)
                assert got == torchs(op, args, kwargs)  # every element's input and output specs
                ops[0] += 1
                return got
            return strategy
        return both

    key = foreach_sharding._key
    monkeypatch.setattr(foreach_sharding, "memoized", compared)
    monkeypatch.setattr(foreach_sharding, "_key", lambda *a: keys.append(key(*a)) or keys[-1])
    fast = record()
    assert ops[0] >= 3 and None not in keys and len(set(keys)) < len(keys) / 2, (ops, len(set(keys)), len(keys))
    _same(fast, record(Shortcuts(foreach_sharding=False)))


def test_a_cache_hit_output_has_the_state_torch_gives_a_fake_tensor() -> None:
    """``FakeMode._fresh`` sets what ``FakeTensor.__new__`` sets (a torch that adds state fails here)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    mode = FakeMode()
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        with mode:
            theirs = FakeTensor(mode, torch.empty(4, 8, device="meta"), device)
            ours = mode._fresh(torch.empty(4, 8, device="meta", requires_grad=True), device)
        assert theirs.__dict__.keys() == ours.__dict__.keys()
        assert all(ours.__dict__[k] is v or ours.__dict__[k] == v for k, v in theirs.__dict__.items())
        assert type(ours) is FakeTensor and ours.device == device and ours.requires_grad
        assert torch._C._dispatch_keys(ours) == torch._C._dispatch_keys(theirs.requires_grad_())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_low", [False, True])
@pytest.mark.parametrize("shape, channels_last", [((8, 16, 5, 5), False), ((8, 16, 5, 5), True), ((8, 16), False),
                                                  ((4, 16, 7), False), ((2, 16, 3, 4, 5), False)])
def test_cudnn_batch_norm_outputs(dtype, weight_low, shape, channels_last) -> None:
    wdt = dtype if weight_low else torch.float32
    results = {}
    for fast in (True, False):
        with VirtualGPU(A100, shortcuts=Shortcuts(batch_norm=fast)):
            x = torch.empty(shape, device="cuda", dtype=dtype)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            w, b, rm, rv = (torch.empty(16, device="cuda", dtype=wdt) for _ in range(4))
            got = []
            for training in (False, True):
                outs = aten.cudnn_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
                got.append([(tuple(o.shape), o.stride(), o.dtype) for o in outs])
            go = torch.empty_like(x)
            grads = aten.cudnn_batch_norm_backward(x, go, w, rm, rv, outs[1], outs[2], 1e-5, outs[3])
            got.append([(tuple(o.shape), o.stride(), o.dtype) for o in grads])
            results[fast] = got
    assert results[True] == results[False]


def _lifted(fast: bool) -> list:
    """What ``torch.tensor`` of each scalar gives in the virtual GPU's fake mode, and what ops on it then give:
    its state, its constant, its memos, an in-place op's output and value, ``item()``."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    mode = FakeMode(shortcuts=Shortcuts(lift=fast))
    converter = mode.fake_tensor_converter
    got: list = []
    values = [(0.0, torch.float32), (3.5, torch.float64), (7, torch.int64), (-2, torch.int32), (1, torch.int8),
              (True, torch.bool), (0.25, torch.bfloat16), (float("nan"), torch.float64),
              (float("inf"), torch.float64), (2.0, None), ([1.0, 2.0], None)]
    with mode:
        for value, dtype in values:
            t = torch.tensor(value, dtype=dtype)
            state = sorted(((k, v) for k, v in t.__dict__.items() if k not in ("fake_mode", "constant")), key=str)
            got.append((type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t._version,
                        str(torch._C._dispatch_keys(t)), state, t.fake_mode is mode,
                        None if t.constant is None else (t.constant.tolist(), t.constant.dtype),
                        t.constant is not None and converter._get_memo(t.constant) is t,
                        t.constant is not None and t.constant.untyped_storage()._cdata != t.untyped_storage()._cdata))
            if t.dim() == 0 and dtype is not torch.bool:
                out = t.add_(1)
                got.append((out is t, t.item(), t._version, t.item_memo))
                got.append((t * 2).item())
    got.append(len(converter.constant_storage_mapping))
    return got


def test_a_lifted_scalar_is_what_torch_lifts() -> None:
    """``torch.tensor`` of a scalar, lifted without ``meta_utils``: the same fake tensor, constant and memos as
    torch's path, and the same results of the ops that read its value (compared as text: NaN is a value here)."""
    fast, slow = _lifted(True), _lifted(False)
    assert repr(fast) == repr(slow)
    assert "('_item_memo', 3.5)" in repr(fast)  # a float64 constant's Python number, kept as torch keeps it


@pytest.mark.parametrize("optimizer, kwargs", [("adam", {}), ("adamw", {"weight_decay": 0.1}),
                                               ("adam", {"amsgrad": True}), ("sgd", {"momentum": 0.9})])
def test_lift_shortcut(optimizer, kwargs, monkeypatch) -> None:
    """An optimizer's step counters (``torch.tensor(0.0)`` per parameter) lifted by the shortcut: the same step."""
    taken = _count_taken(monkeypatch, "_lift_scalar")
    mf, bf, lf = ZOO["conv"]
    recipe = Recipe(optimizer=optimizer, optimizer_kwargs=kwargs, precision="amp-bf16")
    fast = record_training(mf, bf, lf, 4, recipe, A100)
    assert taken[0] >= (2 if optimizer.startswith("adam") else 0)
    _same(fast, record_training(mf, bf, lf, 4, recipe, A100, shortcuts=Shortcuts(lift=False)))


def _outcome(op, args, kwargs=None, mode=None) -> list:
    """``op(*args, **kwargs)``'s outputs, each as its op, type, shape, strides, offset, dtype, device, whether it
    requires grad and is a view, its dispatch keys, its storage's bytes, whether it aliases an argument, whether
    it is ``mode``'s and its own state besides the mode (None for an output that is None); or torch's error."""
    try:
        outs = op(*args, **(kwargs or {}))
    except Exception as exc:  # torch's own error, from either path
        return [(str(op), type(exc).__name__, str(exc))]
    return [None if out is None else (
        str(op), type(out), out.shape, out.stride(), out.storage_offset(), out.dtype, out.device, out.requires_grad,
        out._is_view(), str(torch._C._dispatch_keys(out)), out.untyped_storage().nbytes(),
        any(torch._C._is_alias_of(out, a) for a in args if isinstance(a, torch.Tensor)), out.fake_mode is mode,
        sorted(((k, v) for k, v in out.__dict__.items() if k != "fake_mode"), key=str))
        for out in (outs if isinstance(outs, (tuple, list)) else (outs,))]


def _pointwise(fast: bool) -> list:
    """What each op of the pointwise shortcut gives for inputs it takes and inputs it leaves to torch (other
    strides, dtypes, shapes, a scalar tensor, an integer tensor), or their errors."""
    from estimator.simulate.virtual_gpu.fake_mode import _POINTWISE, FakeMode

    mode = FakeMode(shortcuts=Shortcuts(pointwise=fast))
    got: list = []
    with mode:
        def inputs(dtype):
            x = torch.empty(4, 6, 8, device="cuda", dtype=dtype)
            ones = torch.empty(1, 5, 1, device="cuda", dtype=dtype)
            return [(x, torch.empty_like(x)), (x.transpose(0, 1), torch.empty(6, 4, 8, device="cuda", dtype=dtype)),
                    (x, torch.empty(4, 6, 8, device="cuda", dtype=torch.float32)), (x, torch.tensor(2.0)),
                    (x, torch.empty(6, 8, device="cuda")), (x[:, :3], torch.empty(4, 3, 8, device="cuda", dtype=dtype)),
                    (ones, torch.empty_like(ones)),
                    (torch.empty(0, 3, device="cuda", dtype=dtype),) * 2,
                    (torch.empty(4, 4, device="cuda", dtype=torch.int64),) * 2,
                    (torch.empty(2, 3, 4, 5, device="cuda", dtype=dtype).to(memory_format=torch.channels_last),) * 2,
                    (torch.empty(2, 3, 1, 5, device="cuda", dtype=dtype).to(memory_format=torch.channels_last),) * 2,
                    (torch.empty(2, 3, 4, 5, device="cuda", dtype=dtype).to(memory_format=torch.channels_last),
                     torch.empty(2, 3, 4, 5, device="cuda", dtype=dtype)),
                    (torch.empty(2, 3, 4, 5, device="cuda", dtype=dtype).permute(0, 2, 1, 3),) * 2,
                    (torch.empty(2, 3, 0, 5, device="cuda", dtype=dtype).to(memory_format=torch.channels_last),) * 2,
                    (torch.empty(0, 3, 4, 5, device="cuda", dtype=dtype),) * 2,
                    (torch.empty(4, 6, 8, device="cuda", dtype=dtype).requires_grad_(),) * 2]
        extra = {aten.threshold_backward.default: (0,), aten.pow.Tensor_Scalar: (2,), aten.add.Tensor: ()}
        keywords = {aten.add.Tensor: [{}, {"alpha": 2}, {"alpha": 0.5}],
                    aten.gelu.default: [{}, {"approximate": "tanh"}, {"approximate": "foo"}],
                    aten.gelu_backward.default: [{}, {"approximate": "tanh"}, {"approximate": "foo"}]}
        for op in _POINTWISE:
            unary = len(op._schema.arguments) - len(extra.get(op, ())) - len(keywords.get(op, [{}])[-1]) == 1
            for dtype in (torch.float32, torch.bfloat16):
                for pair in inputs(dtype):
                    for kwargs in keywords.get(op, [{}]):
                        args = (pair[0],) if unary else (pair[0], pair[1])
                        got += _outcome(op, (*args, *extra.get(op, ())), kwargs, mode)
        from estimator.simulate.virtual_gpu.fake_mode import _IN_PLACE

        for op in _IN_PLACE:  # each on fresh tensors: an in-place op changes its self's version
            unary = len(op._schema.arguments) - len(_IN_PLACE[op]) == 1
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.empty(4, 6, 8, device="cuda", dtype=dtype)
                for pair in [*inputs(dtype), (x, x), (x, x.view(6, 4, 8)), (x, 3), (x, 0.5), (x, True),
                             (torch.empty(3, 1, device="cuda", dtype=dtype).expand(3, 4),) * 2,
                             (torch.empty(6, 8, device="cuda", dtype=dtype), torch.empty(4, 6, 8, device="cuda",
                                                                                         dtype=dtype))]:
                    for kwargs in ({}, {"alpha": 2}, {"alpha": 0.5}) if "alpha" in _IN_PLACE[op] else ({},):
                        args = (pair[0],) if unary else (pair[0], pair[1])
                        got += _outcome(op, args, kwargs, mode)
                        if isinstance(args[0], torch.Tensor):
                            got.append(args[0]._version)
        cast = aten._to_copy.default
        for kwargs in ({"dtype": torch.bfloat16}, {"dtype": torch.float32}, {}, {"dtype": torch.float16, "layout":
                       torch.strided, "device": torch.device("cuda", 0), "memory_format": torch.preserve_format},
                       {"dtype": torch.int64}, {"dtype": torch.bfloat16, "device": torch.device("cpu")},
                       {"dtype": torch.bfloat16, "memory_format": torch.contiguous_format},
                       {"dtype": torch.bfloat16, "non_blocking": True}):
            for x, *_ in inputs(torch.float32) + [(torch.empty(3, 1, 4, device="cuda").transpose(0, 2),),
                                                  (torch.empty(5, 5, device="cuda")[:, ::2],)]:
                got += _outcome(cast, (x,), kwargs, mode)
        logits = [torch.empty(6, 10, device="cuda", dtype=dtype) for dtype in (torch.float32, torch.bfloat16,
                                                                                torch.float16)]
        logits += [torch.empty(10, 6, device="cuda").t(), torch.empty(2, 3, 10, device="cuda"),
                   torch.empty(10, device="cuda")]
        for x in logits:
            n = x.shape[0] if x.dim() > 1 else 1
            targets = [torch.empty(shape, dtype=dtype, device="cuda")
                       for shape, dtype in (((n,), torch.int64), ((n,), torch.int32), ((n + 1,), torch.int64),
                                            ((), torch.int64))]
            calls = [(aten._log_softmax.default, (x, 1, False)), (aten._log_softmax.default, (x, -1, True)),
                     (aten._log_softmax.default, (x, 2, False)),
                     (aten._log_softmax_backward_data.default, (torch.empty_like(x), torch.empty_like(x), 2, x.dtype))]
            for target in targets:
                for weight in (None, torch.empty(10, device="cuda")):
                    for reduction in (0, 1, 2):
                        calls.append((aten.nll_loss_forward.default, (x, target, weight, reduction, -100)))
                        for g in (torch.empty((), device="cuda", dtype=x.dtype), torch.empty(n, device="cuda")):
                            total = torch.empty((), device="cuda", dtype=x.dtype)
                            calls.append((aten.nll_loss_backward.default,
                                          (g, x, target, weight, reduction, -100, total)))
            for out in (torch.empty_like(x), torch.empty(x.shape, device="cuda", dtype=torch.float32)):
                for dtype in (x.dtype, torch.float32):
                    calls.append((aten._log_softmax_backward_data.default, (torch.empty_like(x), out, 1, dtype)))
            for op, args in calls:
                got += _outcome(op, args, mode=mode)
    return got


def test_a_pointwise_shortcut_gives_what_torch_gives(monkeypatch) -> None:
    """Each op's output (shape, strides, dtype, storage, state) or error is torch's own; in place, the same
    tensor with the same version."""
    taken = _count_taken(monkeypatch, "_in_place")
    fast = _pointwise(True)
    assert taken[0] > 40
    assert fast == _pointwise(False)
    assert sum(isinstance(case, tuple) and len(case) > 3 for case in fast) > 300  # outputs, not errors


def _factories(fast: bool) -> list:
    """What ``empty_strided``, ``zeros_like``, ``empty_like`` and ``ones_like`` give with the factories shortcut on or
    off: for the tensors and arguments it takes (contiguous or channels-last strides, sizes of 1, each keyword)
    and those it leaves to torch (other strides, an expanded or empty tensor, another device, layout or memory
    format, pinned memory, a CPU or meta tensor, negative or mismatched sizes), their outputs' state or torch's
    error; and inside inference mode."""
    from estimator.simulate.virtual_gpu.fake_mode import _LIKE, FakeMode

    mode = FakeMode(shortcuts=Shortcuts(factories=fast))
    cuda, cl = torch.device("cuda", 0), torch.channels_last
    got: list = []
    with mode:
        tensors = [torch.empty(4, 6, 8, device="cuda"), torch.empty(4, 6, 8, device="cuda", dtype=torch.bfloat16),
                   torch.empty(2, 3, 4, 5, device="cuda").to(memory_format=cl),
                   torch.empty(2, 3, 1, 5, device="cuda").to(memory_format=cl),
                   torch.empty(64, 1, 3, 3, device="cuda"), torch.empty(256, 64, 1, 1, device="cuda"),
                   torch.empty(256, 64, 1, 1, device="cuda").to(memory_format=cl),
                   torch.empty(6, 1, device="cuda").t(), torch.empty(4, 6, device="cuda").t(),
                   torch.empty(4, 6, device="cuda")[:, ::2], torch.empty(3, 1, device="cuda").expand(3, 4),
                   torch.empty(0, 3, device="cuda"), torch.empty((), device="cuda"), torch.empty(7, device="cuda"),
                   torch.empty(4, 4, device="cuda", dtype=torch.int64), torch.empty(3, 4), torch.tensor(2.0),
                   torch.empty(3, 4, device="meta"), torch.empty(5, device="cuda", requires_grad=True),
                   aten._neg_view(torch.empty(4, 6, device="cuda"))]
        like_kwargs = [{}, {"dtype": torch.bfloat16}, {"dtype": torch.int64}, {"dtype": torch.qint8},
                       {"memory_format": torch.preserve_format},
                       {"memory_format": torch.contiguous_format}, {"memory_format": cl}, {"device": cuda},
                       {"device": torch.device("cpu")}, {"layout": torch.strided}, {"pin_memory": False},
                       {"pin_memory": True}]
        for op in _LIKE:
            for x in tensors:
                if op is aten.empty_like.default and x.constant is not None:
                    continue  # a CPU constant's empty_like holds whatever its memory held
                for kwargs in like_kwargs:
                    got += _outcome(op, (x,), kwargs, mode)
        empty = aten.empty_strided.default
        for size, stride in (((4, 6), (6, 1)), ((4, 6), (1, 4)), ((2, 3), (0, 1)), ((0, 3), (3, 1)), ((), ()),
                             ((2, 3, 4, 5), (60, 1, 15, 3)), ((3, 1), (1, 9)), ((2, 3), (3,)), ((2, -1), (1, 1)),
                             ([4, 6], [6, 1])):
            for kwargs in ({"device": cuda}, {"device": cuda, "dtype": torch.bfloat16}, {}, {"dtype": torch.float16},
                           {"device": torch.device("cuda")}, {"device": torch.device("meta")},
                           {"device": torch.device("mps")}, {"device": cuda, "dtype": torch.qint8},
                           {"device": cuda, "layout": torch.strided, "pin_memory": False},
                           {"device": cuda, "pin_memory": True}):
                got += _outcome(empty, (size, stride), kwargs, mode)
        torch.set_default_dtype(torch.float64)
        try:
            got += _outcome(empty, ((2, 3), (3, 1)), {"device": cuda}, mode)
        finally:
            torch.set_default_dtype(torch.float32)
        for inside in (True, False):
            with torch.inference_mode(inside):
                got += _outcome(empty, ((2, 3), (3, 1)), {"device": cuda}, mode)
                got += _outcome(aten.zeros_like.default, (tensors[0],), {}, mode)
                got.append([o.is_inference() for o in (empty((2,), (1,), device=cuda),
                                                       aten.zeros_like.default(tensors[0]))])
    return got


def test_a_factory_shortcut_gives_what_torch_gives(monkeypatch) -> None:
    """Each factory's output (shape, strides, dtype, device, storage, state) or error is torch's own; the shortcut
    answers most of the cases."""
    taken = [_count_taken(monkeypatch, name) for name in ("_like", "_empty_strided")]
    fast = _factories(True)
    assert taken[0][0] > 60 and taken[1][0] > 15
    assert fast == _factories(False)


def test_the_stride_helpers_are_torchs() -> None:
    """Contiguous and channels-last strides and the non-overlapping-and-dense test, as ``torch._prims_common``
    answers them, over shapes with sizes of 0 and 1 and over permuted, sliced, expanded and channels-last tensors."""
    import itertools

    from torch._prims_common import (
        compute_required_storage_length,
        is_non_overlapping_and_dense_or_false,
        make_channels_last_strides_for,
        make_contiguous_strides_for,
    )

    from estimator.simulate.virtual_gpu.strides import (
        channels_last_strides,
        contiguous_strides,
        non_overlapping_and_dense,
        storage_length,
    )

    checked = 0
    for rank in range(5):
        for shape in itertools.product((0, 1, 2, 3), repeat=rank):
            assert contiguous_strides(shape) == make_contiguous_strides_for(shape)
            if rank == 4:
                assert channels_last_strides(shape) == make_channels_last_strides_for(shape)
            base = torch.empty(shape, device="meta")
            views = [base, base.unsqueeze(0).expand(2, *shape)]
            views += [base.permute(p) for p in itertools.permutations(range(rank))]
            views += [base[..., ::2], base[:1], base.transpose(0, -1)] if rank else []
            if rank == 4:
                views.append(base.to(memory_format=torch.channels_last))
            for t in views:
                assert non_overlapping_and_dense(t) == is_non_overlapping_and_dense_or_false(t), (t.shape, t.stride())
                for offset in (0, 5):
                    assert storage_length(t.shape, t.stride(), offset) == \
                        compute_required_storage_length(t.shape, t.stride(), offset)
                checked += 1
    assert checked > 8000


@pytest.mark.parametrize("model, inp, precision", [
    ({"source": "torchvision", "name": "resnet18"}, {"image_size": [3, 64, 64]}, "fp32"),
    ({"source": "torchvision", "name": "resnet18"}, {"image_size": [3, 64, 64]}, "amp-bf16"),
    ({"source": "timm", "name": "convnext_atto"}, {"image_size": [3, 64, 64]}, "amp-fp16"),
    (LLAMA, {"seq_len": 32}, "amp-bf16"), (LLAMA, {"seq_len": 32}, "bf16"), (GPT2, {"seq_len": 32}, "fp32"),
], ids=["resnet18-fp32", "resnet18-amp-bf16", "convnext-amp-fp16", "llama-amp-bf16", "llama-bf16", "gpt2-fp32"])
def test_pointwise_and_lift_shortcuts(model, inp, precision, monkeypatch) -> None:
    """Elementwise ops (activations, their gradients, a norm's products) made like their inputs, and the step
    counters lifted without meta_utils: the same step as torch's own paths, on CNNs and transformers."""
    taken = _count_taken(monkeypatch, "_pointwise")
    b = build_request(parse_request({"model": model, "input": inp}))
    recipe = Recipe(precision=precision)
    like = _count_taken(monkeypatch, "_like")
    fast = record_training(b.factory, b.batch_factory, b.loss_fn, 3, recipe, A100)
    assert taken[0] >= 4 and like[0] >= 4
    _same(fast, record_training(b.factory, b.batch_factory, b.loss_fn, 3, recipe, A100,
                                shortcuts=Shortcuts(pointwise=False, lift=False, factories=False)))


def _convolutions(fast: bool) -> list:
    """What ``convolution`` and ``convolution_backward`` give with the shortcut on or off: for the inputs it takes
    (2-d, dense, no dimension of size 1, contiguous or channels-last, grouped, strided, dilated, padded, with or
    without a bias, each output mask) and those it leaves to torch (1x1 kernels, a batch of one, a 1x1 output,
    mixed dtypes, transposed), their outputs' state or torch's error."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    mode = FakeMode(shortcuts=Shortcuts(convolution=fast))
    conv, backward = aten.convolution.default, aten.convolution_backward.default
    cl = torch.channels_last
    got: list = []
    with mode:
        def t(*shape, dtype=torch.float32, fmt=torch.contiguous_format):
            return torch.empty(*shape, device="cuda", dtype=dtype).to(memory_format=fmt)

        cases = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for xf, wf in ((torch.contiguous_format,) * 2, (cl, cl), (cl, torch.contiguous_format),
                           (torch.contiguous_format, cl)):
                for n, c, size, o, k, stride, pad, dil, groups in (
                        (2, 4, 8, 6, 3, 1, 1, 1, 1), (3, 4, 9, 6, 3, 2, 1, 1, 2), (2, 4, 12, 8, 3, 1, 2, 2, 4),
                        (2, 4, 8, 6, 1, 1, 0, 1, 1), (1, 4, 8, 6, 3, 1, 1, 1, 1), (2, 4, 3, 6, 3, 1, 0, 1, 1),
                        (2, 6, 10, 4, 5, 2, 2, 1, 1)):
                    x, w = t(n, c, size, size, dtype=dtype, fmt=xf), t(o, c // groups, k, k, dtype=dtype, fmt=wf)
                    for bias in (None, t(o, dtype=dtype)):
                        cases.append((conv, (x, w, bias, [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups)))
                    out = (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                    g = t(n, o, out, out, dtype=dtype, fmt=xf) if out > 0 else t(n, o, 1, 1, dtype=dtype)
                    for mask in ([True, True, True], [False, True, False], [True, True, False]):
                        for sizes in ([o], [0], None):
                            cases.append((backward, (g, x, w, sizes, [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0],
                                                     groups, mask)))
        x, w = t(2, 4, 8, 8), t(6, 4, 3, 3)
        cases += [(conv, (x, t(6, 4, 3, 3, dtype=torch.bfloat16), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
                  (conv, (x, t(4, 6, 3, 3), None, [1, 1], [1, 1], [1, 1], True, [0, 0], 1)),
                  (conv, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 3)),
                  (conv, (x[:, :, ::2], w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))]
        for op, args in cases:
            got += _outcome(op, args, mode=mode)
    return got


def test_a_convolution_shortcut_gives_what_torch_gives(monkeypatch) -> None:
    """Each convolution's outputs (shapes, strides: the memory format; dtype, storage, state) or error is torch's
    own; the shortcut answers most of the cases."""
    taken = _count_taken(monkeypatch, "_convolution")
    fast = _convolutions(True)
    assert taken[0] > 150
    assert fast == _convolutions(False)


@pytest.mark.parametrize("model, precision", [("resnet18", "fp32"), ("resnet18", "amp-bf16"),
                                              ("mobilenet_v3_small", "amp-fp16")])
def test_convolution_shortcut(model, precision) -> None:
    """A CNN's step with its convolutions made by the shortcut: the same as torch's own path."""
    b = build_request(parse_request({"model": {"source": "torchvision", "name": model},
                                     "input": {"image_size": [3, 64, 64]}}))
    recipe = Recipe(precision=precision)
    fast = record_training(b.factory, b.batch_factory, b.loss_fn, 3, recipe, A100)
    _same(fast, record_training(b.factory, b.batch_factory, b.loss_fn, 3, recipe, A100,
                                shortcuts=Shortcuts(convolution=False)))


def _inference(fast: bool) -> list:
    """Views, casts and elementwise ops of a normal tensor inside ``torch.inference_mode`` and of an inference
    tensor outside it (a teacher model's forward): whether each output is an inference tensor and a view, or the
    error."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    got: list = []
    with FakeMode(shortcuts=Shortcuts(views=fast, pointwise=fast, factories=fast)):
        normal = torch.empty(4, 6, device="cuda")
        with torch.inference_mode():
            inference = torch.empty(4, 6, device="cuda")
        for x, inside in ((normal, True), (inference, False)):
            for op in (lambda t: aten.view.default(t, [24]), lambda t: aten._unsafe_view.default(t, [24]),
                       lambda t: t.reshape(24), lambda t: t.split(2)[0], lambda t: t.half(),
                       lambda t: aten.relu.default(t), lambda t: t.detach(), lambda t: torch.zeros_like(t),
                       lambda t: t.add_(torch.empty(4, 6, device="cuda")), lambda t: t.relu_(),
                       lambda t: torch.empty_strided((4, 6), (6, 1), device=torch.device("cuda", 0))):
                try:
                    with torch.inference_mode(inside):
                        out = op(x)
                    got.append((out.is_inference(), out._is_view(), out.stride(), out.dtype))
                except Exception as exc:  # torch's own error, from either path
                    got.append((type(exc).__name__, str(exc)))
    return got


def test_the_shortcuts_leave_inference_mode_to_torch() -> None:
    """An inference tensor, or a view made in inference mode, is torch's to make (autograd shares no version
    counter with one): the same outputs, and no error the general path does not raise."""
    fast = _inference(True)
    assert fast == _inference(False)
    errors = [case for case in fast if isinstance(case[0], str)]
    # only torch's refusal of the in-place ops (add_, relu_) on the inference tensor outside inference mode
    assert len(errors) == 2 and all("Inplace update to inference tensor" in case[1] for case in errors)


def test_a_lifted_constant_shares_its_storage_as_torch_lifts_it() -> None:
    """An op worked out from a lifted constant whose result shares the constant's storage (detach, a view) shares
    the fake tensor's storage, as meta_utils memoizes it."""
    from estimator.simulate.virtual_gpu.fake_mode import FakeMode

    def shared(fast: bool) -> list:
        with FakeMode(shortcuts=Shortcuts(lift=fast)):
            got = []
            for op in (lambda t: t.detach(), lambda t: aten.alias.default(t), lambda t: t.view(1),
                       lambda t: t.unsqueeze(0), lambda t: t.clone()):
                t = torch.tensor(3.0)
                out = op(t)
                got.append((torch._C._is_alias_of(out, t), out.constant is not None))
            return got

    fast = shared(True)
    assert fast == shared(False)
    assert fast[0] == (True, True)
