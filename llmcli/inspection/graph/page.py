"""The offline viewer's graph page: one self-contained HTML file (`llmcli graph --page FILE`).

`write_graph_page` fills the template `llmcli/inspection/graph/graph.html` (plain HTML, CSS and
JavaScript drawing SVG, no network) with the pruned graph inlined as JSON: the nodes kept, laid
out by layer (rows: token embeddings at the bottom, layers 0..L-1, logits at the top) and
position (columns), each with its label, activation and influence, and a feature's top
contexts (`sae features`' on the run's validation text); the edges kept, coloured by sign and
drawn as thick as they are strong. A click on a node shows it, its contexts and its strongest
edges in and out.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from llmcli.fileio import atomic_write_text
from llmcli.inspection.viewer import script_json

_DATA = "__GRAPH_DATA__"


def page_data(result: Any, run: str, contexts: dict[tuple[int, int], list[dict]]) -> dict:
    """The page's JSON: `result` a `command.GraphResult`; `contexts` (layer, feature) -> the
    feature's top contexts (`sae features`' `Context`s as dicts)."""
    g, pruned, labels = result.graph, result.pruned, result.labels
    L, T, k = g.n_layers, len(g.input_tokens), len(g.logit_targets)
    chosen = g.active_features[g.selected_features].tolist()
    m = len(chosen)
    influence = pruned.node_influence.tolist()
    nodes = []
    for i in pruned.node_mask.nonzero().squeeze(1).tolist():
        node: dict[str, Any] = {"id": i, "label": labels[i], "activation": None, "contexts": []}
        if i < m:
            layer, pos, feature = chosen[i]
            node |= {"kind": "feature", "row": layer + 1, "pos": pos, "feature": feature}
            node["activation"] = float(g.activation_values[g.selected_features[i]])
            node["contexts"] = contexts.get((layer, feature), [])
        elif i < m + L * T:
            layer, pos = divmod(i - m, T)
            node |= {"kind": "error", "row": layer + 1, "pos": pos}
        elif i < m + (L + 1) * T:
            node |= {"kind": "token", "row": 0, "pos": i - m - L * T}
        else:
            node |= {"kind": "logit", "row": L + 1, "pos": T - 1}
            node["activation"] = float(g.logit_probabilities[i - (len(labels) - k)])
        node["influence"] = influence[i]
        nodes.append(node)
    kept = pruned.edge_mask & pruned.node_mask[:, None] & pruned.node_mask[None, :]
    targets, sources = kept.nonzero(as_tuple=True)
    weights = g.adjacency_matrix[targets, sources].tolist()
    edges = [
        {"source": s, "target": t, "weight": w}
        for t, s, w in zip(targets.tolist(), sources.tolist(), weights, strict=True)
    ]
    return {
        "prompt": g.input_string,
        "tokens": g.token_texts,
        "run": run,
        "scan": g.scan,
        "n_layers": L,
        "total_nodes": len(labels),
        "nodes": nodes,
        "edges": edges,
    }


def write_graph_page(data: dict, path: str | Path) -> Path:
    """Write the page with `data` (`page_data`) inlined; returns its path."""
    template = resources.files("llmcli.inspection.graph").joinpath("graph.html")
    text = template.read_text(encoding="utf-8").replace(_DATA, script_json(data), 1)
    atomic_write_text(Path(path), text)
    return Path(path)
