"""The README's examples for your own training code, run as they are printed: one per framework (five lines
each), and the plain-PyTorch ``step_fn``, with the names the prose gives them bound to small real objects."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # the Keras example sets it too, before keras is imported

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytestmark = pytest.mark.sim
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README[README.index("## Your own training code"):]
SECTION = SECTION[:SECTION.index("\n## ", 1)]


def _example(heading: str) -> str:
    """The first python block after ``heading`` in the section."""
    after = SECTION[SECTION.index(f"\n### {heading}\n"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def _lines(code: str) -> int:
    return sum(1 for line in code.splitlines() if line.strip())


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the frameworks write their logs and outputs where they run


# Lightning's own notes on a Trainer left at its defaults: its default logger, the loader's workers, the log interval
@pytest.mark.filterwarnings("ignore:Starting from v1.9.0:UserWarning")
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
def test_the_lightning_example(capsys) -> None:
    pytest.importorskip("lightning")
    from test_integrations_lightning import Images, TwoHeads

    code = _example("Lightning")
    assert _lines(code) == 5
    module, datamodule = TwoHeads(width=32), Images()
    scope = {"module": module, "datamodule": datamodule}
    exec(code, scope)
    finder = scope["finder"]
    assert datamodule.batch_size == finder.batch_size and finder.batch_size * finder.accumulation >= 256
    assert module.steps_run == 2  # trained for real at that batch (the 48 images: each step all of them)
    printed = capsys.readouterr().out.split()
    assert printed[-3:] == [str(finder.batch_size), str(finder.accumulation), str(finder.result.max_batch_size)]


def test_the_hugging_face_example(capsys) -> None:
    pytest.importorskip("accelerate")
    from test_integrations_transformers import Tokens, _model, _sample

    code = _example("Hugging Face Trainer")
    assert _lines(code) == 5
    scope = {"model": _model(), "sample": _sample(shared_labels=False), "dataset": Tokens()}
    exec(code, scope)
    args = scope["args"]
    assert args.per_device_train_batch_size > 8 and args.max_steps == 2
    assert f"{args.per_device_train_batch_size} 1" in capsys.readouterr().out


def test_the_accelerate_example(capsys) -> None:
    pytest.importorskip("accelerate")
    from test_integrations_accelerate import _model

    code = _example("accelerate")
    assert _lines(code) == 5
    x, y = torch.rand(16, 3, 64, 64), torch.zeros(16, dtype=torch.long)
    scope = {"model": _model(), "x": x, "y": y, "loss_fn": F.cross_entropy}
    exec(code, scope)
    fit = scope["train"].fit
    assert capsys.readouterr().out.splitlines() == [f"training at batch {fit.batch_size}"]  # once
    assert fit.batch_size == min(512, fit.result.recommended_batch_size)


def test_the_keras_example() -> None:
    pytest.importorskip("keras")
    from test_integrations_keras import DATA, convolutional

    code = _example("Keras 3")
    assert _lines(code) == 5
    x_train, y_train = DATA[convolutional]
    model = convolutional()
    scope = {"model": model, "x_train": x_train, "y_train": y_train}
    exec(code, scope)
    fit = scope["fit"]
    assert fit.result.gpu == "T4-16GB" and fit.batch_size == fit.result.recommended_batch_size
    assert model.optimizer.iterations.numpy() == 1  # model.fit ran, at that batch (64 arrays: one step)


def test_the_plain_pytorch_step_fn_example() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from estimator import estimate_memory

    start = README.index("Your own `nn.Module` and a loop")
    code = re.search(r"```python\n(.*?)```", README[start:], re.S).group(1)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)

    def make_batch(b: int, device: torch.device):
        ids = torch.zeros(b, 128, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": ids}

    scope = {"estimate_memory": estimate_memory, "my_module": AutoModelForCausalLM.from_config(config),
             "make_batch": make_batch}
    exec(code, scope)
    report = scope["report"]
    assert report.batch_size == 64 and report.fits and report.breakdown.activations > 0
