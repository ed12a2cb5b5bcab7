"""Packaging: the dependencies and extras, what the library imports, how the service starts, and the
Dockerfile, .dockerignore and docker-compose.yml (checked statically: no Docker engine on this machine).

A library user gets no web stack: the core dependencies are the library's own, and the service, the plot
and GPU validation each come with an extra (pyproject.toml). The import checks run in fresh interpreters;
"not installed" is simulated there by ``sys.modules[name] = None``, which makes ``import name`` raise
ModuleNotFoundError as a missing package does.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# distributions that belong to an extra and must stay out of the core (directly and transitively)
EXTRA_ONLY = {"fastapi", "starlette", "uvicorn", "pydantic-settings", "redis", "prometheus-client", "matplotlib",
              "nvidia-ml-py", "pynvml", "fastapi-offline", "lightning", "pytorch-lightning", "accelerate", "keras",
              "peft", "bitsandbytes"}
# their modules, as the library must not import them
EXTRA_MODULES = ("fastapi", "starlette", "uvicorn", "pydantic_settings", "redis", "prometheus_client", "matplotlib",
                 "pynvml", "fastapi_offline", "lightning", "accelerate", "keras", "peft", "bitsandbytes")


# --- pyproject.toml -------------------------------------------------------------------------------------------

def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in PROJECT["optional-dependencies"][name]]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements pull in (environment markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
            elif req.extras and any(sub.marker.evaluate({"extra": e}) for e in req.extras):
                todo.append(sub)
    return seen


def test_core_dependencies_leave_out_the_service_plot_and_gpu() -> None:
    core = _names(PROJECT["dependencies"])
    for name in ("torch", "torchvision", "transformers", "timm", "pydantic", "fvcore"):
        assert name in core
    assert "torch==2.14.1" in PROJECT["dependencies"] and "fvcore==0.1.5.post20221221" in PROJECT["dependencies"]
    assert not core & (EXTRA_ONLY | {"httpx"}), core & (EXTRA_ONLY | {"httpx"})
    # nor through what the core pulls in (read from the installed packages' metadata)
    core_requirements = [Requirement(r) for r in PROJECT["dependencies"]]
    for req in core_requirements:
        distribution(req.name)  # the core is installed here, or the closure below proves nothing
    pulled = _closure(core_requirements)
    assert not pulled & EXTRA_ONLY, pulled & EXTRA_ONLY


def test_each_extra_holds_what_its_part_imports() -> None:
    extras = PROJECT["optional-dependencies"]
    assert {"service", "plot", "gpu", "integrations", "test"} <= set(extras)
    assert _names(extras["service"]) >= {"fastapi", "uvicorn", "pydantic-settings", "redis", "prometheus-client",
                                          "httpx", "fastapi-offline"}
    assert _names(extras["plot"]) >= {"matplotlib"}
    assert _names(extras["gpu"]) >= {"nvidia-ml-py"}
    assert _names(extras["integrations"]) >= {"lightning", "accelerate", "keras"}
    assert _names(extras["peft"]) >= {"peft", "bitsandbytes"}
    # the tests cover the service, the plot and validation: the test extra brings every other extra
    test = _extra("test")
    selves = [r for r in test if canonicalize_name(r.name) == "batchfit"]
    brought = set().union(*(r.extras for r in selves)) if selves else set()
    for name in ("service", "plot", "gpu", "integrations"):
        assert name in brought or _names(extras[name]) <= _names(extras["test"]), name
    assert _names(extras["test"]) >= {"pytest", "hypothesis", "httpx", "schemathesis", "pyyaml"}
    # and `make test` installs the test extra, which brings the tools it runs (make lint, make typecheck)
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[test]'" in makefile
    for tool in ("ruff", "mypy"):
        assert tool not in makefile or tool in _names(extras["test"]), tool
    assert PROJECT["scripts"]["batchfit"] == "estimator.cli.main:main"


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The top-level module names ``path`` imports (absolute imports only), at module level or anywhere."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = ast.walk(tree) if not top_level_only else _module_level(tree.body)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found


def _module_level(body: list[ast.stmt]):
    """Statements run at import: the module's body and the bodies of its top-level if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


@functools.lru_cache(maxsize=1)
def _provided() -> Mapping[str, list[str]]:
    """importlib.metadata's module -> distributions map (it reads every installed package: once)."""
    return packages_distributions()


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    """module -> the installed distributions that provide it (stdlib and our own packages have none)."""
    provided = _provided()
    return {m: {canonicalize_name(d) for d in provided.get(m, [])} for m in modules
            if m not in ("estimator", "app") and provided.get(m)}


def test_the_service_imports_only_what_core_and_service_install() -> None:
    declared = _closure([Requirement(r) for r in PROJECT["dependencies"]] + _extra("service"))
    modules = set().union(*(_imports(p, top_level_only=False) for p in (ROOT / "app").glob("*.py")))
    assert {"fastapi", "pydantic_settings", "prometheus_client", "httpx", "redis"} <= modules  # the scan sees them
    for module, dists in _distributions(modules).items():
        assert dists & declared, f"app/ imports {module} ({', '.join(sorted(dists))}): not in core or service"



def test_the_image_installs_what_a_request_can_ask_of_the_service() -> None:
    # model.peft and model.quantization come over HTTP too: the image answers them (the peft extra)
    installed = re.search(r"pip install '\.\[([a-z,]+)\]'", (ROOT / "Dockerfile").read_text())
    assert installed, "the Dockerfile installs the project with its extras"
    assert {"service", "gpu", "peft"} <= set(installed.group(1).split(","))

# the drop-ins are their frameworks' (a Lightning callback subclasses Lightning's): importing one asks for its
# library, which names the extra when missing (test_an_integration_without_its_library_names_the_extra)
FRAMEWORK_MODULES = {f"estimator/integrations/{name}.py"
                     for name in ("lightning", "transformers", "accelerate", "keras")}


def test_no_library_module_imports_an_extra_at_module_level() -> None:
    offenders = {}
    for path in sorted((ROOT / "estimator").rglob("*.py")):
        if str(path.relative_to(ROOT)) in FRAMEWORK_MODULES:
            continue
        for module, dists in _distributions(_imports(path, top_level_only=True)).items():
            if dists & EXTRA_ONLY:
                offenders[str(path.relative_to(ROOT))] = module
    assert not offenders, f"import these lazily, with the extra named when missing: {offenders}"


# --- what importing and estimating load, in a fresh interpreter --------------------------------------------

def _python(code: str, blocked: tuple[str, ...] = (), env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root, with ``blocked`` packages not importable."""
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_library_loads_no_service_plot_or_gpu_package() -> None:
    out = _json(_python(f"""
import json
names = {EXTRA_MODULES!r}
import estimator, estimator.cli, estimator.cli.plot, estimator.measure.cuda
before_torch = [n for n in names if n in sys.modules]
torch_loaded = "torch" in sys.modules
import estimator.pipeline
after = [n for n in names if n in sys.modules]
print(json.dumps({{"before_torch": before_torch, "torch_loaded": torch_loaded, "after": after,
                   "pipeline_loaded_torch": "torch" in sys.modules}}))
"""))
    assert out["before_torch"] == [] and not out["torch_loaded"]
    assert out["pipeline_loaded_torch"]  # the second check did import the estimate path
    # torch.cuda itself imports pynvml when it is installed (an optional import of torch's); that the
    # library runs without it is checked by the next test
    assert [n for n in out["after"] if n != "pynvml"] == []


@pytest.mark.sim  # one small simulation
def test_the_library_estimates_without_any_extra_installed() -> None:
    out = _json(_python("""
import json
import torch
import torch.nn.functional as F
from estimator import estimate_memory
from estimator.cli.main import main
from estimator.errors import MissingExtraError
from estimator.cli.plot import draw_timeline
from estimator.measure.cuda import local_card

report = estimate_memory(lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                         lambda b, dev: (torch.empty(b, 8, device=dev), torch.zeros(b, dtype=torch.long, device=dev)),
                         F.cross_entropy, 4, gpu="A100-80GB")
errors = {}
for name, call in (("plot", lambda: draw_timeline(None, "unused.png")), ("gpu", local_card)):
    try:
        call()
    except MissingExtraError as exc:
        errors[name] = {"extra": exc.extra, "cause": exc.cause, "message": str(exc)}
print(json.dumps({"peak": report.device_peak_bytes, "gpus": main(["gpus"]), "errors": errors}))
""", blocked=EXTRA_MODULES))
    assert out["peak"] > 0 and out["gpus"] == 0
    plot, gpu = out["errors"]["plot"], out["errors"]["gpu"]
    assert plot["extra"] == "plot" and "matplotlib" in plot["cause"]
    assert "pip install 'batchfit[plot]'" in plot["message"]
    assert gpu["extra"] == "gpu" and "pynvml" in gpu["cause"] and "pip install 'batchfit[gpu]'" in gpu["message"]


@pytest.mark.parametrize(("module", "library"), [("lightning", "lightning"), ("transformers", "accelerate"),
                                                 ("accelerate", "accelerate"), ("keras", "keras")])
def test_an_integration_without_its_library_names_the_extra(module: str, library: str) -> None:
    out = _json(_python(f"""
import json
from estimator.errors import MissingExtraError
try:
    import estimator.integrations.{module}
except MissingExtraError as exc:
    print(json.dumps({{"extra": exc.extra, "cause": exc.cause, "message": str(exc)}}))
""", blocked=(library,), env={"KERAS_BACKEND": "torch"}))
    assert out["extra"] == "integrations" and library in out["cause"]
    assert "pip install 'batchfit[integrations]'" in out["message"]


def test_serve_without_the_service_extra_says_which_extra() -> None:
    for missing in ("uvicorn", "fastapi", "pydantic_settings", "prometheus_client", "fastapi_offline"):
        proc = _python("from estimator.cli.main import main\nsys.exit(main(['serve']))", blocked=(missing,))
        assert proc.returncode == 3, (missing, proc.stderr[-2000:])
        assert "error: batchfit serve needs the service extra: pip install 'batchfit[service]'" in proc.stderr
        assert missing in proc.stderr and "Traceback" not in proc.stderr
    # a module of our own that fails to import is a defect, not a missing extra
    proc = _python("from estimator.cli.main import main\nsys.exit(main(['serve']))", blocked=("app.routes",))
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr and "batchfit[service]" not in proc.stderr


# --- how the service starts -----------------------------------------------------------------------------------

def test_importing_app_main_builds_no_app() -> None:
    # values that get_settings() rejects: an app built at import would fail the import itself
    env = {"BATCHFIT_WORKERS": "not-a-number", "BATCHFIT_QUEUE_SIZE": "-5"}
    out = _json(_python("""
import json
from fastapi import FastAPI
from pydantic import ValidationError
import app.main
apps = [name for name, value in vars(app.main).items() if isinstance(value, FastAPI)]
try:
    app.main.create_app()
    rejected = ""
except ValidationError as exc:
    rejected = str(exc)
print(json.dumps({"has_app": hasattr(app.main, "app"), "apps": apps, "rejected": rejected}))
""", env=env))
    assert not out["has_app"] and out["apps"] == []
    assert "workers" in out["rejected"] and "queue_size" in out["rejected"]  # the environment was read, and refused


def test_every_launcher_uses_the_factory() -> None:
    old = re.compile(r"app\.main:app\b")
    here = Path(__file__).resolve()
    files = [ROOT / n for n in ("README.md", "Dockerfile", "docker-compose.yml", "Makefile", ".ci/run")]
    for folder in ("app", "estimator", "bench", "tests"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".txt", ".yml")]
    stale = [str(p.relative_to(ROOT)) for p in files if p.resolve() != here and p.is_file()
             and old.search(p.read_text(errors="replace"))]
    assert not stale, f"still start the service as app.main:app: {stale}"
    cli = (ROOT / "estimator" / "cli" / "serve.py").read_text()
    assert 'uvicorn.run("app.main:create_app", factory=True' in cli
    readme = (ROOT / "README.md").read_text()
    assert "uvicorn --factory app.main:create_app" in readme and "pip install 'batchfit[service]'" in readme


# --- Dockerfile, .dockerignore, docker-compose.yml ------------------------------------------------------------

def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, out = "", []
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        joined += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = joined.partition(" ")
            out.append((word.upper(), rest.strip()))
            joined = ""
    return out


def test_dockerfile_runs_as_non_root_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert any(line.startswith("HEALTHCHECK") for line in lines) and "/healthz" in text
    assert any(line.startswith("CMD") and "serve" in line for line in lines)
    # everything the package needs is copied before it is installed
    copied = " ".join(line for line in lines if line.startswith("COPY"))
    for path in ("pyproject.toml", "estimator", "app"):
        assert path in copied


def test_dockerfile_installs_into_a_venv_dependencies_before_the_source() -> None:
    every = _instructions()
    assert every[0] == ("ARG", "BASE=python:3.11-slim-bookworm")
    final = max(i for i, (k, _) in enumerate(every) if k == "FROM")
    assert every[final] == ("FROM", "${BASE}")
    steps = every[final:]  # the image's own stage
    kinds = [k for k, _ in steps]
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env and "BATCHFIT_CACHE_PATH=" in env
    venv = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "python3 -m venv /opt/venv" in a)
    pips = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "pip install" in a]
    assert pips and min(pips) > venv  # no pip into the system python (PEP 668 refuses it on Debian)

    def copy_of(name: str) -> int:
        return next(i for i, (k, a) in enumerate(steps) if k == "COPY" and name in a.split()[:-1])

    project, source = copy_of("pyproject.toml"), min(copy_of("estimator"), copy_of("app"))
    assert project < source
    deps = [i for i in pips if project < i < source]
    assert deps, "the dependencies are installed in a layer before the source is copied"
    assert "[service" in steps[deps[0]][1] and "gpu" in steps[deps[0]][1]  # batchfit-gpu runs this image too
    final = [i for i in pips if i > source]
    assert final and "--no-deps" in steps[final[-1]][1]  # a code change downloads nothing again
    user = kinds.index("USER")
    assert user > max(pips) and "root" not in steps[user][1]
    assert ("EXPOSE", "8000") in steps
    check = next(a for k, a in steps if k == "HEALTHCHECK")
    assert re.search(r"\bCMD \[?\"?/opt/venv/bin/python\b", check), check  # a plain Debian base has no `python`
    assert "/healthz" in check


def test_the_image_builds_the_c_replay_in_a_stage_of_its_own() -> None:
    """The allocator replay in C: compiled where a compiler is (not in the image), placed next to the installed
    estimator/replay/native.py, and loaded there before the image is done (a build without it fails)."""
    steps = _instructions()
    froms = [i for i, (k, _) in enumerate(steps) if k == "FROM"]
    assert len(froms) == 2 and steps[froms[0]][1] == "${BASE} AS native"
    stage = steps[froms[0]:froms[1]]
    assert any(k == "RUN" and "gcc" in a and "_allocator.c" in a and "-shared" in a for k, a in stage)
    assert ("COPY", "estimator/replay/_allocator.c /src/_allocator.c") in stage
    image = steps[froms[1]:]
    copied = next(i for i, (k, a) in enumerate(image) if k == "COPY" and a.startswith("--from=native "))
    placed = next(a for k, a in image[copied:] if k == "RUN" and "_allocator.so" in a)
    assert "estimator/replay/" in placed and "native.available()" in placed
    assert not any(k == "RUN" and "gcc" in a for k, a in image)  # no compiler in the image


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context (last matching pattern wins; a pattern that
    matches a folder matches what is in it)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            excluded = not keep
    return excluded


def test_dockerignore_keeps_out_what_the_image_does_not_need() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for path in (".git/HEAD", ".venv/bin/python", "tests/test_service.py", "bench/load.py",
                 "estimator/cli/__pycache__/main.cpython-311.pyc", ".batchfit-cache.sqlite", "step.png",
                 ".hypothesis/examples/x", "batchfit.egg-info/PKG-INFO",
                 "estimator/replay/_allocator.cpython-311-x86_64-linux-gnu.so"):
        assert _dockerignored(path, patterns), path
    needed = ["pyproject.toml", "README.md", "estimator/cli/main.py",
              "estimator/models/sources/transformers/presets/bert-base-uncased.json",
              "app/main.py"]
    needed += [a.split()[0] for k, a in _instructions() if k == "COPY" and not a.startswith("--from=")]
    for path in needed:
        assert not _dockerignored(path, patterns), path


def test_compose_builds_the_image_once() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert [name for name, s in services.items() if "build" in s] == ["batchfit"]
    assert services["batchfit"]["image"] == services["batchfit-gpu"]["image"] == "batchfit:latest"
    # the GPU service runs the image the batchfit service built; it never pulls one of that name
    assert services["batchfit-gpu"].get("pull_policy") == "never"
    assert services["batchfit-gpu"]["restart"] == "unless-stopped"
    assert services["batchfit"]["restart"] == "unless-stopped"


def test_compose_service_redis_and_gpu_profile() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert services["batchfit"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["batchfit"]["environment"]["BATCHFIT_REDIS_URL"].startswith("redis://redis:")
    assert "healthcheck" in services["redis"]
    gpu = services["batchfit-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
