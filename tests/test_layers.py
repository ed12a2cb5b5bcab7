"""The layers (docs/DESIGN.md, "Layout"): every import points down, in the order the code is read, and the
torch-free core stays torch-free; the shapes the layout promises (few loose modules, no hidden channels,
short signatures) hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "estimator"
APP = REPO / "app"
# In reading order: where a request enters first, then each layer below the ones that call it. A module may
# import only from its own layer or below; the facade (``estimator``) resolves its names lazily.
LAYERS = [
    ("estimator.cli",),                # the batchfit command (its ``serve`` starts the service)
    ("app", "app.k8s"),                # the HTTP service, its Kubernetes routes
    ("estimator.measure",),            # real CUDA, CPU and gloo steps, measured
    ("estimator.testing",),            # the test zoo and the coverage sweep
    ("estimator.integrations",),       # drop-ins for Lightning, the HF Trainer, accelerate, Keras: the user's step
    ("estimator.pipeline",),           # one request end to end
    ("estimator.request",),            # the request: schema, parse, job_of
    ("estimator.portable",),           # the portable profile and its replayer
    ("estimator.simulate",),           # the virtual GPU, the recorder, the loop, the Simulator
    ("estimator.models",),             # the model sources and their builders
    ("estimator.plan",),               # the answer: searches, steps, strategy, advice, worlds
    ("estimator.replay",),             # the caching allocator's replay, reports
    ("estimator", "estimator.trace", "estimator.options", "estimator.gpus", "estimator.errors"),  # contracts
]
# What the service may import of the library: the facade and these torch-free modules.
APP_IMPORTS = {"estimator", "estimator.errors", "estimator.gpus", "estimator.options"}


def _layer(module: str) -> int:
    """The layer of a module (0 is the top): its longest matching prefix."""
    best, rank = "", -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    assert rank >= 0, module
    return rank


def _modules() -> dict[str, Path]:
    found = {}
    for base in (ROOT, APP):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of batchfit's own modules, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("estimator", "app")):
            names = [node.module] if node.module != "estimator" else [f"estimator.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith(("estimator", "app"))]
    return out


def _target(name: str, modules: dict[str, Path]) -> str:
    return name if name in modules else name.rsplit(".", 1)[0]  # `from pkg import name`


def test_every_import_points_down() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "estimator":
            continue  # the facade re-exports from every layer, lazily
        for line, imported in _imports(path):
            target = _target(imported, modules)
            if target == "estimator":
                continue  # the facade's torch-free names (__version__, torch_version)
            if _layer(target) < _layer(name):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert upward == []


def test_the_layers_name_every_folder_in_reading_order() -> None:
    named = [p for layer in LAYERS for p in layer]
    folders = sorted({".".join(p.parent.relative_to(REPO).parts) for base in (ROOT, APP)
                      for p in base.rglob("*.py")})
    for folder in folders:
        _layer(folder)
    # each package directly under estimator/ and app/ is a layer of its own, named in the list
    tops = {f for f in folders if f.count(".") <= 1}
    assert tops <= set(named), tops - set(named)
    # and reading order: a layer's modules import only the layers after it (checked above), so the list,
    # read from the top, is the order a request meets them
    assert named.index("estimator.pipeline") < named.index("estimator.request") < named.index("estimator.plan")


def test_the_service_imports_only_the_facade_and_the_named_core() -> None:
    modules = _modules()
    reached = sorted({_target(n, modules) for name, path in modules.items() if name.startswith("app")
                      for _, n in _imports(path) if n.startswith("estimator")})
    assert set(reached) <= APP_IMPORTS, set(reached) - APP_IMPORTS


def test_the_request_imports_no_planner() -> None:
    modules = _modules()
    planner = [f"{path.relative_to(REPO)}:{line}" for name, path in modules.items()
               if name.startswith("estimator.request") for line, n in _imports(path) if n.startswith("estimator.plan")]
    assert planner == []


def test_a_few_modules_are_loose_at_the_top() -> None:
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "errors.py", "gpus.py", "options.py", "pipeline.py", "trace.py"]


def test_no_context_variables_carry_state_between_layers() -> None:
    offenders = [str(p.relative_to(REPO)) for p in ROOT.rglob("*.py") if "ContextVar" in p.read_text()]
    assert offenders == []


def test_the_recorder_sets_only_its_own_state() -> None:
    """In simulate/record.py, outside ``__init__`` no object's attribute is assigned but ``self``'s own (the
    recorder's trace under construction among them): the recorder is complete when built, the trace when
    ``finish`` returns it."""
    tree = ast.parse((ROOT / "simulate" / "record.py").read_text())
    offenders = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name == "__init__":
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if not any(isinstance(n, ast.Attribute) for n in ast.walk(t)):
                    continue  # a local name, or an item of a local list
                root = t
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                first = t
                while isinstance(first, (ast.Attribute, ast.Subscript)) and not (
                        isinstance(first, ast.Attribute) and first.value is root):
                    first = first.value
                own = isinstance(root, ast.Name) and root.id == "self" and isinstance(first, ast.Attribute) \
                    and first.attr not in {"recorder", "vgpu", "model"}  # references to other objects
                if not own:
                    offenders.append(f"{fn.name}:{node.lineno} {ast.unparse(t)}")
    assert offenders == []


# Functions whose parameters mirror torch's own signatures (the virtual GPU's kernels).
MIRRORS = {
    ("estimator/simulate/virtual_gpu/attention.py", "sdpa"),  # F.scaled_dot_product_attention
    ("estimator/simulate/virtual_gpu/cudnn_rnn.py", "_cudnn_impl"),  # aten::_cudnn_rnn
    ("estimator/simulate/virtual_gpu/cudnn_rnn.py", "of"),  # aten::_cudnn_rnn's arguments
    ("estimator/simulate/virtual_gpu/engine.py", "run_backward"),  # torch.autograd.graph._engine_run_backward
}


def test_no_function_takes_more_than_six_parameters() -> None:
    """Besides ``self`` and keyword-only options with defaults (estimator/testing/ and torch's mirrors aside)."""
    long = []
    for path in [*ROOT.rglob("*.py"), *APP.rglob("*.py")]:
        rel = str(path.relative_to(REPO))
        if rel.startswith("estimator/testing/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in MIRRORS:
                a = node.args
                count = len([x for x in a.posonlyargs + a.args if x.arg not in ("self", "cls")])
                count += sum(d is None for d in a.kw_defaults) + (a.vararg is not None)
                if count > 6:
                    long.append(f"{rel}:{node.lineno} {node.name} ({count})")
    assert long == []


def test_no_code_compares_a_messages_text() -> None:
    """Warnings and notes are found by their code (and card), never by what they say."""
    found = []
    for path in [*ROOT.rglob("*.py"), *APP.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                                 and node.func.attr in ("endswith", "startswith")):
                text = ast.unparse(node)
                if ".message" in text:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {text}")
    assert found == []


@pytest.mark.parametrize("module", ["estimator.trace", "estimator.options", "estimator.replay.allocator",
                                    "estimator.replay.report", "estimator.replay.timeline",
                                    "estimator.replay.snapshot", "estimator.plan.strategy", "estimator.plan.answer",
                                    "estimator.plan.results", "estimator.portable.replayer",
                                    "estimator.request.spec", "estimator.request.adapt", "estimator.models.registry",
                                    "estimator.errors", "estimator"])
def test_the_core_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_service_process_loads_no_torch() -> None:
    """torch loads in the workers only: the API process (app.main with its Kubernetes routes) stays small."""
    code = "import sys, app.main, app.k8s.routes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_model_listing_survives_the_sources_package_being_imported() -> None:
    """``estimator.models.sources`` is a package; importing it binds that name on ``estimator.models``, which
    must not shadow what the listing calls (GET /models)."""
    code = ("import estimator.models.sources.timm, estimator.models as m; "
            "print(sorted(m.model_sources()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['timm', 'torchvision', 'transformers']"
