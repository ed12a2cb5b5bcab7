"""A service worker imports the model libraries before its first request (estimator.models.registry.warm)."""

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
