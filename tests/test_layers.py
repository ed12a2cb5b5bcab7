"""The layers (docs/DESIGN.md, "Who imports whom"): every import points down, and the core needs no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TIER = "unit"

ROOT = Path(__file__).resolve().parents[1] / "estimator"
# Lowest first; a module may import only from its own layer or below.
LAYERS = [
    ("estimator", "estimator.errors", "estimator.trace", "estimator.gpus", "estimator.background"),
    ("estimator.replay",),
    ("estimator.plan", "estimator.plot"),
    ("estimator.portable",),
    ("estimator.request",),
    ("estimator.models",),
    ("estimator.simulate",),
    ("estimator.sources",),
    ("estimator.worlds",),
    ("estimator.pipeline",),
    ("estimator.validate", "estimator.cli", "estimator.testing"),
]


def _layer(module: str) -> int:
    """The layer of a module: its longest matching prefix."""
    best, rank = "", -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    assert rank >= 0, module
    return rank


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of batchfit's own modules, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("estimator"):
            names = [node.module] if node.module != "estimator" else [f"estimator.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("estimator")]
    return out


def test_every_import_points_down() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "estimator":
            continue  # the facade re-exports from every layer, lazily
        for line, target in _imports(path):
            target = target if target in modules else target.rsplit(".", 1)[0]  # `from pkg import name`
            if target == "estimator":
                continue  # the facade's torch-free names (__version__, torch_version)
            if _layer(target) > _layer(name):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert upward == []


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        _layer(name)


@pytest.mark.parametrize("module", ["estimator.trace", "estimator.replay.allocator", "estimator.replay.report",
                                    "estimator.plan.strategy", "estimator.plan.results", "estimator.portable",
                                    "estimator.request.spec", "estimator.errors", "estimator"])
def test_the_core_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


APP = Path(__file__).resolve().parents[1] / "app"


def test_the_service_process_loads_no_torch() -> None:
    """torch loads in the workers only: the API process (app.main with its Kubernetes routes) stays small."""
    code = "import sys, app.main, app.k8s.routes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=APP.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
