"""Stored profiles: ``POST /profiles``, ``GET`` and ``HEAD /profiles/{id}``, and the store behind them.

    curl -H 'Content-Type: application/json' --data-binary @p.json :8000/profiles   # 201 {"id": "sha256:..."}
    curl -d '{"profile": "sha256:...", "gpus": ["T4-16GB"]}' -H 'Content-Type: application/json' :8000/estimate

A profile (``batchfit profile``'s file, or a drop-in's ``save_profile``) lets the service answer for a model
whose code it never sees. It is data from a client: its shape is scanned on the raw bytes, then its strict
schema is checked (estimator/portable/schema.py and its request's schema) before anything is stored; a
refused profile is a 4xx and nothing is stored. Its id is the sha256 of its canonical JSON, so storing the
same profile twice gives the same id. Profiles live in the cache backend (SQLite, or Redis for replicas;
in this process's memory when the cache is off) under ``BATCHFIT_MAX_PROFILE_BYTES`` each and a budget
(``BATCHFIT_PROFILE_BUDGET_COUNT``, ``BATCHFIT_PROFILE_BUDGET_BYTES``) past which the oldest stored go.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app import logs
from app.cache import Budget, Cache, SQLiteCache
from app.errors import problem_responses
from app.settings import Settings
from app.shape import check_shape
from estimator import canonical_json, check_profile, profile_id
from estimator.errors import NotStored, SpecError, StoreUnavailable

router = APIRouter(tags=["profiles"])
PROFILE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "description": "a portable profile, as `batchfit profile` writes it (schema "
                                     "'batchfit.profile')"}}}}}


class ProfileStore:
    """Profiles by id in ``cache`` (a private in-memory SQLite one when the service's cache is off)."""

    def __init__(self, cache: Cache | None, settings: Settings) -> None:
        self.cache = cache if cache is not None else SQLiteCache("", 0)
        self.budget = Budget(settings.profile_budget_count, settings.profile_budget_bytes)
        self.in_memory = cache is None

    async def put(self, doc: dict[str, Any]) -> str:
        """Store a checked profile; its id. ``StoreUnavailable`` when the cache cannot be written now."""
        raw = canonical_json(doc).decode()
        key = profile_id(doc)
        if not await asyncio.to_thread(self.cache.put_profile, key, raw, self.budget):
            raise StoreUnavailable(f"the profile store ({self.cache.kind}) cannot be written now: "
                                   f"{self.cache.error or 'retry later'}")
        return key

    async def raw(self, key: str, field: str = "profile") -> str:
        """The stored JSON of ``key``; ``NotStored`` (naming ``field``) or ``StoreUnavailable``."""
        answered, raw = await asyncio.to_thread(self.cache.get_profile, key)
        if not answered:
            raise StoreUnavailable(f"the profile store ({self.cache.kind}) cannot be read now: "
                                   f"{self.cache.error or 'retry later'}")
        if raw is None:
            raise NotStored(field, key)
        return raw

    async def get(self, key: str, field: str = "profile") -> dict[str, Any]:
        """The stored profile ``key`` as JSON data (as it was checked when stored)."""
        raw = await self.raw(key, field)
        doc: dict[str, Any] = await asyncio.to_thread(json.loads, raw) if len(raw) > 2**16 else json.loads(raw)
        return doc


async def checked_profile(doc: Any, field: str = "profile") -> dict[str, Any]:
    """``doc`` when it is a profile by its strict schema (``SpecError`` naming ``field``'s first bad part),
    checked off the event loop."""
    await asyncio.to_thread(check_profile, doc, field)
    checked: dict[str, Any] = doc
    return checked


@router.post("/profiles", status_code=201, responses=problem_responses(400, 401, 413, 415, 422, 503),
             summary="Store a portable profile; its id answers POST /estimate without the model's code",
             openapi_extra=PROFILE_BODY)
async def post_profile(request: Request) -> JSONResponse:
    raw = await request.body()
    settings = request.app.state.settings
    await asyncio.to_thread(check_shape, raw, max(settings.max_profile_bytes // 2, 1))
    try:
        doc = await asyncio.to_thread(json.loads, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError("(body)", raw[:80].decode("utf-8", "replace"), f"a JSON profile ({exc})") from None
    key = await request.app.state.profiles.put(await checked_profile(doc))
    logs.log("profile-stored", id=key, bytes=len(raw))
    return JSONResponse({"id": key}, status_code=201, headers={"Location": f"/profiles/{key}"})


@router.get("/profiles/{profile_id}", responses=problem_responses(401, 404, 503),
            summary="A stored profile, as it was stored")
async def get_profile(request: Request, profile_id: str) -> Response:
    raw = await request.app.state.profiles.raw(profile_id, "profile_id")
    return Response(raw, media_type="application/json")


@router.head("/profiles/{profile_id}", responses={200: {"description": "stored"}, 404: {"description": "not "
                                                                                                       "stored"}},
             summary="Whether a profile is stored")
async def head_profile(request: Request, profile_id: str) -> Response:
    try:
        raw = await request.app.state.profiles.raw(profile_id, "profile_id")
    except NotStored:
        return Response(status_code=404)
    return Response(status_code=200, headers={"Content-Length": str(len(raw.encode()))})
