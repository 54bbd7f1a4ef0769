"""`llmcli.inspection.sae.features` and its page: the top contexts against a search of every
token, the density against a count, the logit effect against the unembedding written out, and the
page."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from browser_helpers import needs_chromium, open_page, severe_messages
from sae_helpers import HOOK, small_run, trained_sae

from llmcli.errors import InputError
from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
from llmcli.inspection.sae.evaluate import ReadOptions
from llmcli.inspection.sae.features import Context, context_line, feature_report, format_features
from llmcli.inspection.sae.folder import load_sae
from llmcli.inspection.sae.page import render_features_page, write_features_page
from llmcli.inspection.sae.points import read_activations
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = {"steps": 3, "batch_size": 4, "device": "cpu"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    return trained_sae(run, tmp_path_factory.mktemp("sae") / "sae", steps=10)


@pytest.fixture(scope="module")
def report(folder):
    return feature_report(ReadOptions(sae=folder, **OPTIONS), top=3)


def every_activation(run, folder) -> tuple[np.ndarray, np.ndarray]:
    """Each scored token's id and the SAE's activations on it, `(N,)` and `(N, F)`."""
    loaded = load_run(run)
    tokens, _ = eval_tokens(loaded)
    starts = window_starts(len(tokens), 16, 4, 3)
    sae = load_sae(folder).sae
    ids, acts = [], []
    with torch.no_grad():
        for x, _ in window_batches(tokens, 16, starts, "cpu"):
            acts.append(sae.encode(read_activations(loaded.model, HOOK, x)).numpy())
            ids.append(x.flatten().numpy())
    return np.concatenate(ids), np.concatenate(acts)


def test_each_feature_s_top_contexts_and_density_are_those_of_every_token(
    run, folder, report
) -> None:
    ids, acts = every_activation(run, folder)
    tokenizer = load_run(run).tokenizer
    assert report.tokens == len(ids) == 3 * 4 * 16
    assert [f.index for f in report.features] == list(range(64))
    for f in report.features:
        column = acts[:, f.index]
        assert f.density == (column > 0).mean()
        top = np.sort(column[column > 0])[::-1][:3]
        np.testing.assert_allclose([c.value for c in f.contexts], top, rtol=1e-5)
        for c in f.contexts:
            # the shown tokens are the text's, and the activating one is where the value is
            text = tokenizer.decode(ids[c.start : c.start + len(c.tokens)].tolist())
            assert "".join(c.tokens) == text
            np.testing.assert_allclose(c.acts, column[c.start : c.start + len(c.tokens)], rtol=1e-5)
            assert c.acts[c.at] == c.value and c.at <= 24


def test_the_logit_effect_is_the_direction_through_the_final_norm_s_gain_and_the_head(
    run, folder, report
) -> None:
    model, tokenizer = load_run(run).model, load_run(run).tokenizer
    W_dec = load_sae(folder).sae.W_dec.detach().double()
    gain = model.ln_f.weight.detach().double()
    W_U = model.lm_head.weight.detach().double()  # (V, C)
    for f in report.features[:5]:
        d = W_dec[f.index]
        effect = ((d - d.mean()) * gain) @ W_U.T  # (V,)
        order = effect.argsort(descending=True)
        assert [t for t, _ in f.promoted] == [tokenizer.decode([i]) for i in order[:8].tolist()]
        assert [t for t, _ in f.suppressed] == [
            tokenizer.decode([i]) for i in order.flip(0)[:8].tolist()
        ]
        np.testing.assert_allclose(f.promoted[0][1], effect.max().item(), rtol=1e-4)


def test_asked_features_only_and_their_text(folder) -> None:
    report = feature_report(ReadOptions(sae=folder, **OPTIONS), [5, 2, 5], top=2)
    assert [f.index for f in report.features] == [5, 2]
    text = format_features(report)
    assert "feature 5: density" in text and "promotes:" in text and "suppresses:" in text
    with pytest.raises(InputError, match="--feature 64: the SAE's features are 0..63"):
        feature_report(ReadOptions(sae=folder, **OPTIONS), [64])


def test_a_context_marks_its_activating_tokens() -> None:
    context = Context(list("ab\ncd"), [0.0, 1.0, 2.0, 0.0, 0.5], at=2, value=2.0, start=0)
    assert context_line(context) == "a⟦b↵⟧c⟦d⟧"


def test_the_page_inlines_the_report_and_reads_without_the_network(report, tmp_path) -> None:
    html = render_features_page(report)
    data = re.search(
        r'<script id="feature-data" type="application/json">(.*?)</script>', html, re.S
    )
    assert json.loads(data[1])["n_features"] == 64
    assert "http" not in html.replace("http-equiv", "")
    assert write_features_page(report, tmp_path / "f.html").read_text() == html


@needs_chromium
def test_the_page_shows_a_feature_s_contexts_and_switches_on_a_click(
    browser, report, tmp_path
) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, write_features_page(report, tmp_path / "features.html"))
    assert severe_messages(browser) == []
    items = browser.find_elements(By.CSS_SELECTOR, "#list div")
    densest = max(report.features, key=lambda f: f.density)
    assert len(items) == 64 and items[0].get_attribute("data-index") == str(densest.index)
    title = browser.find_element(By.CSS_SELECTOR, "#detail h2").text
    assert title == f"feature {densest.index}"
    lines = browser.find_elements(By.CSS_SELECTOR, "#detail .context")
    assert len(lines) == len(densest.contexts)
    other = next(f for f in report.features if f.contexts and f.index != densest.index)
    next(i for i in items if i.get_attribute("data-index") == str(other.index)).click()
    assert browser.find_element(By.CSS_SELECTOR, "#detail h2").text == f"feature {other.index}"
    shaded = browser.find_elements(By.CSS_SELECTOR, "#detail .context .tok.at")
    assert len(shaded) == len(other.contexts)
    box = browser.find_element(By.ID, "filter")
    box.send_keys(str(other.index))
    shown = browser.find_elements(By.CSS_SELECTOR, "#list div")
    assert all(d.get_attribute("data-index").startswith(str(other.index)) for d in shown)
