"""Test tiers: every test is exactly one of unit, sim, zoo, service, gpu (pyproject.toml registers them).

A module names its tier in ``TIER``; a test marked with a tier itself (a
``@pytest.mark.zoo`` sweep in a sim module) keeps its own. ``make test-fast``
runs ``-m "unit or sim"``.
"""

from __future__ import annotations

import pytest

TIERS = ("unit", "sim", "zoo", "service", "gpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        own = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one test tier ({', '.join(own)})")
        if own:
            continue
        tier = getattr(item.module, "TIER", None)
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: its module names no test tier (TIER = one of {TIERS})")
        item.add_marker(getattr(pytest.mark, tier))
