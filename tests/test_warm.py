"""A service worker imports the model libraries before its first request (estimator.models.registry.warm) and
warms torch up with two small simulations (estimator.pipeline.warm_up)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from estimator.models import registry

pytestmark = pytest.mark.unit


def test_warm_imports_every_installed_library_of_the_sources() -> None:
    code = ("import sys\nfrom estimator.models.registry import warm, sources\n"
            "assert 'peft' not in sys.modules and 'torchvision' not in sys.modules\n"
            "done = warm()\n"
            "print(all(name in sys.modules for name in done), ' '.join(done))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert {"torchvision", "transformers", "peft"} <= set(out[1:])  # peft: ~2.5 s a cold estimate no longer pays


def test_a_library_not_installed_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    timm = registry.sources()["timm"]
    missing = dataclasses.replace(timm, libraries=("batchfit_no_such_library", "timm"))
    monkeypatch.setitem(registry._SOURCES, "timm", missing)
    done = registry.warm()
    assert "batchfit_no_such_library" not in done and "timm" in done


def test_warm_up_imports_the_libraries_and_simulates_a_cnn_and_a_transformer(monkeypatch) -> None:
    from estimator import pipeline
    from estimator.simulate.source import Simulator

    simulated = []
    original = Simulator.simulate

    def counted(self, batch, gpu):
        simulated.append((self.built.name, batch))
        return original(self, batch, gpu)

    monkeypatch.setattr(Simulator, "simulate", counted)
    done = pipeline.warm_up()
    assert {"torchvision", "transformers", "peft"} <= set(done)
    assert [batch for _, batch in simulated] == [2, 2] and "resnet18" in simulated[0][0]


def test_a_warm_up_step_that_fails_is_skipped(monkeypatch) -> None:
    """A step a library's absence refuses, or any other failure: the worker starts all the same."""
    from estimator import pipeline
    from estimator.errors import SpecError

    built = []

    def build(model, inp):
        built.append(model)
        if len(built) == 1:
            raise SpecError("model.source", "torchvision", "an installed source")
        raise RuntimeError("a defect")

    monkeypatch.setattr(pipeline, "build", build)
    assert "torchvision" in pipeline.warm_up()  # no error
    assert len(built) == 2


@pytest.mark.sim
def test_an_answer_is_the_same_after_a_warm_up() -> None:
    """What the warm-up leaves (torch's lazily set-up state) changes no answer: the same estimate in two new
    processes, one warmed up first."""
    request = ('{"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]}, '
               '"gpus": ["T4-16GB", "A100-80GB"]}')
    code = ("import json, sys\nfrom estimator import estimate, parse_request, to_json, warm_up\n"
            "if sys.argv[1] == '1':\n    warm_up()\n"
            f"doc = to_json(estimate(parse_request(json.loads({request!r}))))\n"
            "del doc['provenance']\nprint(json.dumps(doc, sort_keys=True))")
    cold, warmed = (subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True,
                                   check=True).stdout for flag in ("0", "1"))
    assert cold == warmed and '"max_batch_size"' in cold
