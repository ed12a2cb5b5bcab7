"""Bad requests: each names its field, the value and what was expected, in the library and the CLI alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from estimator.cli.main import main
from estimator.errors import SpecError
from estimator.gpus import CATALOG
from estimator.pipeline import estimate
from estimator.plan.results import EstimateResponse
from estimator.request.parse import parse_request

pytestmark = pytest.mark.unit

TV = {"source": "torchvision", "name": "resnet18"}


def _req(model=TV, **rest) -> dict:
    return {"model": model, "gpus": ["A100-80GB"], **rest}


BAD = [
    # (request, field, a fragment of what was expected)
    (_req({"source": "torchvision", "name": "resnet5"}), "model.name", "did you mean resnet50"),
    (_req({"source": "timm", "name": "convnext_tinyy"}), "model.name", "convnext_tiny"),
    (_req({"source": "transformers", "preset": "gpt-2"}), "model.preset", "did you mean gpt2"),
    (_req({"source": "transformers", "config": {"model_type": "lama"}, "task": "causal-lm"}),
     "model.config.model_type", "llama"),
    (_req({"source": "pytorch-hub", "name": "x"}), "model", "torchvision"),
    ({"gpus": ["A100-80GB"]}, "model", "required"),
    (_req({"source": "transformers", "preset": "gpt2", "task": "translation"}), "model.task", "causal-lm"),
    (_req({"source": "transformers", "preset": "gpt2", "task": "masked-lm"}), "model.task", "a task gpt2 supports"),
    (_req({"source": "transformers", "preset": "bert-base-uncased"}, input={"seq_len": 1024}),
     "input.seq_len", "at most 512"),
    (_req({"source": "transformers", "preset": "vit-base-patch16-224"}, input={"image_size": [3, 384, 384]}),
     "input.image_size", "[3, 224, 224]"),
    (_req(input={"image_size": [3, 8, 8]}), "input.image_size", "from 16 to 8192"),
    (_req(batch_size=0), "batch_size", "greater than or equal to 1"),
    (_req(batch_size=-3), "batch_size", "greater than or equal to 1"),
    (_req(batch_size=2**21), "batch_size", "less than or equal to 1048576"),
    ({"model": TV, "gpus": ["A100-90GB"]}, "gpus[0]", "did you mean A100-80GB"),
    ({"model": TV, "gpus": ["T4-16GB", "B300"]}, "gpus[1]", "catalog GPU name"),
    (_req({"source": "transformers", "preset": "gpt2", "config": {"auto_map": {"AutoModel": "x.Y"}}}),
     "model.config.auto_map", "no remote code"),
    (_req({"source": "transformers", "config": {"model_type": "gpt2", "trust_remote_code": True}, "task": "causal-lm"}),
     "model.config.trust_remote_code", "no remote code"),
    (_req({"source": "custom", "factory": "os:system"}), "model.source", "never from a request"),
    (_req({"source": "torchvision", "name": "resnet18", "kwargs": {"weights": "DEFAULT"}}),
     "model.kwargs.weights", "never downloads"),
    (_req({"source": "timm", "name": "resnet18", "kwargs": {"pretrained": True}}),
     "model.kwargs.pretrained", "never downloads"),
    (_req({"source": "torchvision", "name": "resnet18", "kwargs": {"num_clases": 10}}),
     "model.kwargs.num_clases", "did you mean num_classes"),
    (_req({"source": "torchvision", "name": "resnet18", "kwargs": {"dropout": 0.1}}),  # allowed, not ResNet's
     "model.kwargs.dropout", "arguments the constructor accepts"),
    (_req({"source": "torchvision", "name": "fasterrcnn_resnet50_fpn"}, input={"num_objects": 0}),
     "input.num_objects", "greater than or equal to 1"),
    # wrong types anywhere
    (_req(batch_size="4"), "batch_size", "valid integer"),
    (_req(batch_size=4.0), "batch_size", "valid integer"),
    (_req(input={"image_size": "224"}), "input.image_size", "valid list"),
    (_req({"source": "torchvision", "name": "resnet18", "kwargs": []}), "model.kwargs", "an object"),
    ({"model": TV, "gpus": "A100-80GB"}, "gpus", "valid list"),
    ({"model": TV, "gpus": [7]}, "gpus[0]", "valid string or an object"),
    ({"model": TV, "gpus": [{"name": "big", "memory_bytes": "80GB"}]}, "gpus[0].memory_bytes", "valid integer"),
    (_req(training={"grad_accumulation_steps": 1.5}), "training.grad_accumulation_steps", "valid integer"),
    (_req(training={"gradient_checkpointing": "yes"}), "training.gradient_checkpointing", "reentrant"),
    (_req(training={"optimizer": {"name": "adamw", "momentum": "0.9"}}), "training.optimizer.momentum", "valid number"),
    (_req(training={"optimizer": {"name": "lamb"}}), "training.optimizer.name", "'adamw'"),
    (_req(training={"precision": "fp8"}), "training.precision", "'amp-bf16'"),
    (_req(trainig={}), "trainig", "no such field"),
    (_req(planner={"confirm": "sometimes"}), "planner.confirm", "'every-card'"),
    (_req(planner={"confirm": 1}), "planner.confirm", "'top'"),
    (_req(planner={"headroom": 1.5}), "planner.headroom", "less than 1"),
    (_req(training={"zero_grad_at": "before-backward"}), "training.zero_grad_at", "'after-forward'"),
    (_req(training={"cudnn_benchmark": "yes"}), "training.cudnn_benchmark", "valid boolean"),
    ([1, 2], "(body)", "JSON object"),
]


@pytest.mark.parametrize("request_json, field, expected", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_library_error(request_json, field, expected) -> None:
    with pytest.raises(SpecError) as info:
        estimate(parse_request(request_json))
    assert info.value.field == field
    assert expected in info.value.expected, str(info.value)
    assert str(info.value).startswith(f"{field}: got ")


@pytest.mark.parametrize("request_json, field, expected", BAD[::4], ids=[b[1] for b in BAD[::4]])
def test_cli_error_is_the_library_error(request_json, field, expected, tmp_path, capsys) -> None:
    with pytest.raises(SpecError) as info:
        estimate(parse_request(request_json))
    spec = tmp_path / "request.json"
    spec.write_text(json.dumps(request_json))
    assert main(["estimate", "--spec", str(spec), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {info.value}\n"


def test_cli_unreadable_spec(tmp_path, capsys) -> None:
    assert main(["estimate", "--spec", str(tmp_path / "missing.json")]) == 2
    assert "error: --spec: got" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{model: 1}")
    assert main(["estimate", "--spec", str(bad)]) == 2
    assert "a JSON object" in capsys.readouterr().err


def _batchfit() -> str:
    exe = Path(sys.executable).with_name("batchfit")
    assert exe.exists(), "the batchfit console script is installed by `pip install -e .`"
    return str(exe)


@pytest.mark.sim
def test_cli_end_to_end_json_contract() -> None:
    request = {
        "model": {"source": "torchvision", "name": "squeezenet1_1", "kwargs": {"num_classes": 10}},
        "input": {"image_size": [3, 128, 128]},
        "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw", "foreach": None, "fused": None}},
        "gpus": ["T4-16GB", {"name": "tiny", "memory_bytes": 2 * 2**30, "compute_capability": "8.0"}],
    }
    proc = subprocess.run([_batchfit(), "estimate", "--spec", "-", "--json"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    # every size an int, every field present
    response = TypeAdapter(EstimateResponse).validate_json(proc.stdout, strict=True)
    assert [r.gpu for r in response.results] == ["T4-16GB", "tiny"]
    t4, tiny = response.results
    assert t4.capacity_bytes == CATALOG["T4-16GB"].memory_bytes and tiny.capacity_bytes == 2 * 2**30
    for r, context in ((t4, CATALOG["T4-16GB"].context_bytes), (tiny, 450 * 2**20)):
        m = r.memory
        assert r.max_batch_size is not None and m.batch_size == r.max_batch_size and m.fits
        assert r.recommended_batch_size <= r.max_batch_size
        assert m.allocated_peak_bytes <= m.reserved_peak_bytes <= r.capacity_bytes - context
        assert m.device_peak_bytes == m.reserved_peak_bytes + context
    assert tiny.max_batch_size < t4.max_batch_size
    assert response.per_sample_bytes > 0 and response.fixed_bytes > 0
    assert response.parameter_count == 727_626  # squeezenet1_1 with 10 classes
    assert response.provenance.torch == "2.14.1" and response.provenance.simulations >= 2
    assert set(body["breakdown"]) >= {"parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                      "inputs"}


@pytest.mark.sim
def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``batchfit ARGS`` in-process: (exit status, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_custom_model_and_table(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "mynets.py").write_text(
        "import torch.nn as nn\n"
        "def make(width=64):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(), nn.Linear(width, 10))\n"
    )
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({"input": {"image_size": [3, 32, 32]}, "gpus": ["T4-16GB"], "batch_size": 256}))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _cli(capsys, "estimate", "--spec", str(spec), "--model", "mynets:make")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["gpu", "memory", "GiB"] and "dev peak @256 GiB" in lines[0]
    row = lines[1].split()
    assert row[0] == "T4-16GB" and row[-1] == "yes"  # batch_size 256 fits the card
    # 3072*64 + 64 + 64*10 + 10 = 197,322 parameters
    assert "197,322 parameters" in out


@pytest.mark.sim
def test_cli_table_shows_both_batches_and_the_advice_asked_for(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "mynets.py").write_text(
        "import torch.nn as nn\n"
        "def make(width=64):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(), nn.Linear(width, 10))\n"
    )
    body = {"input": {"image_size": [3, 32, 32]}, "gpus": ["T4-16GB"],
            "planner": {"target_global_batch": 4096, "base_lr": 0.1, "base_batch": 256, "dataset_size": 50_000}}
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    table = _cli(capsys, "estimate", "--spec", str(spec), "--model", "mynets:make")
    as_json = _cli(capsys, "estimate", "--spec", str(spec), "--model", "mynets:make", "--json")
    assert table[0] == 0 and as_json[0] == 0, table[2] + as_json[2]
    (r,) = json.loads(as_json[1])["results"]
    head, row = table[1].splitlines()[:2]
    for column in ("max batch", "recommended", "dev peak @max GiB", "dev peak @rec GiB", "step s @rec",
                   "epoch s @rec", "micro x steps x ranks", "lr"):
        assert column in head
    a = r["accumulation"]
    assert f"{a['micro_batch']} x {a['steps']} x {a['ranks']} = {a['global_batch']}" in row
    cells = row.split()
    assert cells[2:4] == [str(r["max_batch_size"]), str(r["recommended_batch_size"])]
    assert cells[4:6] == [f"{r['max_memory']['device_peak_bytes'] / 2**30:.2f}",
                          f"{r['recommended_memory']['device_peak_bytes'] / 2**30:.2f}"]
    assert f"{r['learning_rate']['lr']:.3g}" in cells and f"{r['step_seconds']:.3f}" in cells
    assert "learning rate: sqrt scaling" in table[1]


def test_every_task_of_the_schema_has_a_transformers_head() -> None:
    """The Task vocabulary (request/spec.py) and the Auto classes that build each head name the same tasks."""
    from typing import get_args

    from estimator.models.sources.transformers import Task
    from estimator.models.sources.transformers.build import AUTO_CLASSES

    assert set(AUTO_CLASSES) == set(get_args(Task))


def test_a_sub_models_task_class_is_built_from_its_sub_config() -> None:
    """musicgen's causal LM is its decoder (MusicgenForCausalLM takes the decoder sub-config, which no auto
    mapping holds); an encoder-decoder without a pad id (which shifting the labels right needs) takes its
    decoder's. Both say so among the assumptions."""
    from support import build_request

    small = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "ffn_dim": 128}
    built = build_request(parse_request(_req({"source": "transformers", "task": "causal-lm",
                                      "config": {"model_type": "musicgen", "decoder": small}})))
    model = built.factory()
    assert type(model).__name__ == "MusicgenForCausalLM" and model.config.hidden_size == 64
    assert "MusicgenForCausalLM is built from the config's decoder" in built.assumptions
    bert = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
            "intermediate_size": 128, "pad_token_id": 3}
    built = build_request(parse_request(_req({"source": "transformers", "task": "seq2seq-lm", "config": {
        "model_type": "encoder-decoder", "encoder": bert, "decoder": {**bert, "is_decoder": True},
        "decoder_start_token_id": 0}})))
    assert built.factory().config.pad_token_id == 3
    assert "pad_token_id unset: using 3 (the decoder's)" in built.assumptions
