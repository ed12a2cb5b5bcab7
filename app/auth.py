"""API keys: ``Authorization: Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from app.settings import Settings
from estimator.errors import Unauthorized


def check_key(request: Request, settings: Settings) -> None:
    keys = settings.keys()
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("Authorization: expected 'Bearer <key>'")
    # compare against every key, always: the time taken says nothing about which matched
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if not matched:
        raise Unauthorized("Authorization: the key is not valid")
