"""The page at ``/`` in a real headless browser (Debian's chromium through chromium-driver, driven by selenium)
against the service under uvicorn: the form submits, the table shows what ``POST /estimate`` answers to the
same request, the timeline is drawn from what ``POST /timeline`` answers, a refused field shows its error beside
it, the key box works with API keys, and /docs and /redoc render with nothing fetched from another origin.

Screenshots go to $BATCHFIT_SCREENS (default /work/screens/) when that folder can be made; they are for people,
nothing is asserted on them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from app import examples
from app.main import create_app
from app.ready import wait_ready
from app.settings import Settings

pytestmark = pytest.mark.service

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# the network is closed: no sandbox (root in a container), no GPU, none of chromium's own calls home
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"]
ESTIMATE_WAIT_S = 600  # the worker's first estimate imports torch and simulates the step (2 shared cores)
GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"  # as page.js writes bytes


class Served:
    """The service under uvicorn on a free local port, in a thread of this process."""

    def __init__(self, settings: Settings, *, start_workers: bool = True) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(settings, start_workers=start_workers)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[WebDriver]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("the page's browser test needs Debian's chromium and chromium-driver (apt-get install chromium "
                    f"chromium-driver; .ci/run installs them): chromium {CHROMIUM}, chromedriver {DRIVER}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("cache") / "cache.sqlite"
    with Served(Settings(workers=1, queue_size=8, cache_path=str(cache), request_timeout_s=ESTIMATE_WAIT_S)) as s:
        wait_ready(s.url)
        yield s


def _screens() -> Path | None:
    folder = Path(os.environ.get("BATCHFIT_SCREENS", "/work/screens"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


def _screenshot(driver: WebDriver, name: str) -> None:
    folder = _screens()
    if folder is None:
        return
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(1000, int(height) + 40))
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(folder / name))
    driver.set_window_size(1400, 1000)


def _open(driver: WebDriver, url: str) -> None:
    """The page, its lists loaded (GET /gpus, /models and the schema answered)."""
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/")
    WebDriverWait(driver, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gpus option")
                                     and d.find_elements(By.CSS_SELECTOR, "#optimizer option"))


def _type(driver: WebDriver, element_id: str, text: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(text)


def _choose_cards(driver: WebDriver, names: list[str]) -> None:
    cards = Select(driver.find_element(By.ID, "gpus"))
    cards.deselect_all()
    for name in names:
        cards.select_by_value(name)


def _submit_and_wait(driver: WebDriver, done: str) -> None:
    driver.find_element(By.ID, "submit").click()
    WebDriverWait(driver, ESTIMATE_WAIT_S).until(
        lambda d: d.find_element(By.ID, "submit").is_enabled() and d.execute_script(done))


def _visible_errors(driver: WebDriver) -> dict[str, str]:
    return {e.get_attribute("id"): e.text for e in driver.find_elements(By.CSS_SELECTOR, ".error") if e.is_displayed()}


def test_the_form_shows_the_estimate_and_the_timeline_of_the_same_request(browser, service) -> None:
    _open(browser, service.url)
    Select(browser.find_element(By.ID, "source")).select_by_value("torchvision")
    _type(browser, "name", "resnet18")
    assert not browser.find_element(By.ID, "seq_len").is_displayed()  # a vision model: no sequence length
    _type(browser, "image_size", "64")
    Select(browser.find_element(By.ID, "precision")).select_by_value("amp-bf16")
    Select(browser.find_element(By.ID, "optimizer")).select_by_value("adamw")
    _choose_cards(browser, ["T4-16GB", "A100-80GB"])
    _submit_and_wait(browser, "return document.querySelector('#timeline svg') !== null")
    assert _visible_errors(browser) == {}

    sent: dict[str, Any] = browser.execute_script("return request()")  # the body the page built from the form
    assert sent["model"] == {"source": "torchvision", "name": "resnet18"}
    assert sent["input"] == {"image_size": [3, 64, 64]} and sent["gpus"] == ["T4-16GB", "A100-80GB"]
    again = httpx.post(f"{service.url}/estimate", json=sent, timeout=ESTIMATE_WAIT_S)
    assert again.status_code == 200 and again.headers["x-batchfit-cache"] == "hit"  # the page sent this very body
    answer = again.json()

    rows = browser.find_elements(By.CSS_SELECTOR, "#results tbody tr")
    assert [r.get_attribute("data-gpu") for r in rows] == ["T4-16GB", "A100-80GB"]
    for row, result in zip(rows, answer["results"], strict=True):
        cells = row.find_elements(By.TAG_NAME, "td")
        expected = [result["capacity_bytes"], result["max_batch_size"], result["recommended_batch_size"],
                    (result["max_memory"] or {}).get("device_peak_bytes"),
                    (result["recommended_memory"] or {}).get("device_peak_bytes")]
        assert [c.get_attribute("data-value") for c in cells] == [None if v is None else str(v) for v in expected]
        texts = [c.text for c in cells]
        assert texts[1:3] == [str(result["max_batch_size"]), str(result["recommended_batch_size"])]
        assert texts[0] == _gib(result["capacity_bytes"]) and texts[3] == _gib(expected[3])

    bars = browser.find_elements(By.CSS_SELECTOR, "#breakdown rect.bar")
    breakdown = answer["breakdown"]
    assert {b.get_attribute("data-series"): int(b.get_attribute("data-bytes")) for b in bars} == {
        k: v for k, v in breakdown.items() if k != "batch_size" and v > 0}

    first = answer["results"][0]
    batch = first["recommended_batch_size"] or first["max_batch_size"] or first["min_batch_size"]
    timeline = httpx.post(f"{service.url}/timeline", json={**sent, "batch_size": batch}, timeout=ESTIMATE_WAIT_S)
    assert timeline.headers["x-batchfit-cache"] == "hit"  # what the page asked for, answered from the cache
    t = timeline.json()
    svg = browser.find_element(By.CSS_SELECTOR, "#timeline svg")
    series = [e.get_attribute("data-series") for e in svg.find_elements(By.CSS_SELECTOR, "[data-series]")]
    bands = [c for c, values in t["categories"].items() if any(values)]
    assert series == [*bands, "reserved", "allocated", "usable", "peak"]
    allocated = svg.find_element(By.CSS_SELECTOR, "polyline.allocated").get_attribute("points").split()
    assert len(allocated) == len(t["points"]) == len(t["allocated"])
    assert f"usable {_gib(t['usable_bytes'])}" in svg.text
    assert f"peak {_gib(t['allocated_peak_bytes'])} ({t['peak_phase']})" in svg.text
    # the peak's marker sits on the allocated line at the peak's event
    peak = svg.find_element(By.CSS_SELECTOR, "circle.peak")
    at = t["points"].index(t["peak_event"])
    assert allocated[at] == f"{float(peak.get_attribute('cx')):.1f},{float(peak.get_attribute('cy')):.1f}"
    # phase labels: one row each, none overlapping another on its row (measured by the browser)
    boxes = browser.execute_script(
        "return Array.from(document.querySelectorAll('#timeline text.phase-label'), t => {"
        "const b = t.getBBox(); return [t.dataset.row, b.x, b.x + b.width, t.textContent]; })")
    assert boxes, "no phase labelled"
    for row in {b[0] for b in boxes}:
        spans = sorted((b[1], b[2]) for b in boxes if b[0] == row)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    labelled = {b[3] for b in boxes}
    assert labelled <= {p["phase"] for p in t["phases"]} | {f"{p['phase']} {p['iteration']}" for p in t["phases"]}
    _screenshot(browser, "page-answer.png")


@pytest.mark.parametrize("fill, control", [
    ({"source": "transformers", "preset": "gpt2", "seq_len": "0"}, "seq_len"),     # refused by the schema
    ({"source": "torchvision", "name": "resnet5"}, "name"),                          # refused by the worker
])
def test_a_refused_field_shows_its_error_beside_it(browser, service, fill, control) -> None:
    _open(browser, service.url)
    Select(browser.find_element(By.ID, "source")).select_by_value(fill["source"])
    if "preset" in fill:
        Select(browser.find_element(By.ID, "preset")).select_by_value(fill["preset"])
    else:
        _type(browser, "name", fill["name"])
    if "seq_len" in fill:
        _type(browser, "seq_len", fill["seq_len"])
    _choose_cards(browser, ["T4-16GB"])
    _submit_and_wait(browser, "return document.querySelector('.error:not([hidden])') !== null")
    sent = browser.execute_script("return request()")
    problem = httpx.post(f"{service.url}/estimate", json=sent, timeout=ESTIMATE_WAIT_S).json()
    errors = _visible_errors(browser)
    assert list(errors) == [f"err-{control}"]
    assert errors[f"err-{control}"] == f"got {json.dumps(problem['value'])}; expected {problem['expected']}"
    box = browser.find_element(By.ID, control)
    assert box.get_attribute("aria-invalid") == "true" and box.get_attribute("data-field") == problem["field"]
    assert browser.switch_to.active_element == box  # the focus is on the field to fix
    assert f"err-{control}" in box.get_attribute("aria-describedby").split()
    _screenshot(browser, f"page-error-{control}.png")


def test_the_key_box_sends_the_key(browser) -> None:
    settings = Settings(workers=1, cache_path="", api_keys="s3cret")
    with Served(settings, start_workers=False) as keyed:
        browser.get(keyed.url + "/")  # the page itself needs no key
        browser.execute_script("sessionStorage.clear()")
        browser.get(keyed.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "err-key").is_displayed())
        assert browser.find_elements(By.CSS_SELECTOR, "#gpus option") == []
        key = browser.find_element(By.ID, "key")
        key.send_keys("s3cret", Keys.TAB)  # a change event: stored, the lists loaded again with it
        WebDriverWait(browser, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gpus option"))
        assert not browser.find_element(By.ID, "err-key").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('batchfit-api-key')") == "s3cret"
        browser.refresh()  # kept for the tab: the lists load at once
        WebDriverWait(browser, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#gpus option"))
        assert browser.find_element(By.ID, "key").get_attribute("value") == "s3cret"


@pytest.mark.parametrize("path, rendered", [
    ("/docs", "return document.querySelectorAll('.opblock').length"),        # Swagger UI's operations
    ("/redoc", "return document.querySelectorAll('[data-section-id]').length"),  # ReDoc's sections
])
def test_the_api_docs_render_from_this_origin_alone(browser, service, path, rendered) -> None:
    # what the page's Content-Security-Policy stops before it is requested, heard from the document's start
    watch = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        "window.blocked = []; document.addEventListener('securitypolicyviolation', e => window.blocked.push("
        "[e.blockedURI, e.effectiveDirective]))")})
    try:
        browser.get(service.url + path)
        WebDriverWait(browser, 120).until(lambda d: d.execute_script(rendered) > 3)
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", watch)
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    blocked = {uri for uri, _ in browser.execute_script("return window.blocked")}
    assert f"{service.url}/openapi.json" in loaded
    # every request went to this service; anything else (ReDoc's logo from cdn.redoc.ly) was blocked unsent
    assert {name for name in loaded if not name.startswith(service.url + "/")} <= blocked, (loaded, blocked)
    if path == "/docs":  # POST /estimate opened: its request examples, by name, in Swagger UI's picker
        browser.find_element(By.CSS_SELECTOR, "#operations-default-post_estimate_estimate_post .opblock-summary"
                             ).click()
        picker = WebDriverWait(browser, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#operations-default-post_estimate_estimate_post "
                                                       ".opblock-body select"))
        names = {o.get_attribute("value") for p in picker for o in p.find_elements(By.TAG_NAME, "option")}
        assert set(examples.REQUESTS) <= names and set(examples.RESPONSES) <= names, names
    _screenshot(browser, f"docs{path.replace('/', '-')}.png")
