"""The same answers as recorded in tests/golden.json and tests/golden_details.json (tests/golden.py): a refactor
changes none of them."""

from __future__ import annotations

import json

import pytest
from golden import DETAILS, PATH, REQUESTS, answers

pytestmark = pytest.mark.zoo

RECORDED = json.loads(PATH.read_text())
RECORDED_DETAILS = json.loads(DETAILS.read_text())


def test_every_request_is_recorded() -> None:
    assert sorted(RECORDED) == sorted(REQUESTS) == sorted(RECORDED_DETAILS) and len(REQUESTS) == 20


@pytest.mark.parametrize("name", list(REQUESTS))
def test_same_answers_as_recorded(name: str) -> None:
    cards, details = answers(name)
    assert cards == RECORDED[name]
    assert details == RECORDED_DETAILS[name]
