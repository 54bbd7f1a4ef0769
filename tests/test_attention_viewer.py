"""Tests for llmcli.inspection.viewer: the self-contained page, its behaviour in headless Chromium.

The browser tests drive Debian's `chromium` through `chromedriver` with Selenium (browser_helpers);
they are skipped only where no Chromium (or no chromedriver) is installed. The page's attention
view (axis labels, legend, small multiples) and its grid panels (the run's lens, patching and
attribution results, made by hand in `grid_helpers`) are checked against the data they were
made from.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from browser_helpers import needs_chromium, open_page, severe_messages
from grid_helpers import attribution_result, lens_result, patch_result, write_results

from llmcli.inspection.dump import AttentionDump
from llmcli.inspection.metrics import METRIC_NAMES, head_metrics
from llmcli.inspection.viewer import render_viewer, viewer_data, write_run_page, write_viewer

T = 10
TOKENS = ["T", "o", " ", "b", "e", "<", "/script>", "\n", "é", "&"]
SHOWN = ["T", "o", "␣", "b", "e", "<", "/script>", "↵", "é", "&"]  # how the page writes them
VIRIDIS_LOW, VIRIDIS_HIGH = (68, 1, 84), (253, 231, 37)
# The diverging scale's ends and middle.
BLUE, WHITE, RED = (33, 102, 172), (247, 247, 247), (178, 24, 43)


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
    # The token "</script>" must not end the data element early: the attention data, the grid
    # data and the code are the page's three script elements.
    assert html.count("</script>") == 3


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
    assert any("boom" in e["message"] for e in severe_messages(browser))


@needs_chromium
def test_viewer_loads_without_console_errors(browser, tmp_path) -> None:
    path = write_viewer(make_dump(), tmp_path / "attention.html")
    browser.get(path.resolve().as_uri())
    assert browser.execute_script("return document.body.dataset.ready") == "1"
    assert severe_messages(browser) == []
    from selenium.webdriver.common.by import By

    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert [s.text for s in spans][:5] == ["T", "o", "␣", "b", "e"]
    assert spans[6].text == "/script>"
    rows = browser.find_elements(By.CSS_SELECTOR, "#metrics tr")
    assert len(rows) == 1 + 3  # header + one row per head


@needs_chromium
def test_switching_head_and_layer_changes_the_picture(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
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
    assert severe_messages(browser) == []


@needs_chromium
def test_clicking_a_token_highlights_its_row(browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    dump = make_dump()
    open_page(browser, write_viewer(dump, tmp_path / "attention.html"))
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
    assert severe_messages(browser) == []


@needs_chromium
def test_hovering_shows_where_a_token_attends(browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    open_page(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
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
    assert severe_messages(browser) == []


# ------------------------------------------------------------------ axes, legend, small multiples


def uniform_dump(n: int) -> AttentionDump:
    """One layer of one uniform head over `n` tokens "t0", "t1", ..."""
    attn = uniform(n)[None, None].astype(np.float32)  # (1, 1, n, n)
    return AttentionDump(
        attn=attn,
        tokens=[f"t{i}" for i in range(n)],
        token_ids=np.arange(n),
        metrics=head_metrics(attn),
        metric_names=list(METRIC_NAMES),
        layers=[0],
        heads=[0],
    )


_LABEL_GEOMETRY = """
const c = arguments[0], frame = arguments[1];
const r = c.getBoundingClientRect();
const centre = e => {
  const b = e.getBoundingClientRect();
  return [b.left + b.width / 2, b.top + b.height / 2, e.textContent, Number(e.dataset.index)];
};
return {left: r.left + c.clientLeft, top: r.top + c.clientTop,
        right: r.left + c.clientLeft + c.clientWidth, bottom: r.top + c.clientTop + c.clientHeight,
        rows: [...frame.querySelectorAll('.yl')].map(centre),
        cols: [...frame.querySelectorAll('.xl')].map(centre)};
"""


def _label_geometry(browser, canvas, frame) -> dict:
    """Where the cells are, and each row and column label's centre, text and index."""
    return browser.execute_script(_LABEL_GEOMETRY, canvas, frame)


def _assert_labels_on_cells(geo: dict, n_rows: int, n_cols: int) -> None:
    cell_h = (geo["bottom"] - geo["top"]) / n_rows
    cell_w = (geo["right"] - geo["left"]) / n_cols
    for x, y, _, q in geo["rows"]:
        assert abs(y - (geo["top"] + (q + 0.5) * cell_h)) <= 1, (q, y)
        assert x < geo["left"]  # left of the cells
    for x, y, _, k in geo["cols"]:
        assert abs(x - (geo["left"] + (k + 0.5) * cell_w)) <= 1, (k, x)
        assert y < geo["top"]  # above the cells


@needs_chromium
def test_axis_labels_sit_on_their_rows_and_columns(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
    canvas = browser.find_element(By.ID, "heatmap")
    geo = _label_geometry(browser, canvas, browser.find_element(By.ID, "matrix"))
    assert [r[2] for r in geo["rows"]] == SHOWN and [r[3] for r in geo["rows"]] == list(range(T))
    assert [c[2] for c in geo["cols"]] == SHOWN
    _assert_labels_on_cells(geo, T, T)
    # A hovered cell lights its query's and its key's labels.
    size = canvas.size["width"]
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element_with_offset(
        canvas, int((2.5 / T - 0.5) * size), int((6.5 / T - 0.5) * size)
    ).perform()
    lit = browser.find_elements(By.CSS_SELECTOR, "#matrix .hl")
    classes = sorted((set(e.get_attribute("class").split()), e.text) for e in lit)
    assert classes == [({"xl", "hl"}, "␣"), ({"yl", "hl", "active"}, "/script>")]
    assert severe_messages(browser) == []


@needs_chromium
def test_many_tokens_thin_the_labels_which_stay_on_their_cells(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    n = 96  # cells of 7 px: every second label, each still on its own row and column
    open_page(browser, write_viewer(uniform_dump(n), tmp_path / "attention.html"))
    geo = _label_geometry(
        browser, browser.find_element(By.ID, "heatmap"), browser.find_element(By.ID, "matrix")
    )
    assert [r[3] for r in geo["rows"]] == list(range(0, n, 2))
    assert [c[3] for c in geo["cols"]] == list(range(0, n, 2))
    assert [r[2] for r in geo["rows"]] == [f"t{i}" for i in range(0, n, 2)]
    _assert_labels_on_cells(geo, n, n)
    ys = [r[1] for r in geo["rows"]]
    assert min(np.diff(ys)) >= 9  # no two labels closer than a small font
    assert severe_messages(browser) == []


def _legend(browser, root: str = "#legend") -> tuple[list[str], tuple, tuple]:
    """A legend's tick texts (low, middle, high) and its bar's colours at the top and bottom."""
    return browser.execute_script(
        "const l = document.querySelector(arguments[0]);"
        "const bar = l.querySelector('.legend-bar'), c = bar.getContext('2d');"
        "const px = y => Array.from(c.getImageData(5, y, 1, 1).data.slice(0, 3));"
        "return [['.lo', '.mid', '.hi'].map(s => l.querySelector(s).textContent),"
        "        px(0), px(bar.height - 1)];",
        root,
    )


@needs_chromium
def test_the_legend_shows_the_colour_scale_and_its_ends(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
    ticks, top, bottom = _legend(browser)
    assert ticks == ["0", "0.5", "1"]
    assert tuple(top) == VIRIDIS_HIGH and tuple(bottom) == VIRIDIS_LOW
    assert "attention weight" in browser.find_element(By.ID, "legend").text
    browser.find_element(By.ID, "rowscale").click()
    assert _legend(browser)[0] == ["0", "0.5", "row max"]
    assert severe_messages(browser) == []


def _thumb_pixel(browser, layer: int, head, q: int, k: int) -> tuple[int, int, int]:
    return tuple(
        browser.execute_script(
            "const c = document.querySelector("
            "  `.thumb[data-layer='${arguments[0]}'][data-head='${arguments[1]}'] canvas`);"
            "return Array.from(c.getContext('2d').getImageData(arguments[3], arguments[2], 1, 1)"
            "  .data.slice(0, 3));",
            layer,
            str(head),
            q,
            k,
        )
    )


@needs_chromium
def test_small_multiples_show_every_head_and_a_click_opens_it_large(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, write_viewer(make_dump(), tmp_path / "attention.html"))
    # This layer's heads (0: previous-token, 1: sink, 3: uniform) and their mean.
    heads = browser.find_elements(By.CSS_SELECTOR, "#multiples .thumb.head")
    assert [h.text for h in heads] == ["0.0", "0.1", "0.3"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#multiples .thumb.mean")) == 1
    assert _thumb_pixel(browser, 0, 0, 3, 2) == VIRIDIS_HIGH  # previous token
    assert _thumb_pixel(browser, 0, 0, 3, 0) == VIRIDIS_LOW
    assert _thumb_pixel(browser, 0, 1, 3, 0) == VIRIDIS_HIGH  # sink
    assert _thumb_pixel(browser, 0, 2, 2, 5) == (255, 255, 255)  # above the diagonal
    # Every layer: L x H head maps, one row per layer.
    _select(browser, "scope", "all")
    heads = browser.find_elements(By.CSS_SELECTOR, "#multiples .thumb.head")
    assert len(heads) == 2 * 3
    assert [h.text for h in heads] == ["0.0", "0.1", "0.3", "2.0", "2.1", "2.3"]
    assert _thumb_pixel(browser, 1, 2, 3, 2) == VIRIDIS_HIGH  # layer 2 head 3: previous token
    # Clicking one opens it large and selects it in the controls and the metrics table.
    browser.find_element(By.CSS_SELECTOR, ".thumb[data-layer='1'][data-head='2']").click()
    canvas = browser.find_element(By.ID, "heatmap")
    assert (canvas.get_attribute("data-layer"), canvas.get_attribute("data-head")) == ("2", "3")
    assert browser.execute_script("return document.getElementById('layer').value") == "1"
    assert browser.execute_script("return document.getElementById('head').value") == "2"
    assert _pixel(browser, 3, 2) == VIRIDIS_HIGH and _pixel(browser, 3, 0) == VIRIDIS_LOW
    selected = browser.find_elements(By.CSS_SELECTOR, "#multiples .thumb.selected")
    assert [s.text for s in selected] == ["2.3"]
    current = browser.find_element(By.CSS_SELECTOR, "#metrics tr.current td")
    assert current.text == "3"
    # The mean of the layer's heads.
    browser.find_element(By.CSS_SELECTOR, ".thumb.mean[data-layer='0']").click()
    assert canvas.get_attribute("data-head") == "mean" and canvas.get_attribute("data-layer") == "0"
    mean = make_dump().attn[0].mean(0)
    assert _pixel(browser, 1, 0) == _thumb_pixel(browser, 0, "mean", 1, 0)
    assert mean[1, 0] == pytest.approx((1 + 0.5 + 1) / 3)
    assert severe_messages(browser) == []


# ------------------------------------------------------------------ the run's grids


def _hover_cell(browser, canvas, r: int, c: int, n_rows: int, n_cols: int) -> None:
    """Move the mouse to the centre of cell (r, c) of a bordered canvas of cells."""
    from selenium.webdriver.common.action_chains import ActionChains

    # Offsets count from the centre of the element's visible part: show all of it first.
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    w, h = canvas.size["width"], canvas.size["height"]  # the border box: 1 px each side
    x = 1 + (c + 0.5) * (w - 2) / n_cols - w / 2  # offsets from the element's centre
    y = 1 + (r + 0.5) * (h - 2) / n_rows - h / 2
    ActionChains(browser).move_to_element_with_offset(canvas, round(x), round(y)).perform()


def _cell_colour(browser, canvas, r: int, c: int, n_rows: int, n_cols: int) -> tuple:
    return tuple(
        browser.execute_script(
            "const c = arguments[0], x = Math.floor((arguments[2] + 0.5) * c.width / arguments[4]);"
            "const y = Math.floor((arguments[1] + 0.5) * c.height / arguments[3]);"
            "return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3));",
            canvas,
            r,
            c,
            n_rows,
            n_cols,
        )
    )


def _read_out(browser, panel, r: int, c: int, n_rows: int, n_cols: int) -> tuple[str, dict]:
    from selenium.webdriver.common.by import By

    _hover_cell(browser, panel.find_element(By.TAG_NAME, "canvas"), r, c, n_rows, n_cols)
    readout = panel.find_element(By.CSS_SELECTOR, ".readout")
    data = {k: readout.get_attribute(f"data-{k}") for k in ("row", "col", "value")}
    return readout.text, data


@needs_chromium
def test_grid_panels_draw_the_runs_results_with_a_hover_read_out(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    patch = patch_result()
    patch["attn_out"][0][0], patch["mlp_out"][1][1] = 0.0, -1.0
    run = write_results(tmp_path / "run", patch=patch)
    open_page(browser, write_run_page(run, tmp_path / "page.html", make_dump()))
    panels = browser.find_elements(By.CSS_SELECTOR, "#grids .grid-panel")
    assert [p.get_attribute("id") for p in panels] == [
        "grid-lens",
        "grid-patch-resid_pre",
        "grid-patch-attn_out",
        "grid-patch-mlp_out",
        "grid-patch-head_out",
        "grid-attribution",
    ]
    lens_panel, resid, attn_out, mlp_out, head_out, attr_panel = panels

    # The lens: boundary x position, sequential; labels on their cells.
    lens = lens_result()
    logprobs = np.array(lens["logprobs"])
    geo = _label_geometry(browser, lens_panel.find_element(By.TAG_NAME, "canvas"), lens_panel)
    assert [r[2] for r in geo["rows"]] == ["embed", "0", "1"]
    assert [c[2] for c in geo["cols"]] == ["R", "O", "␣", "M"]
    _assert_labels_on_cells(geo, 3, 4)
    text, data = _read_out(browser, lens_panel, 1, 2, 3, 4)
    v = logprobs[1, 2]
    notes = 'next "M", top "M", row\'s mean loss 3.2500'  # tokens[3], top_tokens[1][2], loss[1]
    assert text == f"after layer 0 · position 2 “␣”: {v:.4f}  ({notes})"
    assert (data["row"], data["col"]) == ("1", "2")
    assert float(data["value"]) == pytest.approx(v, abs=1e-5)
    canvas = lens_panel.find_element(By.TAG_NAME, "canvas")
    lo, hi = (
        tuple(int(i) for i in np.unravel_index(arg, logprobs.shape))
        for arg in (logprobs.argmin(), logprobs.argmax())
    )
    assert _cell_colour(browser, canvas, *lo, 3, 4) == VIRIDIS_LOW
    assert _cell_colour(browser, canvas, *hi, 3, 4) == VIRIDIS_HIGH
    assert lens_panel.find_element(By.CSS_SELECTOR, ".legend-title").text == "log-prob"
    assert "from lens/lens.json" in lens_panel.find_element(By.CSS_SELECTOR, ".axes").text
    root = "#grid-lens .legend"
    assert _legend(browser, root)[0] == [
        f"{logprobs.min():.2f}",
        f"{(logprobs.min() + logprobs.max()) / 2:.2f}",
        f"{logprobs.max():.2f}",
    ]

    # Patching: diverging from -1 (blue) through 0 (white) to 1 (red).
    assert _cell_colour(browser, resid.find_element(By.TAG_NAME, "canvas"), 0, 4, 2, 5) == RED
    assert _cell_colour(browser, attn_out.find_element(By.TAG_NAME, "canvas"), 0, 0, 2, 5) == WHITE
    assert _cell_colour(browser, mlp_out.find_element(By.TAG_NAME, "canvas"), 1, 1, 2, 5) == BLUE
    assert _legend(browser, "#grid-patch-resid_pre .legend")[0] == ["-1.00", "0.00", "1.00"]
    text, _ = _read_out(browser, mlp_out, 1, 3, 2, 5)
    assert text == f"layer 1 · position 3 “M”: {patch['mlp_out'][1][3]:.4f}"
    text, _ = _read_out(browser, head_out, 1, 2, 2, 3)
    assert text == f"layer 1 · head 2: {patch['head_out'][1][2]:.4f}"
    assert "clean +2.5000, corrupt -1.2500" in resid.text

    # Attribution: each head, then the MLP.
    attr = attribution_result()
    text, data = _read_out(browser, attr_panel, 0, 3, 2, 4)
    assert text == f"layer 0 · MLP: {attr['mlp'][0]:.4f}" and data["col"] == "3"
    text, _ = _read_out(browser, attr_panel, 1, 1, 2, 4)
    assert text == f"layer 1 · head 1: {attr['heads'][1][1]:.4f}"
    bound = max(abs(v) for v in [*np.ravel(attr["heads"]), *attr["mlp"]])
    assert _legend(browser, "#grid-attribution .legend")[0] == [
        f"{-bound:.2f}",
        "0.00",
        f"{bound:.2f}",
    ]
    assert "embed +0.2500" in attr_panel.text
    # The attention view is there too, and the page's links lead to each part.
    assert browser.find_element(By.ID, "attention-section").is_displayed()
    links = [
        a.get_attribute("href").split("#")[1]
        for a in browser.find_elements(By.CSS_SELECTOR, "nav a")
    ]
    assert links == ["attention-section", *(p.get_attribute("id") for p in panels)]
    assert severe_messages(browser) == []


@needs_chromium
def test_a_malformed_result_is_skipped_and_a_page_may_hold_grids_alone(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    attr = attribution_result()
    attr["heads"] = [[0.1, 0.2], [0.3]]
    run = write_results(tmp_path / "run", lens="{oops", attribute=attr)
    notes: list[str] = []
    open_page(browser, write_run_page(run, notify=notes.append))
    assert len(notes) == 2 and "lens.json" in notes[0] and "attribution.json" in notes[1]
    panels = browser.find_elements(By.CSS_SELECTOR, "#grids .grid-panel")
    assert [p.get_attribute("id") for p in panels] == [
        f"grid-patch-{key}" for key in ("resid_pre", "attn_out", "mlp_out", "head_out")
    ]
    assert not browser.find_element(By.ID, "attention-section").is_displayed()
    assert browser.execute_script("return document.body.dataset.ready") == "1"
    assert severe_messages(browser) == []
