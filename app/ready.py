"""For clients of a service they started themselves (benchmarks, tests): wait until it is ready."""

from __future__ import annotations

import time

import httpx


def wait_ready(url: str, timeout_s: float = 300.0) -> None:
    """Poll ``url``/readyz until it answers 200 (a live worker; a degraded cache does not
    stop it); TimeoutError after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {timeout_s:g} s")
