"""Test tiers: every test is exactly one of unit, sim, sim_slow, zoo, service, gpu (pyproject.toml registers
them). A module names its tier with pytest's own ``pytestmark = pytest.mark.<tier>``; a test that marks a tier
of its own (a zoo sweep in a sim module) is in that tier only; a test with two tiers of its own is a usage
error. ``make test-fast`` runs ``-m "unit or sim"``.

Shared fixtures: the cards most tests use (tests/support.py has them as constants too).
"""

from __future__ import annotations

import pytest
import support

TIERS = ("unit", "sim", "sim_slow", "zoo", "service", "gpu")


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules: dict[pytest.Module, list[pytest.Item]] = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is not None:
            modules.setdefault(module, []).append(item)
    for module, members in modules.items():
        tier = [m for m in module.own_markers if m.name in TIERS]  # the module's pytestmark
        module.own_markers = [m for m in module.own_markers if m.name not in TIERS]
        for item in members:
            if tier and not any(m.name in TIERS for m in item.own_markers):
                item.add_marker(tier[0].name)  # the module's tier, where the test names none of its own
    for item in items:
        own = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(own) != 1:
            raise pytest.UsageError(f"{item.nodeid}: {'no test tier' if not own else 'more than one test tier'} "
                                    f"({', '.join(sorted(own)) or 'pytestmark = pytest.mark.<tier>'}; one of {TIERS})")


@pytest.fixture
def a100_80():
    return support.A100_80


@pytest.fixture
def a100_40():
    return support.A100_40


@pytest.fixture
def t4():
    return support.T4
