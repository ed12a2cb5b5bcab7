"""``POST /estimate`` as server-sent events, for a client that asks (``Accept: text/event-stream``).

    curl -N -H 'Accept: text/event-stream' -H 'Content-Type: application/json' -d @job.json :8000/estimate
    event: progress
    data: {"simulations": 1, "note": "batch 1 on A100-80GB (4.1 s)"}
    ...
    event: result
    data: {"results": [...], ...}

One ``progress`` event per full simulation, a comment every 15 s while one runs (proxies keep the connection),
then ``result`` with the same JSON ``POST /estimate`` answers, or ``error`` with its problem+json (``status``
inside). A bad request is refused before the stream starts, as a plain problem+json. Closing the connection
cancels the estimate (the worker running it is replaced), as for a plain request. A cached answer streams at
once; a streamed one is cached like any other.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.worker import JobKind, ProfileJob, ReplyKind
from estimator import EstimateRequest, job_of

KEEP_ALIVE_S = 15.0


def wants_events(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _problem(response: JSONResponse) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(bytes(response.body))
    return {"status": response.status_code, **doc}


async def estimate_events(request: Request, body: EstimateRequest | ProfileJob) -> StreamingResponse:
    """The stream of one estimate (the body already checked, as ``POST /estimate`` checks it; a profile's has
    no progress: it simulates nothing)."""
    from app.routes import Refused, job_key, reply_problem, run_in_pool

    if isinstance(body, EstimateRequest):
        job_of(body)  # its cards too: what can be refused without a worker is refused before the stream
    app = request.app
    key = job_key(body, JobKind.ESTIMATE)
    known = await asyncio.to_thread(app.state.cache.get, key) if app.state.cache else None
    loop = asyncio.get_running_loop()
    heard: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def progress(simulations: int, note: str) -> None:  # in a pool thread
        loop.call_soon_threadsafe(heard.put_nowait, {"simulations": simulations, "note": note})

    async def events() -> AsyncIterator[str]:
        if known is not None:
            app.state.metrics.cache_hits.inc()
            yield _event("result", known)
            return
        app.state.metrics.cache_misses.inc()
        job = asyncio.ensure_future(run_in_pool(app, body, JobKind.ESTIMATE, progress))
        try:
            while not job.done():
                news = asyncio.ensure_future(heard.get())
                await asyncio.wait({job, news}, timeout=KEEP_ALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                if news.done():
                    yield _event("progress", news.result())
                else:
                    news.cancel()
                    if not job.done():
                        yield ": still simulating\n\n"
            while not heard.empty():
                yield _event("progress", heard.get_nowait())
            try:
                reply = job.result()
            except Refused as refused:
                yield _event("error", _problem(refused.response()))
                return
            if reply.kind != ReplyKind.OK:
                yield _event("error", _problem(reply_problem(reply)))
                return
            if app.state.cache:
                await asyncio.to_thread(app.state.cache.set, key, reply.payload)
            yield _event("result", reply.payload)
        finally:
            if not job.done():
                job.cancel()  # the client left: the pool drops the job, or kills and replaces its worker

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Batchfit-Cache": "hit" if known else "miss"})
