"""The model sources: one registration per module of ``estimator/models/sources/``, duplicates refused.

>>> sorted(sources())
['custom', 'timm', 'torchvision', 'transformers']
>>> sources()["timm"].libraries
('timm',)

A source is what a request's ``model.source`` names: its request section
(a pydantic model, the branch of ``model`` in the schema), the builder that
turns that section and ``input`` into a ``BuiltModel``, the torch-free name
checks a request must pass before a worker sees it, its ``GET /models``
listing and the libraries whose versions key the service's cache. A new
source is one new module in ``sources/`` that calls ``register`` (as
``torch.utils.flop_counter``'s ``register_flop_formula`` does, a second
registration of a name is refused). The source modules import nothing heavy
at import time: the request schema reads them in the service's API process,
which loads no torch.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field


@dataclass(frozen=True)
class ModelSource:
    """One model source. ``build(section, input)`` returns a ``BuiltModel``; ``check_names(section)`` raises
    ``SpecError`` at a name or free-form value a request may not send; ``local_code``: the source runs code
    from this machine, so only the library and the CLI may use it."""

    name: str
    spec: type[BaseModel]
    build: Callable[[Any, Any], Any]
    check_names: Callable[[Any], None]
    listing: Callable[[], dict[str, Any]]
    libraries: tuple[str, ...] = ()
    local_code: bool = False


_SOURCES: dict[str, ModelSource] = {}


def register(source: ModelSource) -> ModelSource:
    """Register a model source; a name registered twice is a defect."""
    if source.name in _SOURCES:
        raise ValueError(f"model source {source.name!r} is already registered")
    _SOURCES[source.name] = source
    return source


@cache
def _load() -> None:
    package = import_module("estimator.models.sources")
    for info in pkgutil.iter_modules(package.__path__):
        import_module(f"{package.__name__}.{info.name}")


def sources() -> dict[str, ModelSource]:
    """Every registered source, by name (the modules of ``sources/`` are imported on the first call)."""
    _load()
    return dict(sorted(_SOURCES.items()))


def source_of(section: Any) -> ModelSource:
    """The source of a request's ``model`` section."""
    return sources()[section.source]


def model_spec_type() -> Any:
    """The request's ``model`` field: the sources' sections as one union, told apart by ``source``."""
    specs = tuple(s.spec for s in sources().values())
    return Annotated[Union[specs], Field(discriminator="source")]  # noqa: UP007  a union built from a tuple


def warm() -> list[str]:
    """Import every installed library the sources build with (a service worker does, before its first request:
    peft alone takes ~2.5 s to import, which a cold estimate with LoRA suggestions paid, twice when a forked
    child built the first LoRA step); the names imported. A library not installed is skipped: its source
    refuses its requests as before."""
    done = []
    for source in sources().values():
        for name in source.libraries:
            try:
                import_module(name)
            except ImportError:
                continue
            done.append(name)
    return done
