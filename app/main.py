"""The batchfit service: ``uvicorn --factory app.main:create_app``, or ``batchfit serve``.

Nothing runs at import: settings are read and the app is built when the
server calls ``create_app`` (so importing this module never fails on a bad
``BATCHFIT_*`` variable, and tests build their own app).

Estimates run in worker processes (app/pool.py); results are cached
(app/cache.py); errors are application/problem+json (app/errors.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app import logs
from app.auth import check_key
from app.cache import SingleFlight, open_cache, source_hash
from app.docs import add_docs
from app.errors import (
    HTTP_PROBLEMS,
    error_problem,
    on_batchfit_error,
    on_http_error,
    on_unexpected_error,
    on_validation_error,
    problem,
    unsupported_media_type,
)
from app.examples import add_examples
from app.k8s.answers import Estimates
from app.k8s.routes import router as k8s_router
from app.metrics import Metrics
from app.page import add_page
from app.pool import Pool
from app.profiles import ProfileStore
from app.profiles import router as profiles_router
from app.routes import router
from app.settings import Settings, get_settings
from estimator import __version__
from estimator.errors import BatchfitError, Unauthorized

OPEN = {"/healthz", "/readyz", "/"}  # without a key even when keys are set (the page: app/page.py says why)
STATIC = "/static"  # the page's and the docs' files (app/page.py, app/docs.py): public, open like the page
K8S = {"/k8s/filter", "/k8s/prioritize", "/k8s/mutate"}  # without a key with BATCHFIT_K8S_WITHOUT_KEY
PROFILES = "/profiles"  # POST a profile; GET and HEAD /profiles/{id} (app/profiles.py)
# the routes that take a body: application/json, else 415
JSON_BODY = {"/estimate", "/timeline", "/snapshot", PROFILES, *K8S}
ROUTES = {"/estimate", "/timeline", "/snapshot", "/gpus", "/models", "/healthz", "/readyz", "/metrics", "/docs",
          "/redoc", "/openapi.json", "/", STATIC, PROFILES, PROFILES + "/{id}", *K8S}


def __getattr__(name: str) -> Any:
    if name == "app":  # before 0.3.0 the module built its app at import
        raise AttributeError("app.main builds no app at import since batchfit 0.3.0: run "
                             "`uvicorn --factory app.main:create_app` (or `batchfit serve`)")
    raise AttributeError(f"module 'app.main' has no attribute {name!r}")


def create_app(settings: Settings | None = None, *, start_workers: bool = True) -> FastAPI:
    """The FastAPI application; ``start_workers=False`` leaves the pool to the caller (tests)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logs.setup()
        source_hash()  # part of every cache key: read the estimator's files now, not on the first request
        errors = app.state.metrics.cache_errors
        app.state.cache = open_cache(settings, on_error=lambda op: errors.labels(op).inc())  # degraded, never fails
        app.state.profiles = ProfileStore(app.state.cache, settings)
        app.state.pool = Pool(settings)
        if start_workers:
            await app.state.pool.start()
        logs.log("started", workers=settings.workers, cache=type(app.state.cache).__name__)
        yield
        await app.state.k8s.close()
        await app.state.pool.stop()
        if app.state.cache:
            app.state.cache.close()

    app = FastAPI(title="batchfit", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="GPU memory of a PyTorch training step and the largest batch that fits, "
                              "predicted without a GPU.")
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.flights = SingleFlight()
    app.state.gpu_lock = asyncio.Lock()  # one validation at a time on this node's GPU
    app.state.cache = None
    app.state.profiles = ProfileStore(None, settings)  # the lifespan's, in the cache, replaces it
    app.state.pool = None
    app.state.k8s = Estimates(app)
    app.add_exception_handler(BatchfitError, on_batchfit_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)  # a 500 is problem+json too

    @app.middleware("http")
    async def around(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        route = request.url.path
        t0 = request.state.started = time.perf_counter()
        if not _open(route, settings):
            try:
                check_key(request, settings)
            except Unauthorized as exc:
                denied = error_problem(exc, headers={"WWW-Authenticate": "Bearer"})
                return _finish(app, denied, route, rid, t0)
        limit = _body_limit(route, settings)
        declared = request.headers.get("content-length")
        streamed = None
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                return _finish(app, _body_too_large(f"the body is {declared} bytes", limit, route), route, rid, t0)
        content_type = request.headers.get("content-type")
        if request.method == "POST" and route in JSON_BODY and _has_body(request) and not _is_json(content_type):
            return _finish(app, unsupported_media_type(content_type), route, rid, t0)
        if declared is None and request.method in ("POST", "PUT", "PATCH"):
            streamed = request._receive = _LimitedBody(request.receive, limit)
        try:
            response: Response = await call_next(request)
        except Exception:  # rendered by on_unexpected_error, then logged by the server: counted here
            _count(app, 500, route, rid, t0)
            raise
        if streamed is not None and streamed.exceeded:  # what the route saw was cut off at the limit
            response = _body_too_large(f"the body passed {limit} bytes", limit, route)
        return _finish(app, response, route, rid, t0)

    app.include_router(router)
    app.include_router(profiles_router)
    app.include_router(k8s_router)
    _with_examples(app)
    add_docs(app)  # /docs and /redoc with their assets from this service, not a CDN
    add_page(app)
    return app


def _with_examples(app: FastAPI) -> None:
    """``/openapi.json`` with app/examples.py's requests and answers (FastAPI's "extending OpenAPI" recipe)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = build()  # FastAPI's, kept on the app after the first call
        return add_examples(schema) if fresh else schema

    app.openapi = openapi  # type: ignore[method-assign]


def _body_limit(route: str, settings: Settings) -> int:
    """BATCHFIT_K8S_MAX_BODY_BYTES on the /k8s/ routes, BATCHFIT_MAX_PROFILE_BYTES on POST /profiles, else
    BATCHFIT_MAX_BODY_BYTES (an inline profile on /estimate too: a larger one goes by id)."""
    if route in K8S:
        return settings.k8s_max_body_bytes
    return settings.max_profile_bytes if route == PROFILES else settings.max_body_bytes


def _setting(route: str) -> str:
    if route in K8S:
        return "BATCHFIT_K8S_MAX_BODY_BYTES"
    return "BATCHFIT_MAX_PROFILE_BYTES" if route == PROFILES else "BATCHFIT_MAX_BODY_BYTES"


def _open(route: str, settings: Settings) -> bool:
    """Whether ``route`` answers without a key when keys are set (without keys every route does, /docs too)."""
    return route in OPEN or route.startswith(STATIC + "/") or (route in K8S and settings.k8s_without_key)


def _label(route: str) -> str:
    """``route`` as a metrics label: one of ``ROUTES`` (every file under /static counts as ``/static``)."""
    if route.startswith(STATIC + "/"):
        return STATIC
    if route.startswith(PROFILES + "/"):
        return PROFILES + "/{id}"
    return route if route in ROUTES else "(other)"  # bounded label values


def _has_body(request: Request) -> bool:
    declared = request.headers.get("content-length")
    return int(declared) > 0 if declared is not None else "transfer-encoding" in request.headers


def _is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json``, any parameters (``charset=utf-8``), as FastAPI reads."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _body_too_large(what: str, limit: int, route: str) -> Response:
    """413, before the body is read when its Content-Length says so (``_body_limit``)."""
    kind, title = HTTP_PROBLEMS[413]
    return problem(413, kind, title, f"{what}; the service takes at most {limit} ({_setting(route)})")


class _LimitedBody:
    """An ASGI receive for a body without Content-Length (chunked): past ``limit`` bytes it ends the body
    there, unread beyond, and marks the request ``exceeded`` (the middleware answers 413)."""

    def __init__(self, receive: Any, limit: int) -> None:
        self.receive, self.limit, self.seen, self.exceeded, self.ended = receive, limit, 0, False, False

    async def __call__(self) -> Any:
        if self.ended:  # after the cut: the rest of the body is dropped, then what the server says (disconnect)
            while (message := await self.receive())["type"] == "http.request":
                pass
            return message
        if self.exceeded:
            self.ended = True
            return {"type": "http.request", "body": b"", "more_body": False}
        message = await self.receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                self.exceeded = True
                return {"type": "http.request", "body": b"", "more_body": False}
        return message


def _finish(app: FastAPI, response, route: str, rid: str, t0: float):
    response.headers["X-Request-ID"] = rid
    _count(app, response.status_code, route, rid, t0)
    return response


def _count(app: FastAPI, status: int, route: str, rid: str, t0: float) -> None:
    dt = time.perf_counter() - t0
    known = _label(route)
    app.state.metrics.requests.labels(known, str(status)).inc()
    app.state.metrics.latency.labels(known).observe(dt)
    logs.log("request", request_id=rid, route=route, status=status, seconds=round(dt, 4))
