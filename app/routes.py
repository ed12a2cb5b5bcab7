"""The routes: POST /estimate (by a model or a profile), /timeline, /snapshot, GET /gpus, /models, /healthz,
/readyz, /metrics (app/profiles.py: /profiles)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from app import logs
from app.cache import cache_key
from app.errors import HTTP_PROBLEMS, error_problem, problem, problem_responses
from app.pool import Heard
from app.profiles import checked_profile
from app.shape import MAX_ITEMS, check_shape
from app.stream import estimate_events, wants_events
from app.worker import JobKind, ProfileJob, Reply, ReplyKind
from estimator import (
    EstimateBody,
    EstimateRequest,
    EstimateResponse,
    ProfileEstimateRequest,
    Timeline,
    catalog,
    check_request,
    profile_id,
)
from estimator.errors import BatchfitError, Busy, LimitExceeded, SpecError, WorkerDied


class ShapeCheckedRoute(APIRoute):
    """A route whose body's shape (nesting, separators, number lengths: app/shape.py) is checked on the raw
    bytes before FastAPI parses it; a refused shape is a 422 naming ``(body)``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method == "POST":
                body = await request.body()  # kept on the request: FastAPI parses these same bytes
                # An inline profile is arrays of thousands of numbers (resnet50's: 40,000 items): a body that
                # may hold one is bounded by its size (under BATCHFIT_MAX_BODY_BYTES) and the profile's schema.
                items = len(body) // 2 + 1 if b'"profile"' in body else MAX_ITEMS
                if len(body) > 2**16:  # the GIL is handed back to the event loop every few ms meanwhile
                    await asyncio.to_thread(check_shape, body, max(items, MAX_ITEMS))
                else:
                    check_shape(body, max(items, MAX_ITEMS))
            return await handler(request)

        return checked


router = APIRouter(route_class=ShapeCheckedRoute)
T = TypeVar("T")

ERRORS = problem_responses(400, 401, 413, 415, 422, 503)
SNAPSHOT: dict[int | str, dict[str, Any]] = {200: {"content": {"application/octet-stream": {}},
                  "description": "the pickle of a torch.cuda.memory._snapshot() dict (open it at "
                                 "https://pytorch.org/memory_viz), as an attachment named step.pickle"}}


@router.post("/estimate", response_model=EstimateResponse, responses={**ERRORS, **problem_responses(404)},
             summary="Max batch and memory per GPU for a training job (its model, or its stored profile)")
async def post_estimate(request: Request, body: EstimateBody) -> Any:
    # FastAPI parsed the body against the schema, once; check_request adds the rules it cannot express
    # (no local code over HTTP, a transformers model names a preset or a config). BatchfitErrors raised
    # here are rendered by app.errors.on_batchfit_error. The worker gets the parsed request itself.
    if isinstance(body, ProfileEstimateRequest):
        return await _by_profile(request, body)
    check_request(body, allow_local_code=False)
    if body.validate_step:
        return await _validate(request, body)
    return await _estimated(request, body)


async def _by_profile(request: Request, body: ProfileEstimateRequest) -> Any:
    """An estimate from a stored profile (by id: 404 when the store has none) or an inline one (checked here:
    a bad one is a 422, as when it is stored); never built, never simulated."""
    return await _estimated(request, await profile_job_of(request.app, body))


async def _estimated(request: Request, job: EstimateRequest | ProfileJob) -> Any:
    """``job``'s estimate from a worker: streamed with Accept: text/event-stream (progress, then the answer:
    app/stream.py), else the answer with its X-Batchfit-Cache header."""
    if wants_events(request):
        return await estimate_events(request, job)
    answered = await _pooled(request, job, JobKind.ESTIMATE)
    if isinstance(answered, Response):
        return answered
    payload, cache = answered
    return JSONResponse(payload, headers={"X-Batchfit-Cache": cache})


async def profile_job_of(app: Any, body: ProfileEstimateRequest) -> ProfileJob:
    """The worker's job for ``body``: the profile fetched from the store or checked inline, and the options."""
    if isinstance(body.profile, str):
        doc = await app.state.profiles.get(body.profile)
        key = body.profile
    else:
        doc = await checked_profile(body.profile)
        key = await asyncio.to_thread(profile_id, doc)
    return ProfileJob(key, doc, body.options())


def job_key(body: EstimateRequest | ProfileJob, kind: JobKind) -> str:
    """The cache key of what ``kind`` answers to a job: a request's, or a profile's by its id and options."""
    if isinstance(body, ProfileJob):
        return cache_key({"by-profile": body.key_doc()}, kind)
    return cache_key(body.model_dump(mode="json"), kind)


@router.post("/timeline", response_model=Timeline, responses=ERRORS,
             summary="The memory timeline of the first card's step (at batch_size, else the recommended batch)")
async def post_timeline(request: Request, body: EstimateRequest) -> Any:
    _check_view(body)
    answered = await _pooled(request, body, JobKind.TIMELINE)
    if isinstance(answered, Response):
        return answered
    payload, cache = answered
    return JSONResponse(payload, headers={"X-Batchfit-Cache": cache})


@router.post("/snapshot", response_class=Response, responses={**SNAPSHOT, **ERRORS},
             summary="The first card's step as a CUDA memory snapshot, for https://pytorch.org/memory_viz")
async def post_snapshot(request: Request, body: EstimateRequest) -> Any:
    _check_view(body)
    answered = await _pooled(request, body, JobKind.SNAPSHOT)
    if isinstance(answered, Response):
        return answered
    payload, cache = answered
    return Response(payload, media_type="application/octet-stream",
                    headers={"Content-Disposition": 'attachment; filename="step.pickle"', "X-Batchfit-Cache": cache})


def _check_view(body: EstimateRequest) -> None:
    """The rules of /estimate, and no validation: the views show the simulated step."""
    check_request(body, allow_local_code=False)
    if body.validate_step:
        raise SpecError("validate", True, "false: /timeline and /snapshot show the simulated step (POST /estimate "
                                          "with validate measures one on a GPU)")


async def _pooled(request: Request, body: EstimateRequest | ProfileJob, kind: JobKind) -> tuple[Any, str] | Response:
    """What a worker answers to ``body`` as ``kind`` asks, from the cache when it holds it: (the payload,
    ``"hit"`` or ``"miss"``), or the problem to answer instead. Identical concurrent requests share one job."""
    app = request.app
    key = job_key(body, kind)
    hit = await asyncio.to_thread(app.state.cache.get, key) if app.state.cache else None  # off the event loop
    known = None if hit is None else _from_cache(kind, hit)
    if known is not None:
        app.state.metrics.cache_hits.inc()
        return known, "hit"

    async def compute() -> Reply:
        app.state.metrics.cache_misses.inc()
        return await run_in_pool(app, body, kind)

    try:
        reply = await _while_connected(request, app.state.flights.run(key, compute))
    except Refused as refused:
        return refused.response()
    if reply is None:
        return _client_left()
    if reply.kind != ReplyKind.OK:
        return reply_problem(reply)
    if app.state.cache:
        await asyncio.to_thread(app.state.cache.set, key, _to_cache(kind, reply.payload))
    return reply.payload, "miss"


def _to_cache(kind: JobKind, payload: Any) -> dict[str, Any]:
    """What the cache stores (JSON objects): a snapshot's pickle as base64."""
    if kind == JobKind.SNAPSHOT:
        return {"pickle_base64": base64.b64encode(payload).decode("ascii")}
    stored: dict[str, Any] = payload
    return stored


def _from_cache(kind: JobKind, doc: dict[str, Any]) -> Any:
    """The payload a stored value holds; None (a miss) for a snapshot's that holds none."""
    if kind != JobKind.SNAPSHOT:
        return doc
    try:
        return base64.b64decode(doc["pickle_base64"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None


async def _validate(request: Request, body: EstimateRequest) -> Any:
    """One validation at a time on this node's GPU; never cached (it is a measurement)."""
    app = request.app

    async def locked() -> Reply:
        async with app.state.gpu_lock:
            return await run_in_pool(app, body)

    try:
        reply = await _while_connected(request, locked())
    except Refused as refused:
        return refused.response()
    if reply is None:
        return _client_left()
    if reply.kind == ReplyKind.OK:
        return JSONResponse(reply.payload)
    return reply_problem(reply)


class Refused(Exception):
    """The pool would not or could not finish the job; ``response()`` says why, a new one per caller
    (identical concurrent requests share the exception)."""

    def __init__(self, error: BatchfitError, headers: dict[str, str] | None = None) -> None:
        super().__init__(str(error))
        self.error, self.headers = error, headers

    def response(self) -> JSONResponse:
        return error_problem(self.error, self.headers)


async def _while_connected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the client disconnects first: then ``work`` is cancelled (the
    pool drops a queued job and kills and replaces the worker of a running one; a computation that an
    identical request still waits for goes on: app.cache.SingleFlight)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done() and gone.exception() is not None:  # cannot watch the connection: just wait
            logs.log("cannot watch the client's connection", error=repr(gone.exception()))
            await asyncio.wait({job})
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    return job.result() if job.done() else None


async def _disconnected(request: Request) -> None:
    """Returns when the ASGI server says the client closed the connection (``http.disconnect``); the body
    is read by then, so nothing else should come (anything else is waited past, never spun on)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.25)


def _client_left() -> JSONResponse:
    """What a request whose client disconnected gets (nobody reads it; the access log and
    ``batchfit_requests_total`` show 499)."""
    kind, title = HTTP_PROBLEMS[499]
    return problem(499, kind, title, "the client closed the connection before the answer; its estimate "
                                     "was cancelled unless an identical request still waits for it")


async def run_in_pool(app: Any, body: EstimateRequest | ProfileJob, kind: JobKind = JobKind.ESTIMATE,
                      progress: Heard | None = None) -> Reply:
    """Run the job ``kind`` asks of ``body`` in a worker, with the metrics; ``Refused`` when busy or past a limit.
    ``progress`` hears each full simulation (in a pool thread)."""
    metrics, t0 = app.state.metrics, time.perf_counter()
    metrics.workers_busy.inc()
    try:
        reply: Reply = await app.state.pool.run(body, kind, progress)
        return reply
    except asyncio.CancelledError:
        metrics.estimates_cancelled.inc()
        raise
    except Busy:
        s = app.state.settings
        raise Refused(Busy(f"{s.workers} workers busy and {s.queue_size} requests waiting; retry later"),
                      headers={"Retry-After": str(s.retry_after_s)}) from None
    except LimitExceeded as exc:
        metrics.worker_restarts.inc()
        raise Refused(exc) from None
    except WorkerDied as exc:
        metrics.worker_restarts.inc()
        raise Refused(exc, headers={"Retry-After": str(app.state.settings.retry_after_s)}) from None
    finally:
        metrics.workers_busy.dec()
        metrics.estimate.observe(time.perf_counter() - t0)


def reply_problem(reply: Reply) -> JSONResponse:
    if reply.kind == ReplyKind.ERROR:
        return error_problem(reply.error())
    return problem(500, "internal", "batchfit failed", str(reply.payload))


@router.get("/gpus", summary="The GPU catalog", responses=problem_responses(401))
def get_gpus() -> dict[str, Any]:
    return catalog()


@lru_cache(maxsize=1)
def _models() -> dict[str, Any]:
    from estimator import model_sources  # imports torch, timm and torchvision: only when asked

    return model_sources()


@router.get("/models", summary="What each model source offers", responses=problem_responses(401))
def get_models() -> dict:
    return _models()


@router.get("/healthz", summary="Liveness")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Workers ready, and the cache's state", responses={503: {"description": "not ready"}})
def readyz(request: Request) -> Any:
    """200 while a worker is alive: a degraded cache only means estimates are computed without it."""
    app = request.app
    pool, cache = app.state.pool, app.state.cache
    live = pool.live if pool is not None and pool.ready else 0
    pool_ok = live > 0
    if cache is None:
        cache_state, cache_error = "off", None
    elif cache.ping():
        cache_state, cache_error = "ok", None
    else:
        cache_state, cache_error = "degraded", cache.error or "not answering"
    body = {"workers": pool_ok, "live_workers": live, "cache": cache_state, "cache_error": cache_error}
    return JSONResponse(body, status_code=200 if pool_ok else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                       **problem_responses(401)})
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")
