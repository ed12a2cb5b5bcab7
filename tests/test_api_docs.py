"""/docs, /redoc and the page at / load nothing from another origin: every URL their HTML (and the page's script
and style) names is this service's, and each is served 200 with its content type; the auth rules (a key for the
docs when keys are set, none for the page and the static files); a proxy's path prefix; the metrics labels; the
static files are package data. (tests/test_page_browser.py renders them in a real browser.)
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
from fastapi.testclient import TestClient
from support import service

from app.docs import ASSETS
from app.main import create_app
from app.page import CSP as PAGE_CSP
from app.settings import Settings

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[1]
TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json",
         ".html": "text/html"}
# a namespace name, never fetched: the only absolute URL the page's script may hold
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


class _Refs(HTMLParser):
    """The URLs an HTML page loads: src and href attributes, ReDoc's spec-url, Swagger UI's ``url:`` in the
    inline script that starts it."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("src", "href", "spec-url") and v and not v.startswith("data:")]
        self.script = tag == "script"

    def handle_data(self, data: str) -> None:
        if self.script:
            self.urls += re.findall(r"\burl: '([^']+)'", data)


def _refs(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    return parser.urls


@pytest.fixture(scope="module")
def client():
    with service(start_workers=False) as c:
        yield c


def _served(client: TestClient, page: str, url: str) -> None:
    """``url`` (as ``page`` names it) is this origin's and is served 200 with its extension's content type."""
    absolute = urljoin(f"http://testserver{page}", url)
    parts = urlsplit(absolute)
    assert parts.netloc == "testserver", f"{page} loads {url} from another origin"
    r = client.get(parts.path)
    assert r.status_code == 200, (url, r.status_code)
    assert r.headers["content-type"].split(";")[0] == TYPES[Path(parts.path).suffix or ".json"], url


@pytest.mark.parametrize("page, expected", [
    ("/docs", {"/static/docs/swagger-ui.css", "/static/docs/favicon.png", "/static/docs/swagger-ui-bundle.js",
               "/openapi.json"}),
    ("/redoc", {"/static/docs/favicon.png", "/openapi.json", "/static/docs/redoc.standalone.js"}),
])
def test_the_docs_load_only_this_services_files(client, page, expected) -> None:
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", r.text), "an absolute URL: another host (a CDN, Google Fonts)"
    urls = _refs(r.text)
    assert set(urls) == expected
    for url in urls:
        _served(client, page, url)
    csp = r.headers["content-security-policy"]  # ReDoc's logo from cdn.redoc.ly is blocked before it is asked
    assert "default-src 'self'" in csp and "img-src 'self' data:" in csp and "connect-src 'self'" in csp


def test_the_page_loads_only_this_services_files(client) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == PAGE_CSP and "default-src 'none'" in PAGE_CSP
    urls = _refs(r.text)
    assert set(urls) == {"static/page/page.css", "static/page/page.js", "docs"}  # relative: a path prefix holds
    for url in urls:
        if url != "docs":
            _served(client, "/", url)
    for name in ("index.html", "page.js", "page.css"):
        text = (ROOT / "app" / "static" / name).read_text()
        assert set(re.findall(r"https?://[^\s\"'`)]+", text)) <= {SVG_NAMESPACE}, name
        assert "@import" not in text and "url(" not in text.replace("url: ", ""), name  # no fonts, no images


def test_the_docs_and_their_files_follow_the_auth_rules() -> None:
    app = create_app(Settings(workers=1, cache_path="", api_keys="s3cret"), start_workers=False)
    key = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):  # the API's description: a key
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert c.get(path, headers=key).status_code == 200
        # the page and the files: public, the same in every install (a browser cannot send a key for them)
        for path in ("/", "/static/page/page.js", *(f"/static/docs/{name}" for name in ASSETS)):
            assert c.get(path).status_code == 200, path
        assert c.get("/static/page/nothing.js").status_code == 404
        assert c.get("/gpus").status_code == 401  # what the page shows still needs the key


@pytest.mark.parametrize("path", ["/static/../gpus", "/static/page/../../gpus", "/static/docs/../../openapi.json",
                                  "/static/docs/x/../../../docs"])
def test_the_open_static_prefix_reaches_no_keyed_route(path) -> None:
    """The path as a client may send it, dot segments and all (an HTTP client would normalize it): the open
    /static/ prefix opens no other route."""
    app = create_app(Settings(workers=1, cache_path="", api_keys="s3cret"), start_workers=False)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver")], "server": ("testserver", 80), "client": ("127.0.0.1", 1)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] in (401, 404), (path, sent[0]["status"])


def test_a_path_prefix_reaches_the_pages_urls() -> None:
    app = create_app(Settings(workers=1, cache_path=""), start_workers=False)
    with TestClient(app, root_path="/batchfit") as c:
        for page in ("/docs", "/redoc"):
            urls = _refs(c.get(page).text)
            assert urls and all(u.startswith("/batchfit/") for u in urls), urls


def test_metrics_name_the_page_and_the_static_files_without_one_label_each(client) -> None:
    for path in ("/", "/redoc", "/static/page/page.js", "/static/page/page.css", "/static/docs/swagger-ui.css"):
        client.get(path)
    text = client.get("/metrics").text
    labels = set(re.findall(r'batchfit_requests_total\{route="([^"]+)",status="200"\}', text))
    assert {"/", "/redoc", "/static"} <= labels and not any(label.startswith("/static/") for label in labels)


def test_the_static_files_are_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["app"]
    for path in (ROOT / "app" / "static").iterdir():
        rel = path.relative_to(ROOT / "app").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"app/{rel} is not in the wheel ({patterns})"
