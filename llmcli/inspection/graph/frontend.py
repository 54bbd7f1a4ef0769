"""The graph as circuit-tracer's frontend reads it: the JSON its `create_graph_files` writes.

`<dir>/<slug>.json` holds `metadata` (slug, scan, the prompt and its tokens, the node
threshold), `qParams` (the view's empty state), `nodes` and `links`, with circuit-tracer's node
ids (`{layer}_{feature}_{position}` for a feature, `0_{layer}_{position}` for an error,
`E_{token id}_{position}` for a token, `{layers + 1}_{token id}_{position}` for a logit), the
nodes the pruning kept that have an edge (tokens and logits always), each with its cumulative
influence, and the kept edges between them; `<dir>/graph-metadata.json` lists the graphs of the
folder. Both come from the same graph and pruning as `graph.pt` and the page.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import JSONFileError, atomic_write_text, read_json


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def frontend_nodes(result: Any) -> dict[int, dict[str, Any]]:
    """Node index -> circuit-tracer's node, for every node the pruning kept."""
    g, pruned = result.graph, result.pruned
    L, T = g.n_layers, len(g.input_tokens)
    m = len(g.selected_features)
    scores = pruned.cumulative_scores.tolist()
    base = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0}
    nodes: dict[int, dict[str, Any]] = {}
    for i in pruned.node_mask.nonzero().squeeze(1).tolist():
        node = dict(base, clerp="", influence=scores[i], activation=None)
        if i < m:
            layer, pos, f = g.active_features[g.selected_features[i]].tolist()
            node |= {"node_id": f"{layer}_{f}_{pos}", "feature": _cantor(layer, f)}
            node |= {"layer": str(layer), "ctx_idx": pos, "jsNodeId": f"{layer}_{f}-0"}
            node |= {"feature_type": "cross layer transcoder"}
            node["activation"] = float(g.activation_values[g.selected_features[i]])
        elif i < m + L * T:
            layer, pos = divmod(i - m, T)
            node |= {"node_id": f"0_{layer}_{pos}", "feature": -1, "layer": str(layer)}
            node |= {"ctx_idx": pos, "feature_type": "mlp reconstruction error"}
            node["jsNodeId"] = f"{layer}_{pos}-0"
        elif i < m + (L + 1) * T:
            pos = i - m - L * T
            token = int(g.input_tokens[pos])
            node |= {"node_id": f"E_{token}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos}
            node |= {"feature_type": "embedding", "jsNodeId": f"E_{token}-{pos}"}
        else:
            k = i - m - (L + 1) * T
            vocab, p = int(g.logit_targets[k]), float(g.logit_probabilities[k])
            node |= {"node_id": f"{L + 1}_{vocab}_{T - 1}", "feature": vocab, "layer": str(L + 1)}
            node |= {"ctx_idx": T - 1, "feature_type": "logit", "token_prob": p}
            node |= {"is_target_logit": k == 0, "jsNodeId": f"L_{vocab}-{T - 1}"}
            node |= {"clerp": f'Output "{result.logit_texts[k]}" (p={p:.3f})', "influence": None}
        nodes[i] = node
    return nodes


def frontend_graph(result: Any, slug: str, node_threshold: float) -> dict[str, Any]:
    """The JSON of `<slug>.json` (module doc); `result` a `command.GraphResult`."""
    nodes = frontend_nodes(result)
    dsts, srcs = result.pruned.edge_mask.nonzero(as_tuple=True)
    weights = result.graph.adjacency_matrix[dsts, srcs].tolist()
    links = [
        {"source": nodes[s]["node_id"], "target": nodes[d]["node_id"], "weight": w}
        for s, d, w in zip(srcs.tolist(), dsts.tolist(), weights, strict=True)
        if s in nodes and d in nodes
    ]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    used = [
        n
        for n in nodes.values()
        if n["node_id"] in linked or n["feature_type"] in ("embedding", "logit")
    ]
    metadata = {
        "slug": slug,
        "scan": result.graph.scan,
        "transcoder_list": [],
        "prompt_tokens": result.graph.token_texts,
        "prompt": result.graph.input_string,
        "node_threshold": node_threshold,
        "schema_version": 1,
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}


def listed_graphs(folder: str | Path) -> list[dict[str, Any]]:
    """The graphs `graph-metadata.json` in `folder` lists ([] without one).

    Raises:
        InputError: a listing that cannot be read, or that holds no list of graphs.
    """
    listing = Path(folder) / "graph-metadata.json"
    if not listing.exists():
        return []
    try:
        graphs = read_json(listing)["graphs"]
    except JSONFileError as exc:
        raise InputError(f"--frontend: '{listing}' cannot be read: {exc}.") from None
    except (TypeError, KeyError):
        graphs = None
    if not isinstance(graphs, list) or not all(isinstance(g, dict) for g in graphs):
        raise InputError(
            f"--frontend: '{listing}' is not circuit-tracer's listing (an object whose "
            '"graphs" is a list of objects): give another folder, or remove the file.'
        )
    return graphs


def write_frontend_files(data: dict[str, Any], folder: str | Path) -> Path:
    """Write `<slug>.json` and add the graph to `graph-metadata.json` (replacing one of the same
    slug) in `folder`; returns the graph's file.

    Raises:
        InputError: the folder cannot be made or written (the reason named), or its listing
            read (`listed_graphs`).
    """
    folder = Path(folder)
    path = folder / f"{data['metadata']['slug']}.json"
    graphs = [g for g in listed_graphs(folder) if g.get("slug") != data["metadata"]["slug"]]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False))
        listing = folder / "graph-metadata.json"
        atomic_write_text(listing, json.dumps({"graphs": [*graphs, data["metadata"]]}, indent=2))
    except OSError as exc:
        raise InputError(
            f"--frontend '{folder}' cannot be written: {describe_os_error(exc)}."
        ) from None
    return path
