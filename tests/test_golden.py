"""The same answers as recorded in tests/golden.json (tests/golden.py): a refactor changes none of them."""

from __future__ import annotations

import json

import pytest
from golden import PATH, REQUESTS, answers

TIER = "zoo"

RECORDED = json.loads(PATH.read_text())


def test_every_request_is_recorded() -> None:
    assert sorted(RECORDED) == sorted(REQUESTS) and len(REQUESTS) == 20


@pytest.mark.parametrize("name", list(REQUESTS))
def test_same_answers_as_recorded(name: str) -> None:
    assert answers(name) == RECORDED[name]
