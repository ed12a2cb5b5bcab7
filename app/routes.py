"""The routes: POST /estimate, GET /gpus, /models, /healthz, /readyz, /metrics."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response

from app.cache import cache_key
from app.errors import problem, problem_responses, spec_problem
from app.pool import Busy, LimitExceeded
from estimator.errors import SpecError
from estimator.gpus import CATALOG, CATALOG_VERSION
from estimator.spec import EstimateRequest, EstimateResponse, parse_request

router = APIRouter()

EXAMPLE = {
    "model": {"source": "torchvision", "name": "resnet50", "kwargs": {"num_classes": 10}},
    "input": {"image_size": [3, 224, 224]},
    "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw", "foreach": None, "fused": None},
                 "gradient_checkpointing": False, "grad_accumulation_steps": 1},
    "gpus": ["A100-80GB", "H100-80GB"],
    "batch_size": None,
}
ERRORS = problem_responses(401, 422, 503)


@router.post("/estimate", response_model=EstimateResponse, responses=ERRORS,
             summary="Max batch and memory per GPU for a training job")
async def post_estimate(
    request: Request,
    body: Annotated[EstimateRequest, Body(openapi_examples={"resnet50": {"summary": "ResNet-50 on two cards",
                                                                          "value": EXAMPLE}})],
) -> Any:
    app = request.app
    try:
        normalized = parse_request(body.model_dump(mode="json"), allow_local_code=False)
    except SpecError as exc:
        return spec_problem(exc)
    data = normalized.model_dump(mode="json")
    if normalized.validate_step:
        return await _validate(app, data)
    key = cache_key(data)
    hit = app.state.cache.get(key) if app.state.cache else None
    if hit is not None:
        app.state.metrics.cache_hits.inc()
        return JSONResponse(hit, headers={"X-Batchfit-Cache": "hit"})

    async def compute():
        app.state.metrics.cache_misses.inc()
        return await _in_pool(app, data)

    try:
        kind, payload = await app.state.flights.run(key, compute)
    except Refused as refused:
        return refused.response()
    if kind == "ok":
        if app.state.cache:
            app.state.cache.set(key, payload)
        return JSONResponse(payload, headers={"X-Batchfit-Cache": "miss"})
    return _reply_problem(kind, payload)


async def _validate(app, data: dict) -> Any:
    """One validation at a time on this node's GPU; never cached (it is a measurement)."""
    async with app.state.gpu_lock:
        try:
            kind, payload = await _in_pool(app, data)
        except Refused as refused:
            return refused.response()
    if kind == "ok":
        return JSONResponse(payload)
    return _reply_problem(kind, payload)


class Refused(Exception):
    """The pool would not or could not finish the job; ``response()`` says why, a new one per caller
    (identical concurrent requests share the exception)."""

    def __init__(self, *problem_args: Any, **problem_kwargs: Any) -> None:
        self.args_, self.kwargs_ = problem_args, problem_kwargs

    def response(self) -> JSONResponse:
        return problem(*self.args_, **self.kwargs_)


async def _in_pool(app, data: dict) -> tuple[str, Any]:
    """Run ``data`` in a worker, with the metrics; ``Refused`` when busy or past a limit."""
    metrics, t0 = app.state.metrics, time.perf_counter()
    metrics.workers_busy.inc()
    try:
        return await app.state.pool.run(data)
    except Busy:
        s = app.state.settings
        raise Refused(503, "busy", "Every worker is busy", f"{s.workers} workers busy and {s.queue_size} "
                      "requests waiting; retry later", headers={"Retry-After": str(s.retry_after_s)})
    except LimitExceeded as exc:
        metrics.worker_restarts.inc()
        raise Refused(422, f"{exc.limit}-limit", "The estimate ran past a limit of the service", str(exc))
    finally:
        metrics.workers_busy.dec()
        metrics.estimate.observe(time.perf_counter() - t0)


def _reply_problem(kind: str, payload: Any) -> JSONResponse:
    if kind == "nogpu":
        return problem(503, "no-gpu", "No CUDA GPU on this node", payload)
    if kind == "spec":
        field, value, expected = payload
        return spec_problem(SpecError(field, value, expected))
    if kind == "simulation":
        message, where = payload
        return problem(422, "simulation", "The model could not be simulated", message, where=where)
    if kind == "memory":
        return problem(422, "memory-limit", "The estimate ran past a limit of the service", payload)
    return problem(500, "internal", "batchfit failed", payload)


@router.get("/gpus", summary="The GPU catalog", responses=problem_responses(401))
def get_gpus() -> dict:
    return {"catalog": CATALOG_VERSION, "gpus": [
        {"name": g.name, "memory_bytes": g.memory_bytes, "compute_capability": g.compute_capability,
         "context_bytes": g.context_bytes, "peak_tflops_bf16": g.peak_tflops_bf16,
         "peak_tflops_fp32": g.peak_tflops_fp32, "description": g.description} for g in CATALOG.values()]}


@lru_cache(maxsize=1)
def _models() -> dict:
    import timm
    import torchvision.models as tvm

    from estimator.models.transformers_models import _AUTO, presets

    return {
        "torchvision": {f: tvm.list_models(module=m) for f, m in (
            ("classification", tvm), ("segmentation", tvm.segmentation), ("video", tvm.video),
            ("detection", tvm.detection))},
        "timm": {"names": timm.list_models()},
        "transformers": {"presets": sorted(presets()), "tasks": list(_AUTO), "attn_implementation": ["eager", "sdpa"]},
    }


@router.get("/models", summary="What each model source offers", responses=problem_responses(401))
def get_models() -> dict:
    return _models()


@router.get("/healthz", summary="Liveness")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Workers and cache ready", responses={503: {"description": "not ready"}})
def readyz(request: Request) -> Any:
    app = request.app
    pool_ok = app.state.pool is not None and app.state.pool.ready
    cache_ok = app.state.cache is None or app.state.cache.ping()
    body = {"workers": pool_ok, "cache": cache_ok}
    return JSONResponse(body, status_code=200 if pool_ok and cache_ok else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                       **problem_responses(401)})
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")
