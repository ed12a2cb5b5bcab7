"""The API docs, offline: Swagger UI at ``/docs`` and ReDoc at ``/redoc``, their scripts and styles served by the
service itself from the fastapi-offline package (the service extra) under ``/static/docs/``. FastAPI's own pages
load them from cdn.jsdelivr.net, which an air-gapped cluster cannot reach: it sees a blank page.

>>> app = FastAPI(docs_url=None, redoc_url=None)                  # doctest: +SKIP
>>> add_docs(app)                                                 # /docs, /redoc, /static/docs/...

The pages keep the service's auth rules (app/main.py: with API keys set, /docs and /redoc need one, like
/openapi.json they read); the assets are the package's public files, the same in every install, and open.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from estimator.errors import MissingExtraError

ASSETS_URL = "/static/docs"
# what the pages load, as fastapi-offline ships them (its static/ folder: Swagger UI 5, ReDoc 2)
SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON = "swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", \
    "favicon.png"
ASSETS = (SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON)
# Swagger UI's default validatorUrl (validator.swagger.io) would put a badge fetched from there on the page
SWAGGER_PARAMETERS = {"validatorUrl": None}
# The pages may load nothing from another origin: ReDoc's sidebar shows Redocly's logo from cdn.redoc.ly (hidden
# when it fails to load), which this blocks before any request. Inline script and styles: FastAPI's page starts
# Swagger UI with an inline script, ReDoc styles itself inline; its search runs in a blob: worker.
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
       "frame-ancestors 'none'; base-uri 'none'")


def assets_dir() -> Path:
    """fastapi-offline's folder of Swagger UI and ReDoc files; ``MissingExtraError`` when it lacks one (another
    release laid them out otherwise)."""
    folder = Path(str(resources.files(fastapi_offline) / "static"))
    missing = [name for name in ASSETS if not (folder / name).is_file()]
    if missing:
        raise MissingExtraError("service", "the offline API docs", f"fastapi-offline at {folder} ships no "
                                f"{', '.join(missing)}")
    return folder


def add_docs(app: FastAPI) -> None:
    """Swagger UI and ReDoc on ``app`` (built with ``docs_url=None, redoc_url=None``), assets from this service."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy's path prefix, as FastAPI's own page does
        page = get_swagger_ui_html(openapi_url=root + openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{ASSETS_URL}/{SWAGGER_JS}",
                                   swagger_css_url=f"{root}{ASSETS_URL}/{SWAGGER_CSS}",
                                   swagger_favicon_url=f"{root}{ASSETS_URL}/{FAVICON}",
                                   oauth2_redirect_url=None, swagger_ui_parameters=SWAGGER_PARAMETERS)
        page.headers["Content-Security-Policy"] = CSP
        return page

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(openapi_url=root + openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS_URL}/{REDOC_JS}",
                              redoc_favicon_url=f"{root}{ASSETS_URL}/{FAVICON}", with_google_fonts=False)
        page.headers["Content-Security-Policy"] = CSP
        return page
