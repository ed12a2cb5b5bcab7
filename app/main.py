"""The batchfit service. Until the service issue lands it answers liveness only."""

from __future__ import annotations

from fastapi import FastAPI

from estimator import __version__


def create_app() -> FastAPI:
    """The FastAPI application (``uvicorn app.main:app``)."""
    application = FastAPI(title="batchfit", version=__version__)

    @application.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return application


app = create_app()
