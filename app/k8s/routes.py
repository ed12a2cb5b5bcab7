"""The routes: POST /k8s/filter, /k8s/prioritize (kube-scheduler extender) and /k8s/mutate (admission webhook,
for pods and DRA claims).

Their bodies are Kubernetes objects, parsed here rather than by a schema (a Pod or a Node has hundreds of
fields this service never reads). Each call answers within ``BATCHFIT_K8S_DEADLINE_S`` of its arrival
(app/k8s/answers.py). A body that is not the expected object is a 400/422 problem, which kube-scheduler treats
as an extender error (passed over with ``ignorable: true``) and the API server as a webhook failure
(``failurePolicy: Ignore``); a wrong pod annotation is not an error of the call: the pod passes, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app import logs
from app.errors import problem_responses
from app.k8s.extender import filter_nodes, passing_all, prioritize_nodes, scoring_none
from app.k8s.pods import listing, mapping
from app.k8s.review import review_request, unchanged_review
from app.k8s.webhook import mutate
from app.shape import check_shape
from estimator.errors import SpecError

router = APIRouter(prefix="/k8s", tags=["kubernetes"])
K8S_MAX_ITEMS = 5_000_000  # keys and elements of a NodeList of thousands of nodes (app/shape.py)
ERRORS = problem_responses(400, 401, 413, 415, 422)


async def _body(request: Request) -> Any:
    """The decoded JSON body; ``SpecError`` at ``(body)`` when it is not JSON or its shape is refused. Large
    bodies (a NodeList) are scanned and parsed off the event loop."""
    raw = await request.body()
    big = len(raw) > 2**16
    if big:
        await asyncio.to_thread(check_shape, raw, K8S_MAX_ITEMS)
    else:
        check_shape(raw, K8S_MAX_ITEMS)
    try:
        return await asyncio.to_thread(json.loads, raw) if big else json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError("(body)", raw[:80].decode("utf-8", "replace"), f"JSON ({exc})") from None


def _deadline(request: Request) -> float:
    return asyncio.get_running_loop().time() + request.app.state.settings.k8s_deadline_s - _elapsed(request)


def _elapsed(request: Request) -> float:
    """Seconds since the request arrived (the middleware's clock), so the deadline counts the body's upload."""
    started = getattr(request.state, "started", None)
    return max(time.perf_counter() - started, 0.0) if started is not None else 0.0


def _args(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get("Pod"), dict):
        raise SpecError("Pod", None if not isinstance(body, dict) else body.get("Pod"),
                        "an ExtenderArgs object with the Pod (kube-scheduler extender/v1)")
    nodes = body.get("Nodes")
    if nodes is not None and not (isinstance(nodes, dict) and isinstance(nodes.get("items", []), (list, type(None)))):
        raise SpecError("Nodes", type(nodes).__name__, "a NodeList object with items (or null)")
    return body


def _object_body(description: str) -> dict[str, Any]:
    """OpenAPI for a body read by hand: a JSON object."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "description": description}}}}}


EXTENDER_ARGS = _object_body("ExtenderArgs (k8s.io/kube-scheduler/extender/v1): Pod, Nodes (a NodeList), NodeNames")


@router.post("/filter", responses=ERRORS, summary="kube-scheduler extender: drop the nodes whose GPU the pod's "
             "step does not fit", openapi_extra=EXTENDER_ARGS)
async def k8s_filter(request: Request) -> Response:
    return await _extender(request, "filter", filter_nodes, passing_all)


@router.post("/prioritize", responses=ERRORS, summary="kube-scheduler extender: rank nodes 0-10 by the pod's "
             "headroom", openapi_extra=EXTENDER_ARGS)
async def k8s_prioritize(request: Request) -> Response:
    return await _extender(request, "prioritize", prioritize_nodes, scoring_none)


async def _extender(request: Request, verb: str, answer: Callable[..., Awaitable[Any]],
                    fallback: Callable[[dict[str, Any]], Any]) -> Response:
    """A verb's answer; on a defect, ``fallback``'s (every node passes, or scores 0): scheduling is never blocked."""
    args = _args(await _body(request))
    try:
        result = await answer(args, request.app.state.k8s, _deadline(request))
    except Exception as exc:  # noqa: BLE001 - logged and counted
        _defect(request, verb, exc)
        result = fallback(args)
    return await _json(result)


@router.post("/mutate", responses=ERRORS, summary="mutating admission webhook: the pod's batch size in its env, "
             "a DRA claim's memory selector", openapi_extra=_object_body(
                 "AdmissionReview (admission.k8s.io/v1) of a Pod, ResourceClaim or ResourceClaimTemplate CREATE"))
async def k8s_mutate(request: Request) -> Response:
    review = await _body(request)
    uid = review_request(review)["uid"]
    settings = request.app.state.settings
    try:
        result = await mutate(review, request.app.state.k8s, _deadline(request), settings.webhook_deny_unfit)
    except Exception as exc:  # noqa: BLE001 - the pod is allowed, unchanged
        _defect(request, "mutate", exc)
        result = unchanged_review(uid, "not changed: batchfit failed (logged)")
    return await _json(result)


def _defect(request: Request, verb: str, exc: Exception) -> None:
    logs.log("k8s-defect", verb=verb, error=f"{type(exc).__name__}: {exc}",
             request_id=request.headers.get("x-request-id"))
    request.app.state.metrics.k8s_calls.labels(verb, "error").inc()


async def _json(result: Any) -> Response:
    """``result`` as JSON; a large one (a filter echoing thousands of nodes) is encoded off the event loop."""
    small = not isinstance(result, dict) or len(listing(mapping(result.get("Nodes")).get("items"))) < 100
    encode = json.dumps
    body = encode(result, separators=(",", ":")) if small else await asyncio.to_thread(
        encode, result, separators=(",", ":"))
    return Response(body, media_type="application/json")
