"""The offline viewer's graph page (`llmcli graph --page`), in real Chromium: every node the
pruning kept drawn at its layer and position, every edge kept, and a click on a feature showing
its label, activation, influence and its top contexts from `sae features`."""

from __future__ import annotations

import json

import pytest
from browser_helpers import needs_chromium, open_page, severe_messages
from graph_helpers import PROMPT, transcoders_for
from sae_helpers import small_run

from llmcli.inspection.graph.command import GraphRequest, run_graph

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drawn(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("graph")
    run = small_run(root / "run", small_corpus)
    transcoders_for(run, run / "transcoders")
    page = root / "graph.html"
    request = GraphRequest(prompt=PROMPT, checkpoint=run, page=page, context_steps=1)
    return run_graph(request, notify=lambda _: None), page


def test_the_page_holds_the_pruned_graph(drawn) -> None:
    result, page = drawn
    assert result.written == [page]
    text = page.read_text(encoding="utf-8")
    assert "__GRAPH_DATA__" not in text and "http" not in text.split("<script")[1][:200]
    # The inlined data: the nodes the pruning kept and the edges between them, each edge its
    # adjacency weight.
    inlined = text.split('<script id="graph-data" type="application/json">')[1]
    data = json.loads(inlined.split("</script>")[0])
    kept = result.pruned.node_mask
    assert len(data["nodes"]) == int(kept.sum()) > 0 and data["total_nodes"] == len(kept)
    edges = result.pruned.edge_mask & kept[:, None] & kept[None, :]
    assert len(data["edges"]) == int(edges.sum()) > 0
    adjacency = result.graph.adjacency_matrix
    for edge in data["edges"]:
        assert edges[edge["target"], edge["source"]]
        assert edge["weight"] == pytest.approx(float(adjacency[edge["target"], edge["source"]]))


@needs_chromium
def test_a_click_on_a_feature_shows_its_activation_and_top_contexts(browser, drawn) -> None:
    from selenium.webdriver.common.by import By

    result, page = drawn
    open_page(browser, page)
    assert severe_messages(browser) == []
    circles = browser.find_elements(By.CSS_SELECTOR, "#graph circle.node")
    assert len(circles) == int(result.pruned.node_mask.sum())
    kept = result.pruned.edge_mask & result.pruned.node_mask[:, None]
    kept &= result.pruned.node_mask[None, :]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#graph line.edge")) == int(kept.sum())
    tokens = browser.find_elements(By.CSS_SELECTOR, "#graph circle.node.token")
    logits = browser.find_elements(By.CSS_SELECTOR, "#graph circle.node.logit")
    assert len(tokens) == len(result.graph.input_tokens)
    assert len(logits) == len(result.graph.logit_targets)
    # logits above the layers, tokens below them
    assert float(logits[0].get_attribute("cy")) < float(tokens[0].get_attribute("cy"))
    features = browser.find_elements(By.CSS_SELECTOR, "#graph circle.node.feature")
    assert features, "the pruning kept no feature"
    feature = features[0]
    node = int(feature.get_attribute("data-id"))
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('click'))", feature)
    assert browser.find_element(By.CSS_SELECTOR, "#detail h2").text == result.labels[node]
    facts = browser.find_element(By.CSS_SELECTOR, "#detail .facts").text
    value = float(result.graph.activation_values[result.graph.selected_features[node]])
    assert facts.startswith(f"activation {value:.4f}, influence ")
    assert browser.find_elements(By.CSS_SELECTOR, "#detail .context")
    assert "selected" in feature.get_attribute("class")
