"""The command line a newcomer types: quick flags instead of a spec file, flags that override a spec, bad
arguments refused before the simulator's libraries load, progress on stderr, help that keeps its examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.cli.main import main

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def _run_here(*argv: str) -> subprocess.CompletedProcess:
    """``batchfit ARGV`` in a fresh interpreter, which then says whether torch was loaded and the exit status."""
    code = (f"import sys; from estimator.cli.main import main; status = main({list(argv)!r}); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(status)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize(("argv", "field"), [
    (["estimate", "--preset", "gpt3"], "model.preset"),                    # close match: gpt2
    (["estimate", "--timm", "resnet18", "--precision", "bf17"], "training.precision"),
    (["estimate", "--torchvision", "resnet18", "--gpus", "A100"], "gpus[0]"),   # two cards: which?
    (["estimate", "--preset", "gpt2", "--seq-len", "0"], "input.seq_len"),
    (["estimate", "--timm", "resnet18", "--image-size", "big"], "--image-size"),
    (["estimate", "--seq-len", "128"], "--spec"),                           # no model at all
    (["estimate", "--preset", "gpt2", "--timm", "resnet18"], "--timm"),     # two models
])
def test_a_bad_argument_is_refused_before_torch_loads(argv: list[str], field: str) -> None:
    out = _run_here(*argv)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {field}: got "), out.stderr
    assert out.stdout.strip() == "no torch"


def test_help_keeps_the_examples_on_their_lines(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = capsys.readouterr().out
    assert "\n  batchfit estimate --preset gpt2-large --seq-len 1024 --precision amp-bf16 --gpus A100-80GB L4\n" in text
    assert "--checkpointing [MODE]" in text and "--quiet" in text


@pytest.mark.sim
def test_quick_flags_answer_like_the_spec_and_tell_each_simulation(tmp_path, capsys) -> None:
    assert main(["estimate", "--torchvision", "resnet18", "--image-size", "64", "--gpus", "T4", "L4", "--json"]) == 0
    out, err = capsys.readouterr()
    quick = json.loads(out)
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({"model": {"source": "torchvision", "name": "resnet18"},
                                "input": {"image_size": [3, 64, 64]}, "gpus": ["A100-80GB"]}))
    # the spec's own card replaced by the flag's
    assert main(["estimate", "--spec", str(spec), "--gpus", "T4-16GB", "L4-24GB", "--json", "--quiet"]) == 0
    out2, err2 = capsys.readouterr()
    from_spec = json.loads(out2)
    assert [r["gpu"] for r in quick["results"]] == ["T4-16GB", "L4-24GB"] == [r["gpu"] for r in from_spec["results"]]
    assert [r["max_batch_size"] for r in quick["results"]] == [r["max_batch_size"] for r in from_spec["results"]]
    lines = err.splitlines()
    assert lines[0].startswith("simulation 1: batch 1 on T4-16GB (") and lines[0].endswith(" s)")
    assert lines[-1].endswith(" s") and f"{quick['provenance']['simulations']} simulations in" in lines[-1]
    assert err2 == ""  # --quiet


@pytest.mark.sim
def test_a_transformers_model_prints_no_library_deprecations(tmp_path) -> None:
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64}
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({"model": {"source": "transformers", "config": config, "task": "causal-lm"},
                                "input": {"seq_len": 32}, "gpus": ["T4"],
                                "training": {"gradient_checkpointing": True},
                                "planner": {"curve_points": 0, "suggestions": False}}))
    out = _run_here("estimate", "--spec", str(spec), "--quiet")
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
