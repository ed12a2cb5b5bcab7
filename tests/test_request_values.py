"""Bad values in a request: config and kwargs values, a model's own input past the limits, learning rates
past any recipe, custom GPU names.

Every case is refused before any simulation: models are built on the meta device only. The service tests
check the same errors arrive as 422 problem+json, from the worker (config values) or
from FastAPI's schema (rates, names).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support import PROBLEM, build_request

from app.main import create_app
from app.settings import Settings
from estimator import parse_request
from estimator.errors import SpecError
from estimator.gpus import MIB, custom_gpu
from estimator.options import MAX_SEQ_LEN

pytestmark = pytest.mark.unit


GPT2 = {"source": "transformers", "preset": "gpt2"}


def _refused(model: dict, inp: dict | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        build_request(parse_request({"model": model, "input": inp or {}}))
    return info.value


# --- a bad config or kwarg value is a SpecError on its field, not an internal error ---------------------

BAD_VALUES = [
    # (model, field, a fragment of what was expected)
    ({**GPT2, "config": {"n_embd": "abc"}}, "model.config.n_embd", "an integer"),           # a type, before building
    ({**GPT2, "config": {"n_head": 0}}, "model.config.n_head", "ZeroDivisionError"),        # 768 // 0 in GPT2Attention
    ({**GPT2, "config": {"architectures": [1, 2]}}, "model.config.architectures", "class names"),
    ({**GPT2, "config": {"n_head": 5}}, "model.config.n_head", "divisible"),                # 768 heads of 153.6
    ({"source": "transformers", "preset": "llama-2-7b", "config": {"num_attention_heads": 5}},
     "model.config.num_attention_heads", "not a multiple"),                                 # the config's own check
    ({"source": "torchvision", "name": "resnet18", "kwargs": {"num_classes": -3}},
     "model.kwargs.num_classes", "negative dimension"),                                     # torch.empty(-3, 512)
]


@pytest.mark.parametrize("model, field, expected", BAD_VALUES, ids=[case[1] for case in BAD_VALUES])
def test_bad_values_name_their_field(model, field, expected) -> None:
    err = _refused(model)
    assert err.field == field, str(err)
    assert expected in err.expected, str(err)


def test_the_message_names_the_key_among_several() -> None:
    # two keys given, both allow-listed for torchvision: the one the constructor's message names is blamed
    err = _refused({"source": "torchvision", "name": "resnet18", "kwargs": {"num_classes": 10, "dropout": 0.1}})
    assert err.field == "model.kwargs.dropout" and "unexpected keyword argument" in err.expected
    # none named: the whole config
    err = _refused({**GPT2, "config": {"n_layer": 2, "activation_function": "no-such-act"}})
    assert err.field == "model.config" and "KeyError" in err.expected


def test_only_values_from_the_request_become_spec_errors() -> None:
    from estimator.models.building import given_values

    # Nothing given: a constructor's failure is batchfit's or the library's defect, and stays as it is.
    with pytest.raises(ZeroDivisionError), given_values("model.kwargs", {}, "arguments the constructor accepts"):
        _ = 1 // 0
    with pytest.raises(SpecError) as info, given_values("model.kwargs", {"depth": 0}, "arguments it accepts"):
        _ = 1 // 0
    assert info.value.field == "model.kwargs.depth" and info.value.__cause__ is not None


@pytest.mark.service
def test_the_service_answers_422_from_the_worker(tmp_path) -> None:
    app = create_app(Settings(workers=1, queue_size=0, cache_path=str(tmp_path / "c.sqlite"), request_timeout_s=120))
    with TestClient(app) as client:
        for model, field, _ in (BAD_VALUES[1], BAD_VALUES[5]):
            r = client.post("/estimate", json={"model": model, "gpus": ["T4-16GB"]})
            assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text[:300]
            assert r.json()["field"] == field and r.json()["type"].endswith("/invalid-request")


# --- the resolved input is held to the limits of an explicit one ---------------------------------------

OWN_INPUTS = [
    # (model, field that set the input): each over 8192 px a side, 64 channels or 2^20 tokens
    ({"source": "timm", "name": "vit_tiny_patch16_224", "kwargs": {"img_size": 8208}}, "model.kwargs.img_size"),
    # (a timm pretrained_cfg kwarg, which could also set the input, is refused by name: tests/test_request_names.py)
    ({"source": "timm", "name": "resnet18", "kwargs": {"in_chans": 65}}, "model.kwargs.in_chans"),
    ({"source": "torchvision", "name": "vit_b_16", "kwargs": {"image_size": 8208}}, "model.kwargs.image_size"),
    # a detection model resizes its images itself: the short side to min_size, the long one at most max_size
    ({"source": "torchvision", "name": "fasterrcnn_mobilenet_v3_large_fpn",
      "kwargs": {"min_size": 8000, "max_size": 100000}}, "model.kwargs.min_size"),
    ({"source": "transformers", "preset": "vit-base-patch16-224", "config": {"image_size": 8208}},
     "model.config.image_size"),
    ({**GPT2, "config": {"n_positions": 2**30}}, "model.config.n_positions"),
    ({"source": "transformers", "preset": "bert-base-uncased", "config": {"max_position_embeddings": 2**21}},
     "model.config.max_position_embeddings"),
]


@pytest.mark.parametrize("model, field", OWN_INPUTS, ids=[case[1] for case in OWN_INPUTS])
def test_a_models_own_input_is_held_to_the_limits(model, field) -> None:
    err = _refused(model)
    assert err.field == field, str(err)
    assert "the limit on input." in err.expected


def test_only_the_resolved_input_counts() -> None:
    # 2^30 positions are fine when the request trains 1024 tokens of them
    built = build_request(parse_request({"model": {**GPT2, "config": {"n_positions": 2**30}},
                                         "input": {"seq_len": 1024}}))
    assert built.input == {"seq_len": 1024}
    # and the longest-seq_len search stops at the limit, not at the model's 2^30
    assert built.max_seq_len == MAX_SEQ_LEN


def test_timm_defaults_follow_the_kwargs_that_shape_the_input() -> None:
    # timm keeps the weights' pretrained_cfg (3x224x224): the default input follows img_size and in_chans
    built = build_request(parse_request({"model": {"source": "timm", "name": "vit_tiny_patch16_224",
                                           "kwargs": {"img_size": 256, "in_chans": 1}}}))
    assert built.input == {"image_size": [1, 256, 256]}


# --- learning rates --------------------------------------------------------------------------------------

SMALL = {"model": {"source": "torchvision", "name": "resnet18"}, "gpus": ["T4-16GB"]}


@pytest.mark.parametrize("section, field", [
    ({"planner": {"base_lr": 1e308, "base_batch": 1}}, "planner.base_lr"),   # x the global batch: inf, then null
    ({"planner": {"base_lr": 10.5, "base_batch": 256}}, "planner.base_lr"),
    ({"training": {"optimizer": {"name": "sgd", "momentum": float("inf")}}}, "training.optimizer.momentum"),
])
def test_learning_rates_past_any_recipe_are_refused(section, field) -> None:
    with pytest.raises(SpecError) as info:
        parse_request({**SMALL, **section})
    assert info.value.field == field


def test_the_largest_base_lr_gives_a_finite_lr() -> None:
    from estimator.plan.advice import lr_advice

    req = parse_request({**SMALL, "planner": {"base_lr": 10.0, "base_batch": 1}})
    assert req.planner.base_lr == 10.0
    # the largest global batch: MAX_BATCH (2^20) per rank x 65536 ranks
    assert lr_advice("sgd", 10.0, 1, 2**20 * 65536).lr == 10.0 * 2**36


# --- custom GPU names -----------------------------------------------------------------------------------

CARD_NAMES = ["A100-80GB", "a100-80gb", "NVIDIA H200", "tesla t4",     # a catalog name or description, any case
      "a\x00b", "A100\n", "x\r\ny", "<b>big</b>", "", " lead", "x" * 65]


@pytest.mark.parametrize("name", CARD_NAMES, ids=[repr(n)[:20] for n in CARD_NAMES])
def test_custom_gpu_names_are_plain_and_not_a_catalog_card(name) -> None:
    with pytest.raises(SpecError) as info:
        parse_request({**SMALL, "gpus": ["T4-16GB", {"name": name, "memory_bytes": 2**30}]})
    assert info.value.field == "gpus[1].name", str(info.value)
    with pytest.raises(SpecError):
        custom_gpu(name, 1024 * MIB)  # the library's own custom cards too


def test_plain_names_are_accepted() -> None:
    req = parse_request({**SMALL, "gpus": [{"name": n, "memory_bytes": 2**30} for n in
                                           ("A100-80GB held", "my card (v2)+", "x" * 64, "7")]})
    assert [g.name for g in req.gpus] == ["A100-80GB held", "my card (v2)+", "x" * 64, "7"]


# --- rates and names through the service: FastAPI's schema refuses them, no worker needed ------------------------

@pytest.mark.service
@pytest.mark.parametrize("body, field", [
    ('{"model": {"source": "torchvision", "name": "resnet18"}, "planner": {"base_lr": 1e308, "base_batch": 1}}',
     "planner.base_lr"),
    ('{"model": {"source": "torchvision", "name": "resnet18"}, '
     '"training": {"optimizer": {"name": "sgd", "momentum": Infinity}}}', "training.optimizer.momentum"),
    ('{"model": {"source": "torchvision", "name": "resnet18"}, '
     '"gpus": [{"name": "A100-80GB", "memory_bytes": 1073741824}]}', "gpus[0].name"),
    ('{"model": {"source": "torchvision", "name": "resnet18"}, '
     '"gpus": [{"name": "<script>x\\u0000", "memory_bytes": 1073741824}]}', "gpus[0].name"),
])
def test_the_service_answers_422(body, field) -> None:
    # no worker and no queue: a request the schema lets through is a 503 at once, not a wait
    with TestClient(create_app(Settings(workers=1, queue_size=0, cache_path=""), start_workers=False)) as client:
        r = client.post("/estimate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text[:300]
    assert r.json()["field"] == field


@pytest.mark.parametrize("nvml_name, total", [
    ("NVIDIA H200", 142 * 2**30),  # the catalog's description, another memory size (ECC toggled, a driver)
    (b"Tesla T4\n<x>", 15 * 2**30),  # bytes from an old pynvml, with characters a name may not hold
])
def test_this_nodes_own_card_never_shadows_the_catalog(monkeypatch, nvml_name, total) -> None:
    # validate: true with gpus null names this node's GPU; a card off the catalog is a custom card, whose
    # name must pass the custom-name rule (before: a pydantic ValidationError, a 500 from the worker)
    import types

    import torch

    from estimator.measure import cuda as validate
    from estimator.request.spec import CustomGPUSpec

    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=total),
                                 nvmlDeviceGetName=lambda h: nvml_name)
    monkeypatch.setattr(validate, "_pynvml", lambda: nvml)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    card = validate.local_card()
    assert isinstance(card, CustomGPUSpec) and card.memory_bytes == total
    assert card.name.startswith("local ") and "\n" not in card.name and "<" not in card.name
    parse_request({"model": {"source": "torchvision", "name": "resnet18"}, "gpus": [card.model_dump()]})
