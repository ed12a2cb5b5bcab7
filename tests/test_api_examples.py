"""The API's examples (app/examples.py): every request example parses as the service would take it, every
response example is a valid answer to the request it names, /openapi.json carries them, the top-level fields
are described; and (sim_slow) the answers are still what the library answers.
"""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from app import examples
from app.main import create_app
from app.settings import Settings
from estimator import EstimateResponse, parse_request, to_json

pytestmark = pytest.mark.unit

ANSWERS = TypeAdapter(EstimateResponse)


@pytest.fixture(scope="module")
def schema():
    return create_app(Settings(workers=1, cache_path=""), start_workers=False).openapi()


@pytest.mark.parametrize("name", list(examples.REQUESTS))
def test_each_request_example_parses(name) -> None:
    request = parse_request(examples.REQUESTS[name]["value"], allow_local_code=False)  # as over HTTP
    assert request.gpus


def test_the_examples_cover_each_kind_of_job() -> None:
    jobs = {name: parse_request(e["value"]) for name, e in examples.REQUESTS.items()}
    assert jobs["preset"].model.preset == "llama-3-8b" and jobs["preset"].input.seq_len == 2048
    assert jobs["inline-config"].model.preset is None and jobs["inline-config"].model.config["model_type"] == "llama"
    d = jobs["fsdp-8"].training.distributed
    assert (d.strategy, d.world_size) == ("fsdp", 8)
    assert any(not isinstance(g, str) for g in jobs["custom-card"].gpus or [])


@pytest.mark.parametrize("name", list(examples.RESPONSES))
def test_each_response_example_is_a_whole_answer_to_its_request(name) -> None:
    value = examples.RESPONSES[name]["value"]
    answer = ANSWERS.validate_python(value)
    assert to_json(answer) == value  # every field there, each of its type: nothing left out by the trimming
    request = parse_request(examples.ANSWERED[name])
    assert [r.gpu for r in answer.results] == request.gpus
    first = answer.results[0]
    assert answer.breakdown.batch_size == first.memory.batch_size
    parts = sum(v for k, v in ANSWERS.dump_python(answer)["breakdown"].items() if k != "batch_size")
    assert parts == first.memory.allocated_peak_bytes  # the breakdown adds up to the peak it breaks down


@pytest.mark.parametrize("route", ["/estimate", "/timeline", "/snapshot"])
def test_openapi_carries_the_request_examples(schema, route) -> None:
    body = schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]
    assert body["examples"] == examples.REQUESTS


def test_openapi_carries_the_response_examples(schema) -> None:
    ok = schema["paths"]["/estimate"]["post"]["responses"]["200"]["content"]["application/json"]
    assert ok["examples"] == examples.RESPONSES
    assert ok["schema"] == {"$ref": "#/components/schemas/EstimateResponse"}


@pytest.mark.parametrize("model, fields", [
    ("EstimateRequest", ["model", "input", "training", "gpus", "batch_size", "planner", "validate"]),
    ("EstimateResponse", ["results", "breakdown", "per_sample_bytes", "fixed_bytes", "parameter_count",
                          "flops_per_sample", "assumptions", "warnings"]),
    ("GPUResult", ["meets_epoch_limit", "accumulation"]),
])
def test_the_top_level_fields_are_described(schema, model, fields) -> None:
    properties = schema["components"]["schemas"][model]["properties"]
    assert set(fields) <= set(properties)
    missing = [f for f in fields if len(properties[f].get("description", "")) < 20]
    assert not missing, f"{model}: {missing} without a description"


@pytest.mark.sim_slow
@pytest.mark.parametrize("name", list(examples.RESPONSES))
def test_each_response_example_is_what_the_library_answers(name) -> None:
    """The numbers of the examples, simulated again (about 20 s each): an estimator whose answers change must
    change its examples too (run the request through ``estimate`` and trim as app/examples.py says)."""
    from estimator import estimate

    fresh = to_json(estimate(parse_request(examples.ANSWERED[name])))
    shown = examples.RESPONSES[name]["value"]
    for got, want in zip(fresh["results"], shown["results"], strict=True):
        curve = got.pop("curve")
        assert want["curve"] == (curve[:2] + curve[-1:] if len(curve) > 3 else curve)
        assert got == {k: v for k, v in want.items() if k != "curve"}
    assert fresh["assumptions"][:len(shown["assumptions"])] == shown["assumptions"]
    keep = ("breakdown", "per_sample_bytes", "fixed_bytes", "parameter_count", "flops_per_sample", "warnings")
    assert {k: fresh[k] for k in keep} == {k: shown[k] for k in keep}
    assert {k: v for k, v in fresh["provenance"].items() if k != "seconds"} == {
        k: v for k, v in shown["provenance"].items() if k != "seconds"}
