"""Tests for llmcli.inspection.viewer: the self-contained page, its behaviour in headless Chromium.

The browser tests drive Debian's `chromium` through `chromedriver` with Selenium; they are skipped
only where no Chromium (or no chromedriver) is installed.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile

import numpy as np
import pytest

from llmcli.inspection.dump import AttentionDump
from llmcli.inspection.metrics import METRIC_NAMES, head_metrics
from llmcli.inspection.viewer import render_viewer, viewer_data, write_viewer

T = 10
TOKENS = ["T", "o", " ", "b", "e", "<", "/script>", "\n", "é", "&"]
VIRIDIS_LOW, VIRIDIS_HIGH = (68, 1, 84), (253, 231, 37)


def previous(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[0, 0] = 1.0
    a[np.arange(1, T), np.arange(T - 1)] = 1.0
    return a


def sink(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[:, 0] = 1.0
    return a


def uniform(T: int) -> np.ndarray:
    a = np.tril(np.ones((T, T)))
    return a / a.sum(-1, keepdims=True)


def make_dump() -> AttentionDump:
    """Layer 0: heads previous-token, sink, uniform; layer 2: sink, uniform, previous-token."""
    attn = np.stack(
        [
            np.stack([previous(T), sink(T), uniform(T)]),
            np.stack([sink(T), uniform(T), previous(T)]),
        ]
    ).astype(np.float32)  # (2, 3, T, T)
    return AttentionDump(
        attn=attn,
        tokens=TOKENS,
        token_ids=np.arange(T),
        metrics=head_metrics(attn),
        metric_names=list(METRIC_NAMES),
        layers=[0, 2],
        heads=[0, 1, 3],
        meta={"checkpoint": "/runs/x", "prompt": "".join(TOKENS)},
    )


# ------------------------------------------------------------------ the page, without a browser


def test_page_is_self_contained() -> None:
    html = render_viewer(make_dump())
    assert "__ATTENTION_DATA__" not in html
    assert not re.search(r"<script[^>]*\bsrc=", html)
    assert not re.search(r"<link\b", html)
    assert "http://" not in html and "https://" not in html
    # The token "</script>" must not end the data element early.
    assert html.count("</script>") == 2


def test_inlined_data_round_trips() -> None:
    dump = make_dump()
    html = render_viewer(dump)
    raw = re.search(
        r'<script type="application/json" id="attention-data">(.*?)</script>', html, re.S
    ).group(1)
    data = json.loads(raw)
    assert data["tokens"] == TOKENS
    assert data["layers"] == [0, 2] and data["heads"] == [0, 1, 3]
    tri = np.frombuffer(base64.b64decode(data["attn_b64"]), dtype="<f4").reshape(2, 3, -1)
    rows, cols = np.tril_indices(T)
    np.testing.assert_array_equal(tri, dump.attn[..., rows, cols])
    assert data == viewer_data(dump)


# ------------------------------------------------------------------ the page in headless Chromium


def _find_chromium() -> tuple[str, str] | None:
    browser = next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


CHROMIUM = _find_chromium()


def needs_chromium(test):
    """A browser test: slow, and skipped where Chromium is not installed."""
    return pytest.mark.slow(
        pytest.mark.skipif(CHROMIUM is None, reason="Chromium/chromedriver not installed")(test)
    )


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = CHROMIUM
    profile = tempfile.mkdtemp(prefix="llmcli-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _open(browser, path) -> None:
    browser.get(path.resolve().as_uri())
    browser.get_log("browser")  # drain: the caller reads only this page's messages


def _severe(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _pixel(browser, q: int, k: int) -> tuple[int, int, int]:
    """The colour at the centre of heatmap cell (query q, key k)."""
    return tuple(
        browser.execute_script(
            "const c = document.getElementById('heatmap'), T = arguments[2];"
            "const cell = c.width / T;"
            "const d = c.getContext('2d').getImageData("
            "  Math.floor((arguments[1] + 0.5) * cell),"
            "  Math.floor((arguments[0] + 0.5) * cell), 1, 1"
            ").data; return [d[0], d[1], d[2]];",
            q,
            k,
            T,
        )
    )


def _canvas_url(browser) -> str:
    return browser.execute_script("return document.getElementById('heatmap').toDataURL();")


def _move_away(browser) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ActionChains(browser).move_to_element(browser.find_element(By.TAG_NAME, "h1")).perform()


def _select(browser, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, element_id)).select_by_value(value)


@needs_chromium
def test_console_errors_are_detected(browser, tmp_path) -> None:
    # The check below is only worth something if a failing page would be caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom');</script></body></html>")
    browser.get(bad.resolve().as_uri())
    assert any("boom" in e["message"] for e in _severe(browser))


@needs_chromium
def test_viewer_loads_without_console_errors(browser, tmp_path) -> None:
    path = write_viewer(make_dump(), tmp_path / "attention.html")
    browser.get(path.resolve().as_uri())
    assert browser.execute_script("return document.body.dataset.ready") == "1"
    assert _severe(browser) == []
    from selenium.webdriver.common.by import By

    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert [s.text for s in spans][:5] == ["T", "o", "␣", "b", "e"]
    assert spans[6].text == "/script>"
    rows = browser.find_elements(By.CSS_SELECTOR, "#metrics tr")
    assert len(rows) == 1 + 3  # header + one row per head


@needs_chromium
def test_switching_head_and_layer_changes_the_picture(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
    # Layer 0 head 0 is a previous-token head: cell (3, 2) is 1, cell (3, 0) is 0.
    assert _pixel(browser, 3, 2) == VIRIDIS_HIGH and _pixel(browser, 3, 0) == VIRIDIS_LOW
    before = _canvas_url(browser)
    _select(browser, "head", "1")  # sink head
    assert _canvas_url(browser) != before
    assert _pixel(browser, 3, 2) == VIRIDIS_LOW and _pixel(browser, 3, 0) == VIRIDIS_HIGH
    assert browser.execute_script("return document.getElementById('heatmap').dataset.head") == "1"
    _select(browser, "layer", "1")  # layer 2, head 1 (index 1) is uniform: cell (0, 0) is 1
    assert _pixel(browser, 0, 0) == VIRIDIS_HIGH
    assert _pixel(browser, 1, 0) not in (VIRIDIS_HIGH, VIRIDIS_LOW)
    assert _pixel(browser, 1, 5) == (255, 255, 255)  # above the diagonal: blank
    # Scaling each row to its maximum paints a uniform row at full colour.
    browser.find_element(By.ID, "rowscale").click()
    assert _pixel(browser, 1, 0) == VIRIDIS_HIGH and _pixel(browser, 7, 3) == VIRIDIS_HIGH
    assert _severe(browser) == []


@needs_chromium
def test_clicking_a_token_highlights_its_row(browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    dump = make_dump()
    _open(browser, write_viewer(dump, tmp_path / "attention.html"))
    _select(browser, "head", "2")  # layer 0, head 3: uniform
    before = _canvas_url(browser)
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    # Move the mouse away first so only the click decides the highlighted row.
    ActionChains(browser).move_to_element(spans[5]).click().perform()
    _move_away(browser)
    canvas = browser.find_element(By.ID, "heatmap")
    assert canvas.get_attribute("data-row") == "5"
    assert "selected" in spans[5].get_attribute("class").split()
    assert sum("selected" in s.get_attribute("class").split() for s in spans) == 1
    assert _canvas_url(browser) != before
    # The row outline is drawn in red across the row.
    red = browser.execute_script(
        "const c = document.getElementById('heatmap'), cell = c.width / arguments[0];"
        "const d = c.getContext('2d').getImageData(Math.floor(c.width / 2),"
        "  Math.floor(5 * cell + 1), 1, 1).data; return [d[0], d[1], d[2]];",
        T,
    )
    assert red == [255, 42, 42]
    # Each key token shows the weight the clicked query gives it.
    weights = [s.get_attribute("data-weight") for s in spans]
    np.testing.assert_allclose([float(w) for w in weights[:6]], dump.attn[0, 2, 5, :6], atol=1e-6)
    assert weights[6:] == [""] * (T - 6)  # keys after the query get nothing
    assert "query 5" in browser.find_element(By.ID, "row-info").text
    # Mean of heads: the tokens show the head-averaged row.
    _select(browser, "head", "mean")
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    mean_row = dump.attn[0].mean(0)[5, :6]
    np.testing.assert_allclose(
        [float(s.get_attribute("data-weight")) for s in spans[:6]], mean_row, atol=1e-6
    )
    # A second click unpins.
    spans[5].click()
    _move_away(browser)
    assert canvas.get_attribute("data-row") == ""
    assert _severe(browser) == []


@needs_chromium
def test_hovering_shows_where_a_token_attends(browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    _open(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    ActionChains(browser).move_to_element(spans[4]).perform()
    canvas = browser.find_element(By.ID, "heatmap")
    assert canvas.get_attribute("data-row") == "4"
    assert spans[3].get_attribute("data-weight") == "1.000000"  # previous-token head
    # Hovering a heatmap cell reads out its weight.
    size = canvas.size["width"]
    ActionChains(browser).move_to_element_with_offset(
        canvas, int((2.5 / T - 0.5) * size), int((3.5 / T - 0.5) * size)
    ).perform()
    assert "query 3" in browser.find_element(By.ID, "tooltip").text
    assert browser.find_element(By.ID, "tooltip").text.endswith("1.0000")
    assert _severe(browser) == []
