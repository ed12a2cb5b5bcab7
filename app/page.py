"""The web page at ``/``: a form for a request, the answer's table, the breakdown at the peak and the first card's
step as a memory timeline (``POST /estimate``, then ``POST /timeline``), drawn by one small script. The files are
the package's own (app/static/): no build step, no CDN, no external fonts; a Content-Security-Policy holds the page
to this origin.

>>> add_page(app)                                  # doctest: +SKIP
>>> # GET / -> index.html; GET /static/page/page.js, /static/page/page.css

``/`` and its files need no API key even when keys are set: a browser cannot send ``Authorization`` when it opens
a page or loads its script, and these bytes are the same in every install, revealing nothing about this service.
What the page shows comes from the routes that do need the key, which it sends from a box kept in the tab's
sessionStorage. (``/docs`` keeps its key: it is a view of ``/openapi.json``, this service's API.)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_URL = "/static/page"
# this origin only: the page's script and style, the service's routes; no inline script, no frames
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def static_dir() -> Path:
    return Path(str(resources.files("app") / "static"))


def add_page(app: FastAPI) -> None:
    """``GET /`` and the page's files on ``app``."""
    folder = static_dir()
    app.mount(STATIC_URL, StaticFiles(directory=folder), name="page-assets")
    html = (folder / "index.html").read_text(encoding="utf-8")  # read once, when the app is built

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                                           "Cache-Control": "no-cache"})
