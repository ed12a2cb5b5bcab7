"""A profile's strict schema (estimator/portable/schema.py and its request's): a hand-made profile passes, and each
tampering is refused naming the field, before anything reads it; the id is the canonical JSON's."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest

from estimator.errors import SpecError
from estimator.portable.profile import PortableProfile
from estimator.portable.schema import canonical_json, check_profile_doc, profile_id
from estimator.request.profile import check_profile, parse_profile_request

pytestmark = pytest.mark.unit


def trace() -> dict[str, Any]:
    # a 4 KiB parameter, an activation of 1 KiB + 2 KiB per sample, a temporary freed before it
    return {"schema": 3, "const": [4096, 1024, 512], "per_sample": [0, 2048, 256],
            "categories": ["parameter", "activation", "temporary"],
            "events": [[1, 0], [1, 1], [1, 2], [0, 2], [0, 1]],
            "phases": ["setup", "forward", "backward"], "modules": ["", "0", "1"], "min_batch": 1}


def profile() -> dict[str, Any]:
    return {"schema": "batchfit.profile", "version": 3,
            "versions": {"batchfit": "0.6.0", "torch": "2.14.1", "catalog": "2026-12-03"},
            "request": {"model": {"source": "custom", "factory": "mypkg:make", "kwargs": {}},
                        "input": {"image_size": [3, 32, 32]}, "planner": {"curve_points": 0}},
            "model": "custom:mypkg:make", "parameter_count": 1024, "start": 1, "flops": {"": [3000, 4000]},
            "sdpa_calls": [], "assumptions": ["a sentence may name https://example.com: people read it"],
            "capability_thresholds": [], "steps": {"": trace()}, "first_steps": {"": trace()}}


def test_a_hand_made_profile_passes_and_reads_back() -> None:
    doc = profile()
    read = check_profile(doc)
    assert isinstance(read, PortableProfile)
    assert read.steps[""].sizes_at(4, workspace=0) == [4096, 1024 + 4 * 2048, 512 + 4 * 256]
    assert PortableProfile.from_json(read.to_json()).to_json() == read.to_json()


def test_the_id_is_the_canonical_jsons_sha256() -> None:
    doc = profile()
    reordered = dict(reversed(list(doc.items())))
    assert profile_id(doc) == profile_id(reordered)
    assert canonical_json(doc) == canonical_json(reordered) and b" " not in canonical_json({"a": [1, 2]})
    changed = copy.deepcopy(doc)
    changed["steps"][""]["const"][0] += 1
    assert profile_id(changed) != profile_id(doc)
    assert profile_id(doc).startswith("sha256:") and len(profile_id(doc)) == len("sha256:") + 64


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set the value at a dotted path (``steps..const.0``: an empty key is the backend signature '')."""
    def tamper(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        at: Any = doc
        for part in parents:
            at = at[int(part)] if isinstance(at, list) else at[part]
        if isinstance(at, list):
            at[int(last)] = value
        else:
            at[last] = value
    return tamper


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.pop(name)


TAMPERED = [
    # (what, tamper, the field named, words of what was expected)
    ("a bool for an int", _set("steps..const.0", True), 'profile.steps[""].const[0]', "an integer"),
    ("a float", _set("parameter_count", 1024.0), "profile.parameter_count", "an integer"),
    ("NaN", _set("steps..per_sample.1", math.nan), 'profile.steps[""].per_sample[1]', "an integer"),
    ("infinity", _set("flops.", [math.inf, 1]), 'profile.flops[""][0]', "an integer"),
    ("a negative size", _set("first_steps..const.2", -1), 'profile.first_steps[""].const[2]', "from 0"),
    ("an integer of 40 digits", _set("steps..const.1", 10**40), 'profile.steps[""].const[1]', "from 0"),
    ("ten million allocations", _set("steps..const", [0] * 10**7), 'profile.steps[""].const', "at most"),
    ("lists of other lengths", _set("steps..per_sample", [0, 1]), 'profile.steps[""].per_sample', "exactly 3"),
    ("an event past the allocations", _set("steps..events.1", [1, 3]), 'profile.steps[""].events[1][1]', "to 2"),
    ("an event that is no pair", _set("steps..events.1", [1]), 'profile.steps[""].events[1]', "an event"),
    ("a second free", _set("steps..events.4", [0, 2]), 'profile.steps[""].events[4]', "allocated once"),
    ("more events than two per allocation", _set("steps..events", [[1, 0]] * 7), 'profile.steps[""].events',
     "at most 6"),
    ("an unknown category", _set("steps..categories.0", "weights"), 'profile.steps[""].categories[0]', "one of"),
    ("a URL as a module", _set("steps..modules.1", "https://example.com/x"), 'profile.steps[""].modules[1]',
     "not a path or URL"),
    ("a path as the model", _set("model", "/etc/passwd"), "profile.model", "not a path or URL"),
    ("a path as a version", _set("versions.torch", "~/torch"), 'profile.versions["torch"]', "not a path or URL"),
    ("a path in the factory", _set("request.model.factory", "../evil:make"), "profile.request.model.factory",
     "not a path or URL"),
    ("a bad request inside", _set("request.training", {"precision": "fp8"}), "profile.request.training.precision",
     "one of"),
    ("an unknown field", _set("extra", 1), "profile.extra", "no such field"),
    ("a missing field", _drop("flops"), "profile.flops", "required"),
    ("other signatures", _set("first_steps", {"x": trace()}), "profile.first_steps", "the signatures"),
    ("another version", _set("version", 2), "profile.version", "re-run `batchfit profile`"),
    ("a trace of another version", _set("steps..schema", 2), 'profile.steps[""].schema', "re-run"),
    ("not a profile", _set("schema", "other"), "profile.schema", "a batchfit profile"),
    ("a sentence too long", _set("assumptions", ["x" * 5000]), "profile.assumptions[0]", "at most"),
]


@pytest.mark.parametrize("what, tamper, field, expected", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_a_tampered_profile_is_refused_naming_the_field(what, tamper, field, expected) -> None:
    doc = profile()
    tamper(doc)
    with pytest.raises(SpecError) as info:
        check_profile(doc)
    assert info.value.field == field
    assert expected in info.value.expected


def test_the_cli_names_its_flag() -> None:
    doc = profile()
    doc["version"] = 4
    with pytest.raises(SpecError) as info:
        check_profile_doc(doc, "--profile")
    assert info.value.field == "--profile.version"


@pytest.mark.parametrize("body, field", [
    ({"profile": "sha256:" + "a" * 64, "model": {}}, "model"),
    ({"profile": "sha256:" + "a" * 64, "gpus": ["T4-16GB"], "planner": {"headroom": 2}}, "planner.headroom"),
    ({"profile": "sha256:" + "A" * 64}, "profile"),
    ({"profile": 5}, "profile"),
])
def test_a_request_by_profile_is_checked(body, field) -> None:
    with pytest.raises(SpecError) as info:
        parse_profile_request(body)
    assert info.value.field == field


def test_a_request_by_profile_keeps_only_the_planner_fields_it_sets() -> None:
    req = parse_profile_request({"profile": profile(), "gpus": ["T4-16GB"], "planner": {"headroom": 0.2}})
    assert req.options() == {"gpus": ["T4-16GB"], "batch_size": None, "planner": {"headroom": 0.2}}
