"""CORS (ROUTING_CORS_ORIGINS): off by default; a listed origin's preflight is answered and its requests carry the
headers a browser needs, another origin's are refused; credentials are never allowed. Then the same in a real
headless Chromium: a page on a listed origin fetches a classification, a page on another origin cannot."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.remote.webdriver import WebDriver

from service.bench.server import free_port
from tests.serving.server import Server, running
from tests.serving.test_page import browser  # noqa: F401  (the fixture)
from tests.serving.test_tokenize_once import started

LISTED = "https://app.example.com"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}


def test_off_by_default_no_cors_headers(tiny_repo: Path) -> None:
    for c, _ in started(tiny_repo):
        r = c.post("/v1/classify", json={"inputs": ["hi"]}, headers={"Origin": LISTED})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        pre = c.options("/v1/classify", headers={"Origin": LISTED, **PREFLIGHT})
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers


def test_a_listed_origin_is_allowed_without_credentials_and_another_is_not(tiny_repo: Path) -> None:
    for c, _ in started(tiny_repo, cors_origins=[LISTED], api_keys=["k1"]):
        c: TestClient
        pre = c.options("/v1/classify", headers={"Origin": LISTED, **PREFLIGHT})  # no key needed to ask
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == LISTED
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                     pre.headers["access-control-allow-headers"].split(",")}
        assert "access-control-allow-credentials" not in pre.headers
        r = c.post("/v1/classify", json={"inputs": ["hi"]}, headers={"Origin": LISTED, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == LISTED
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        unauth = c.post("/v1/classify", json={"inputs": ["hi"]}, headers={"Origin": LISTED})
        assert unauth.status_code == 401 and unauth.headers["access-control-allow-origin"] == LISTED  # readable
        other = c.options("/v1/classify", headers={"Origin": "https://evil.example.com", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        plain = c.post("/v1/classify", json={"inputs": ["hi"]},
                       headers={"Origin": "https://evil.example.com", "Authorization": "Bearer k1"})
        assert "access-control-allow-origin" not in plain.headers  # the browser will not let the page read it


def test_a_misspelt_origin_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    for bad in ("app.example.com", "https://app.example.com/", "https://app.example.com/path"):
        with pytest.raises(ValidationError, match="scheme://host"):
            Settings(cors_origins=bad)


PAGE = b"<!doctype html><title>caller</title><p>a page on another origin</p>"


@pytest.fixture(scope="module")
def origins() -> Iterator[list[str]]:
    """Two static sites on this machine, each its own origin (another port)."""
    sites = []
    for _ in range(2):
        site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Quiet)
        threading.Thread(target=site.serve_forever, daemon=True).start()
        sites.append(site)
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in sites]
    finally:
        for s in sites:
            s.shutdown()


class _Quiet(http.server.BaseHTTPRequestHandler):
    """Every path: the same small page."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def cors_server(tiny_repo: Path, origins: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running(tmp_path_factory.mktemp("logs-cors"), model_repository=tiny_repo, default_model="tiny",
                       cors_origins=origins[0])


FETCH = """
const done = arguments[arguments.length - 1];
fetch(arguments[0] + "/v1/classify", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({inputs: ["a cross-origin call"]})})
  .then(r => r.json()).then(j => done("label:" + j.results[0].label)).catch(e => done("failed:" + e));
"""


def test_chromium_fetches_from_a_listed_origin_and_not_from_another(browser: WebDriver,  # noqa: F811
                                                                   cors_server: Server, origins: list[str]) -> None:
    browser.set_script_timeout(30)
    browser.get(origins[0] + "/")
    assert browser.execute_async_script(FETCH, cors_server.url) in {"label:alpha", "label:beta", "label:gamma"}
    browser.get(origins[1] + "/")
    said = browser.execute_async_script(FETCH, cors_server.url)
    assert said.startswith("failed:") and "Failed to fetch" in said, said
