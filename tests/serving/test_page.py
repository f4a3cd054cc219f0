"""The credit page in a real headless Chromium (Debian's chromium and chromium-driver, Selenium)
against real servers. A screenshot is saved under test-artifacts/ (not committed)."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.serving.server import Server, running

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TEXT = "The first sentence is short. The second one, however, has rather more words in it!"


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are needed (the README's test command " \
                                "installs them)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1800"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    b = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        yield b
    finally:
        b.quit()


def rgb(style: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.findall(r"\d+", style)[:3])
    return r, g, b


def wait(b: WebDriver, condition: Callable[[WebDriver], object], timeout: float = 30) -> object:
    return WebDriverWait(b, timeout).until(condition)


def open_page(b: WebDriver, server: Server) -> None:
    b.get(f"{server.url}/")
    wait(b, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option") or d.find_element(By.ID, "error").text)


def submit(b: WebDriver, text: str) -> None:
    b.execute_script("document.getElementById('text').value = arguments[0];", text)
    b.find_element(By.ID, "explain").click()
    wait(b, lambda d: d.find_element(By.ID, "error").text or (
        d.find_element(By.ID, "output").is_displayed() and not d.find_element(By.ID, "status").text))


def test_page_shows_label_words_coloured_by_credit_and_the_depth_heatmap(tiny: Server, browser: WebDriver) -> None:
    b = browser
    open_page(b, tiny)
    assert [o.get_attribute("value") for o in b.find_elements(By.CSS_SELECTOR, "#model option")] == ["tiny"]
    submit(b, TEXT)
    severe = [e for e in b.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe  # no console errors while loading and explaining
    ref = httpx.post(f"{tiny.url}/v1/models/tiny/explain", json={"inputs": [TEXT], "target": "all"}).json()
    res = ref["results"][0]
    assert b.find_element(By.ID, "label").text == res["label"]
    bars = b.find_elements(By.CSS_SELECTOR, "#bars .bar")
    assert [bar.get_attribute("data-label") for bar in bars] == ["alpha", "beta", "gamma"]

    def check(label: str) -> list[str]:
        spans = b.find_elements(By.CSS_SELECTOR, "#rendered .word")
        words = res["credit"][label]["words"]
        assert [s.text for s in spans] == [w["text"] for w in words]  # one span per word
        colours = []
        for s, w in zip(spans, words, strict=True):
            assert float(s.get_attribute("data-credit")) == pytest.approx(w["credit"], abs=1e-9)
            r, _, blue = rgb(s.value_of_css_property("background-color"))
            if abs(w["credit"]) > 1e-6:
                assert (blue > r) == (w["credit"] > 0), (w, r, blue)  # blue for credit above 0, red below
            assert w["text"] in s.get_attribute("title") and "credit" in s.get_attribute("title")
            colours.append(s.value_of_css_property("background-color"))
        return colours

    before = check(res["label"])
    other = next(lab for lab in ("alpha", "beta", "gamma") if lab != res["label"])
    b.find_element(By.CSS_SELECTOR, f"#targets button[data-label='{other}']").click()
    after = check(other)
    assert after != before  # switching the label re-colours the words
    canvas = b.find_element(By.ID, "heatmap")
    assert int(canvas.get_attribute("data-rows")) == len(res["tokens"]) and canvas.get_attribute("data-cols") == "3"
    assert len(b.find_elements(By.CSS_SELECTOR, "#sentences .sentence")) == 2  # sentence totals
    ARTIFACTS.mkdir(exist_ok=True)
    b.save_screenshot(str(ARTIFACTS / "credit-page.png"))


def test_the_page_draws_end_to_end_credit_when_asked(tiny: Server, browser: WebDriver) -> None:
    """Picking end-to-end credit explains the text again with it: the words carry the API's end-to-end credit, the
    legend says what the numbers are, the heatmap's note what its columns mean."""
    b = browser
    open_page(b, tiny)
    submit(b, TEXT)
    value_path = [s.get_attribute("data-credit") for s in b.find_elements(By.CSS_SELECTOR, "#rendered .word")]
    Select(b.find_element(By.ID, "method")).select_by_value("end_to_end")
    wait(b, lambda d: "input tokens" in d.find_element(By.ID, "legend").text)
    ref = httpx.post(f"{tiny.url}/v1/models/tiny/explain", json={"inputs": [TEXT], "target": "all",
                                                                  "method": "end_to_end"}).json()["results"][0]
    words = ref["credit"][ref["label"]]["words"]
    spans = b.find_elements(By.CSS_SELECTOR, "#rendered .word")
    assert [float(s.get_attribute("data-credit")) for s in spans] == pytest.approx([w["credit"] for w in words],
                                                                                   abs=1e-9)
    assert [s.get_attribute("data-credit") for s in spans] != value_path
    assert "depth through which the head reads" in b.find_element(By.ID, "columns").text
    assert not [e for e in b.get_log("browser") if e["level"] == "SEVERE"]


def test_an_over_long_text_shows_the_413_message(tiny: Server, browser: WebDriver) -> None:
    open_page(browser, tiny)
    submit(browser, "word " * 500)  # 2,500 characters: over this server's limit of 2,000
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and error.text.startswith("Too large for this server") and "2000" in error.text


def test_api_key_typed_into_the_page_and_a_20000_character_text(keyed: Server, browser: WebDriver) -> None:
    b = browser
    open_page(b, keyed)
    assert "needs an API key" in b.find_element(By.ID, "error").text  # 401 has a readable message
    b.find_element(By.ID, "key").send_keys("second-key")
    b.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait(b, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    article = ("A long article keeps going with many sentences of plain words. " * 320)[:20000]
    t0 = time.monotonic()
    submit(b, article)
    assert not b.find_element(By.ID, "error").text
    n_words = len(b.find_elements(By.CSS_SELECTOR, "#rendered .word"))
    assert n_words > 3000
    t1 = time.monotonic()
    assert b.execute_script("return 1 + 1") == 2  # the tab still answers
    assert time.monotonic() - t1 < 2 and t1 - t0 < 60, (t1 - t0)
    assert "second-key" not in b.current_url
    assert b.execute_script("return window.localStorage.length + window.sessionStorage.length") == 0


def test_several_models_explain_the_text_in_one_request(tiny_backbone_dir: Path, tmp_path: Path, logs: Path,
                                                        browser: WebDriver) -> None:
    """Two models picked: one request to /v1/explain, and a switch between the models' answers."""
    from tests.conftest import write_tiny_model

    write_tiny_model(tmp_path, tiny_backbone_dir, name="tiny")
    write_tiny_model(tmp_path, tiny_backbone_dir, name="tiny-b", seed=1, labels=["up", "down"])
    for server in running(logs, model_repository=tmp_path, default_model="tiny"):
        b = browser
        open_page(b, server)
        b.execute_script("for (const o of document.getElementById('model').options) o.selected = true;")
        submit(b, TEXT)
        assert not b.find_element(By.ID, "error").text
        answered = b.find_elements(By.CSS_SELECTOR, "#answered button")
        assert [a.get_attribute("data-model") for a in answered] == ["tiny", "tiny-b"]
        refs = {m: httpx.post(f"{server.url}/v1/models/{m}/explain", json={"inputs": [TEXT]}).json()["results"][0]
                for m in ("tiny", "tiny-b")}
        assert b.find_element(By.ID, "label").text == refs["tiny"]["label"]
        answered[1].click()
        assert b.find_element(By.ID, "label").text == refs["tiny-b"]["label"]
        bars = b.find_elements(By.CSS_SELECTOR, "#bars .bar")
        assert [bar.get_attribute("data-label") for bar in bars] == ["up", "down"]


def test_a_server_without_models_says_so_and_the_page_lists_the_first_when_it_comes(
        tiny_backbone_dir: Path, tmp_path: Path, logs: Path, browser: WebDriver) -> None:
    """Started on an empty repository (poll mode), the page says no model is loaded and asks again until one is."""
    from tests.conftest import write_tiny_model

    repo = tmp_path / "models"
    repo.mkdir()
    for server in running(logs, model_repository=repo, model_control="poll", repository_poll_s=0.2):
        b = browser
        open_page(b, server)
        assert "No model is loaded yet" in b.find_element(By.ID, "error").text
        assert not b.find_elements(By.CSS_SELECTOR, "#model option")
        write_tiny_model(repo, tiny_backbone_dir, name="tiny")
        wait(b, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), timeout=120)  # its backbone starts first
        assert [o.get_attribute("value") for o in b.find_elements(By.CSS_SELECTOR, "#model option")] == ["tiny"]
        assert not b.find_element(By.ID, "error").text  # the message gone with the model's arrival
        submit(b, TEXT)
        assert not b.find_element(By.ID, "error").text and b.find_element(By.ID, "label").text
