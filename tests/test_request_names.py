"""What a request may name: allow-lists for kwargs and configs, no paths or URLs anywhere.

The refusals happen in ``check_request`` (before a worker sees the request) and again in the builders
(a request built without ``parse_request``); the last test runs hostile requests through a worker's
``serve`` loop under a Python audit hook and checks that none opens a file or reaches the network.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import build_request

from estimator.errors import SpecError
from estimator.gpus import CATALOG
from estimator.request.parse import parse_request
from estimator.request.spec import EstimateRequest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _hf(config: dict, task: str = "causal-lm") -> dict:
    return {"model": {"source": "transformers", "config": config, "task": task}, "gpus": ["T4-16GB"]}


def _wrapper(**fields) -> dict:
    return _hf({"model_type": "timm_wrapper", **fields}, "image-classification")


def _refused(request: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_request(request)
    return info.value


# --- timm_wrapper reached files and the Hub -------------------------------------------------

TIMM_WRAPPER = [
    ("local-dir", {"architecture": "local-dir:/some/dir"}, "model.config.architecture"),
    ("hf-hub", {"architecture": "hf-hub:timm/resnet18.a1_in1k"}, "model.config.architecture"),
    ("checkpoint_path", {"architecture": "resnet18", "model_args": {"checkpoint_path": "/any/file"}},
     "model.config.model_args.checkpoint_path"),
]


@pytest.mark.parametrize("fields, field", [d[1:] for d in TIMM_WRAPPER], ids=[d[0] for d in TIMM_WRAPPER])
def test_timm_wrapper_names_only_a_timm_registry_model(fields, field) -> None:
    # main: parse_request accepted all three; building read /some/dir/config.json, asked the Hub
    # (DNS, five retries, 57 s, then LocalEntryNotFoundError: a 500), or torch.load-ed the file
    err = _refused(_wrapper(**fields))
    assert err.field == field
    assert ("timm.list_models()" in err.expected) if field.endswith("architecture") else ("shapes" in err.expected)


def test_the_builder_refuses_too_and_reads_nothing(tmp_path) -> None:
    """A request validated without ``check_request`` (the library's ``EstimateRequest.model_validate``)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 10}))
    checkpoint = tmp_path / "weights.pth"
    checkpoint.write_bytes(b"not a checkpoint")
    for fields, field in (({"architecture": f"local-dir:{folder}"}, "model.config.architecture"),
                          ({"architecture": "resnet18", "model_args": {"checkpoint_path": str(checkpoint)}},
                           "model.config.model_args.checkpoint_path")):
        request = EstimateRequest.model_validate(_wrapper(**fields))
        with pytest.raises(SpecError) as info:  # main: built from the folder's config.json; torch.load-ed the file
            build_request(request)
        assert info.value.field == field


def test_timm_wrapper_with_a_registry_name_still_builds() -> None:
    built = build_request(parse_request(_wrapper(architecture="resnet18", model_args={"drop_path_rate": 0.1})))
    # timm resnet18 without its head (num_classes=0): 11,176,512; transformers' head Linear(512, 2): 1,026
    assert (built.name, built.parameter_count) == ("transformers:timm_wrapper", 11_176_512 + 512 * 2 + 2)


# --- auto_map inside a list ---------------------------------------------------------------------

NESTED_AUTO_MAP = [
    ({"model_type": "gpt2", "x": [{"auto_map": {"AutoModelForCausalLM": "evil.Model"}}]}, "model.config.x[0].auto_map"),
    ({"model_type": "gpt2", "x": [[1, {"trust_remote_code": True}]]}, "model.config.x[0][1].trust_remote_code"),
    ({"model_type": "gpt2", "task_specific_params": {"a": [{"b": {"auto_map": "m.C"}}]}},
     "model.config.task_specific_params.a[0].b.auto_map"),
]


@pytest.mark.parametrize("config, field", NESTED_AUTO_MAP, ids=[r[1] for r in NESTED_AUTO_MAP])
def test_auto_map_nested_in_a_list_is_refused(config, field) -> None:
    err = _refused(_hf(config))  # main: accepted (the recursion went into dicts only)
    assert err.field == field and "no remote code" in err.expected


# --- transformers: other fields that name a model ----------------------------------------------------

NAMING = [
    # a backbone by name is looked up on the Hub while the config is built (consolidate_backbone_kwargs_to_config)
    ({"model_type": "upernet", "backbone": "microsoft/resnet-50"}, "model.config.backbone", "backbone_config"),
    ({"model_type": "detr", "backbone_kwargs": {"out_indices": [1]}}, "model.config.backbone_kwargs",
     "backbone_config"),
    ({"model_type": "detr", "use_pretrained_backbone": True}, "model.config.use_pretrained_backbone",
     "never downloads"),
    ({"model_type": "gpt2", "_attn_implementation": "kernels-community/flash-attn"},
     "model.config._attn_implementation", "model.attn_implementation"),
    ({"model_type": "rag"}, "model.config.model_type", "retriever"),
    ({"model_type": "rwkv"}, "model.config.model_type", "kernels-community"),  # fetched where CUDA and ninja are
    ({"model_type": "yoso"}, "model.config.model_type", "kernels-community"),
    # sub-configs are configs: an encoder-decoder's encoder, a backbone_config, a gemma3n vision tower
    ({"model_type": "encoder-decoder", "encoder": {"model_type": "timm_wrapper", "architecture": "hf-hub:a/b"},
      "decoder": {"model_type": "gpt2"}}, "model.config.encoder.architecture", "timm.list_models()"),
    ({"model_type": "encoder-decoder", "encoder": {"model_type": "timm_backbone", "backbone": "local-dir:/x"},
      "decoder": {"model_type": "gpt2"}}, "model.config.encoder.backbone", "timm.list_models()"),
    ({"model_type": "detr", "backbone_config": {"model_type": "timm_backbone", "backbone": "hf-hub:timm/x"}},
     "model.config.backbone_config.backbone", "timm.list_models()"),
    ({"model_type": "gemma3n", "vision_config": {"model_args": {"pretrained_cfg_overlay": {"file": "/w.pth"}}}},
     "model.config.vision_config.model_args.pretrained_cfg_overlay", "shapes the model"),
    ({"model_type": "encoder-decoder", "encoder": {"model_type": "rag"}, "decoder": {"model_type": "gpt2"}},
     "model.config.encoder.model_type", "retriever"),
]


@pytest.mark.parametrize("config, field, expected", NAMING, ids=[n[1] for n in NAMING])
def test_fields_that_name_another_model_are_refused(config, field, expected) -> None:
    err = _refused(_hf(config))
    assert err.field == field and expected in err.expected, str(err)


def test_nested_model_types_are_checked_against_transformers() -> None:
    request = EstimateRequest.model_validate(_hf({"model_type": "encoder-decoder", "encoder": {"model_type": "bertt"},
                                                  "decoder": {"model_type": "gpt2"}}, "seq2seq-lm"))
    with pytest.raises(SpecError) as info:
        build_request(request)
    assert info.value.field == "model.config.encoder.model_type" and "did you mean bert" in info.value.expected


def test_an_empty_nested_model_type_names_nothing() -> None:
    """A sub-config class that is no registered type saves model_type "" (nemo_speechlm's diarization
    head_config); its parent builds it from its own class, so "" passes below the top, and only there."""
    from estimator.models.allowed import check_config

    known = {"gpt2", "nemo_speechlm"}
    nested = {"model_type": "nemo_speechlm", "audio_config": {"head_config": {"model_type": ""}}}
    check_config(nested, known_types=known)
    with pytest.raises(SpecError) as info:
        check_config({"model_type": ""}, known_types=known)
    assert info.value.field == "model.config.model_type"
    with pytest.raises(SpecError):
        check_config({"model_type": "gpt2", "x": {"model_type": "gpt3"}}, known_types=known)


# --- timm and torchvision kwargs: an allow-list -------------------------------------------------------

REFUSED_KWARGS = [
    ("timm", "resnet18", {"checkpoint_path": "/any/file"}, "checkpoint_path", "never downloads"),
    ("timm", "resnet18", {"pretrained": True}, "pretrained", "never downloads"),
    ("timm", "resnet18", {"pretrained_cfg": {"file": "/w.pth", "hf_hub_id": "timm/resnet18.a1_in1k"}},
     "pretrained_cfg", "shapes the model"),
    ("timm", "resnet18", {"pretrained_cfg_overlay": {"file": "/w.pth"}}, "pretrained_cfg_overlay", "never downloads"),
    ("timm", "resnet18", {"cache_dir": "/tmp/x"}, "cache_dir", "never downloads"),
    ("timm", "resnet18", {"features_only": True}, "features_only", "one of act_layer,"),
    ("torchvision", "resnet18", {"weights": "IMAGENET1K_V1"}, "weights", "never downloads"),
    ("torchvision", "fasterrcnn_resnet50_fpn", {"weights_backbone": "DEFAULT"}, "weights_backbone", "never downloads"),
    ("torchvision", "resnet18", {"progress": True}, "progress", "one of attention_dropout, aux_logits,"),
    ("torchvision", "resnet18", {"num_clases": 10}, "num_clases", "did you mean num_classes"),
    ("torchvision", "resnet18", {"file": "weights.pth"}, "file", "shapes the model"),
]


@pytest.mark.parametrize("source, name, kwargs, key, expected", REFUSED_KWARGS,
                         ids=[f"{r[0]}-{r[3]}" for r in REFUSED_KWARGS])
def test_a_kwarg_outside_the_allow_list_is_refused_by_name(source, name, kwargs, key, expected) -> None:
    request = {"model": {"source": source, "name": name, "kwargs": kwargs}, "gpus": ["T4-16GB"]}
    err = _refused(request)
    assert err.field == f"model.kwargs.{key}" and expected in err.expected, str(err)
    with pytest.raises(SpecError) as info:  # the builder, for a request that skipped check_request
        build_request(EstimateRequest.model_validate(request))
    assert info.value.field == f"model.kwargs.{key}"


@pytest.mark.parametrize("source, name, kwargs", [
    # every kwarg tests/, bench/, estimator/testing/ and docs/ use today, and the documented off values
    ("torchvision", "resnet18", {"num_classes": 10}),
    ("torchvision", "squeezenet1_1", {"num_classes": 10}),
    ("torchvision", "googlenet", {"init_weights": False, "aux_logits": False}),
    ("torchvision", "vit_b_16", {"image_size": 256, "dropout": 0.1}),
    ("torchvision", "resnet18", {"weights": None}),
    ("torchvision", "fasterrcnn_mobilenet_v3_large_320_fpn", {"weights": None, "weights_backbone": None,
                                                              "trainable_backbone_layers": 3}),
    ("timm", "vit_tiny_patch16_224", {"img_size": 256, "dynamic_img_size": True, "drop_path_rate": 0.1}),
    ("timm", "resnet18", {"in_chans": 1, "num_classes": 10, "pretrained": False, "checkpoint_path": "",
                          "pretrained_cfg_overlay": None, "cache_dir": None}),
])
def test_kwargs_that_shape_the_model_still_build(source, name, kwargs) -> None:
    built = build_request(parse_request({"model": {"source": source, "name": name, "kwargs": kwargs}}))
    assert built.parameter_count > 0


def test_every_allowed_kwarg_is_a_constructor_argument_of_its_source() -> None:
    """No typo in the allow-lists: each name is a parameter of some model class (or builder) of its source."""
    import timm.models
    import torch.nn as nn
    import torchvision.models as tvm

    from estimator.models.allowed import NO_DOWNLOAD, TIMM_KWARGS, TORCHVISION_KWARGS

    def parameters(modules) -> set[str]:
        out: set[str] = set()
        for module in modules:
            for obj in vars(module).values():
                if callable(obj) and getattr(obj, "__module__", None) == module.__name__:
                    target = obj.__init__ if inspect.isclass(obj) and issubclass(obj, nn.Module) else obj
                    try:
                        out |= set(inspect.signature(target).parameters)
                    except (TypeError, ValueError):
                        continue
        return out

    tv_modules = {inspect.getmodule(tvm.get_model_builder(n)) for n in tvm.list_models()}
    timm_modules = {inspect.getmodule(timm.models.model_entrypoint(n)) for n in timm.list_models()}
    assert TORCHVISION_KWARGS - parameters(tv_modules) == set()
    assert TIMM_KWARGS - parameters(timm_modules) == set()
    assert not (TIMM_KWARGS | TORCHVISION_KWARGS) & {k for off in NO_DOWNLOAD.values() for k in off}


# --- no paths or URLs anywhere ---------------------------------------------------------------------

HOSTILE_STRINGS = ["http://example.com/w.pth", "https://huggingface.co/gpt2", "s3://bucket/key", "file:///etc/passwd",
                   "file:w.pth", "hf-hub:timm/resnet18", "hf_hub:timm/resnet18", "local-dir:/models/x",
                   "LOCAL-DIR:x", "/etc/passwd", "~/models", "~root", "../secrets", "a/../../b", "./weights.pth",
                   "C:\\models\\w.pth", "\\\\server\\share"]


@pytest.mark.parametrize("text", HOSTILE_STRINGS)
def test_path_like_values_are_refused_in_kwargs_config_and_names(text) -> None:
    cases = [
        ({"source": "torchvision", "name": "resnet18", "kwargs": {"dropout": text}}, "model.kwargs.dropout"),
        ({"source": "timm", "name": "resnet18", "kwargs": {"act_layer": text}}, "model.kwargs.act_layer"),
        ({"source": "timm", "name": text}, "model.name"),
        ({"source": "transformers", "preset": text}, "model.preset"),
        ({"source": "transformers", "preset": "gpt2", "config": {"_name_or_path": text}}, "model.config._name_or_path"),
        ({"source": "transformers", "preset": "gpt2", "config": {"rope_scaling": {"files": [1, text]}}},
         "model.config.rope_scaling.files[1]"),
        ({"source": "transformers", "preset": "gpt2", "config": {"id2label": {text: "x"}}},
         f"model.config.id2label.{text}"),
    ]
    for model, field in cases:
        err = _refused({"model": model})
        assert err.field == field and "not a path or URL" in err.expected, (model, str(err))


def test_legitimate_names_do_not_look_like_paths() -> None:
    import timm
    import torchvision.models as tvm

    from estimator.models.allowed import looks_like_path
    from estimator.models.sources.transformers import presets

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    preset_strings = [s for cfg in presets().values() for k, v in cfg.items() if k != "_source" for s in strings(v)]
    names = (timm.list_models() + timm.list_models(pretrained=True) + tvm.list_models() + list(CATALOG)
             + preset_strings + ["gelu_pytorch_tanh", "silu", "bfloat16", "torch.float16", "gated-gelu", "mean",
                                 "cls_index", "paged|eager", "1e-5", "NVIDIA H100 80GB HBM3", "id_2", "a/b"])
    assert [n for n in names if looks_like_path(n)] == []
    assert len(names) > 2000


def test_golden_and_gpu_suite_requests_pass_the_names_check() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from golden import REQUESTS
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from estimator.measure.cases import CASES

    for model, inp, training in REQUESTS.values():
        parse_request({"model": model, "input": inp, "training": training})
    for _, _, request in CASES:
        parse_request(request)


# --- the proof: hostile requests through a worker, under an audit hook ----------------------------

# Runs in a fresh interpreter: imports the libraries (their own files), installs the hook, then answers
# the requests with app/worker.py's serve loop over a Pipe, as a pool worker does. Every open() outside
# Python's and the packages' trees and every name lookup or connect is recorded (a lookup also refused,
# so that nothing leaves the machine); the hook is checked on two control events first.
AUDIT = r"""
import json, os, site, socket, sys, threading
from multiprocessing import Pipe
job = json.loads(sys.stdin.read())
sys.path[:] = [p for p in sys.path if os.path.isabs(p)]  # relative entries make imports probe the cwd
import torch, torchvision, timm, transformers, huggingface_hub  # noqa: F401 - their import-time reads
import estimator, estimator.models, estimator.pipeline, app
estimator.warm_libraries()  # what a worker imports before its first request: import-time reads, not a request's
from app.worker import Reply, serve

trees = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages(),
         os.path.dirname(estimator.__file__), os.path.dirname(app.__file__)}
roots = tuple(os.path.realpath(t) + os.sep for t in trees) + ("/proc/", "/sys/", "/dev/")
NET = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
       "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg"}
seen = []

def hook(event, args):
    if event in NET:
        seen.append([event, repr(args)[:200]])
        raise PermissionError("audit hook: no network")
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if not (path + os.sep).startswith(roots):
            seen.append([event, path])

sys.addaudithook(hook)
open(job["control"]).close()
try:
    socket.getaddrinfo("huggingface.co", 443)
except PermissionError:
    pass
controls, seen[:] = list(seen), []

parent, child = Pipe()
replies = []

def feed():
    parent.recv()  # ("ready", pid)
    for i, request in enumerate(job["requests"]):
        parent.send((i, "estimate", request))
        r = parent.recv()
        replies.append({"kind": str(r.kind), "type": r.error_type, "payload": r.payload if r.kind != "ok" else "ok"})
    parent.send(None)

feeder = threading.Thread(target=feed)
feeder.start()
serve(child)
feeder.join()
print(json.dumps({"controls": controls, "violations": seen, "replies": replies}))
"""


def _hostile(tmp: Path) -> list[tuple[dict, str]]:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 10}))
    checkpoint = tmp / "weights.pth"
    checkpoint.write_bytes(b"not a checkpoint")
    tiny_gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}

    def tv(**kwargs):
        return {"source": "torchvision", "name": "resnet18", "kwargs": kwargs}

    def tm(name="resnet18", **kwargs):
        return {"source": "timm", "name": name, "kwargs": kwargs}

    def hf(config, task="causal-lm"):
        return {"source": "transformers", "config": config, "task": task}

    wrapper = {"model_type": "timm_wrapper"}
    return [  # (model, the field refused)
        (hf({**wrapper, "architecture": f"local-dir:{folder}"}, "image-classification"), "model.config.architecture"),
        (hf({**wrapper, "architecture": "hf-hub:timm/resnet18.a1_in1k"}, "image-classification"),
         "model.config.architecture"),
        (hf({**wrapper, "architecture": "resnet18", "model_args": {"checkpoint_path": str(checkpoint)}},
            "image-classification"), "model.config.model_args.checkpoint_path"),
        # main: hf_api().repo_exists while AutoConfig builds the config, before the task is checked
        (hf({"model_type": "upernet", "backbone": "timm/resnet18.a1_in1k"}), "model.config.backbone"),
        (hf({**tiny_gpt2, "x": [{"auto_map": {"AutoModelForCausalLM": "evil.Model"}}]}), "model.config.x[0].auto_map"),
        (hf({**tiny_gpt2, "_name_or_path": "https://huggingface.co/gpt2"}), "model.config._name_or_path"),
        (hf({**tiny_gpt2, "_name_or_path": str(folder)}), "model.config._name_or_path"),
        (tm(checkpoint_path=str(checkpoint)), "model.kwargs.checkpoint_path"),
        (tm(pretrained_cfg={"file": str(checkpoint), "hf_hub_id": "timm/resnet18.a1_in1k"}),
         "model.kwargs.pretrained_cfg"),
        (tm(drop_rate="hf-hub:timm/resnet18.a1_in1k"), "model.kwargs.drop_rate"),
        (tm("hf-hub:timm/resnet18.a1_in1k"), "model.name"),
        (tv(weights="IMAGENET1K_V1"), "model.kwargs.weights"),
        (tv(num_classes="http://example.com/weights.pth"), "model.kwargs.num_classes"),
    ]


@pytest.mark.service
def test_hostile_requests_open_no_file_and_reach_no_network(tmp_path) -> None:
    hostile = _hostile(tmp_path)
    control = tmp_path / "control.txt"
    control.write_text("the hook sees this one")
    job = {"control": str(control), "requests": [{"model": model, "gpus": ["T4-16GB"], "input": {"seq_len": 16},
                                                  "planner": {"confirm": "none", "curve_points": 0}}
                                                 if model["source"] == "transformers" else
                                                 {"model": model, "gpus": ["T4-16GB"],
                                                  "planner": {"confirm": "none", "curve_points": 0}}
                                                 for model, _ in hostile]}
    # no offline switch: the proof is that nothing is attempted, not that the libraries were told not to
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-P", "-c", AUDIT], input=json.dumps(job), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (opened, path), (looked_up, host) = out["controls"]  # the hook sees a file in tmp and a name lookup
    assert (opened, path, looked_up) == ("open", str(control.resolve()), "socket.getaddrinfo") and "huggingface" in host
    answers = [(r["kind"], r["type"], r["payload"].get("field") if isinstance(r["payload"], dict) else r["payload"])
               for r in out["replies"]]
    assert answers == [("error", "SpecError", field) for _, field in hostile]
    assert out["violations"] == []
