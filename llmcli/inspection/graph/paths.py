"""Reading a pruned graph: each node's label, and the strongest paths into each logit.

A path runs from a token (or an error, which has no incoming edge) through features to a logit,
along edges the pruning kept. Its weight is the product, at each step, of the edge's share of
its target's incoming edges in absolute value (the normalised adjacency the influence is
computed from): the share of the logit that flows along it. The `n` heaviest are found by a
beam search from each logit backwards (`beam` partial paths kept per step).
"""

from __future__ import annotations

from typing import Any

from llmcli.inspection.graph.attribute import AttributionGraph
from llmcli.inspection.graph.prune import Pruned, normalize_matrix


def node_labels(graph: AttributionGraph, tokenizer: Any) -> list[str]:
    """One label per node, in the adjacency's order: `L1 F7 @3 "e"` (a feature: layer, feature,
    position and its token), `error L1 @3`, `token "e" @3`, `logit " "`."""
    texts = [tokenizer.decode([i]) for i in graph.input_tokens.tolist()]
    chosen = graph.active_features[graph.selected_features]
    L, T = graph.n_layers, len(texts)
    labels = [f"L{layer} F{f} @{pos} {texts[pos]!r}" for layer, pos, f in chosen.tolist()]
    labels += [f"error L{layer} @{pos}" for layer in range(L) for pos in range(T)]
    labels += [f"token {texts[pos]!r} @{pos}" for pos in range(T)]
    labels += [f"logit {tokenizer.decode([i])!r}" for i in graph.logit_targets.tolist()]
    return labels


def top_paths(
    graph: AttributionGraph, pruned: Pruned, labels: list[str], n: int = 3, beam: int = 8
) -> list[dict[str, Any]]:
    """The `n` heaviest paths into each logit (module doc): dicts of `logit` (its label),
    `weight` and `nodes` (labels, from the source to the logit)."""
    kept = graph.adjacency_matrix * pruned.edge_mask  # (N, N): rows targets, columns sources
    shares = normalize_matrix(kept)
    k = len(graph.logit_targets)
    N = kept.shape[0]
    found = []
    for logit in range(N - k, N):
        partial, complete = [(1.0, [logit])], []
        while partial:
            grown = []
            for weight, path in partial:
                sources = shares[path[-1]].nonzero().squeeze(1).tolist()
                if not sources:
                    complete.append((weight, path))
                grown += [(weight * float(shares[path[-1], s]), [*path, s]) for s in sources]
            partial = sorted(grown, key=lambda p: -p[0])[:beam]
        best = sorted((p for p in complete if len(p[1]) > 1), key=lambda p: -p[0])[:n]
        found += [
            {
                "logit": labels[logit],
                "weight": weight,
                "nodes": [labels[i] for i in reversed(path)],
            }
            for weight, path in best
        ]
    return found
