"""Influence and pruning of an attribution graph, as circuit-tracer's `graph.py` computes them.

A node's influence is its share in the logits through every path: with `Â` the adjacency whose
rows are normalised to sum 1 in absolute value, and `w` the logit probabilities on the logit
nodes, `w Â + w Â² + ...` (the series ends: the graph has no cycle). Pruning keeps the nodes
holding `node_threshold` of the total influence (tokens and logits always), then the edges
holding `edge_threshold` of the edge influence of that graph, then drops, until nothing
changes, every feature or error without an outgoing edge and every feature without an incoming
one (circuit-tracer's `prune_graph`, its defaults 0.8 and 0.98).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from llmcli.inspection.graph.options import EDGE_THRESHOLD, NODE_THRESHOLD


def normalize_matrix(matrix: Tensor) -> Tensor:
    """Rows of `|matrix|` scaled to sum 1 (an all-zero row stays 0)."""
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def influence(A: Tensor, weights: Tensor, max_iter: int = 1000) -> Tensor:
    """`w A + w A² + ...` for a nilpotent `A` `(N, N)` and `w` `(N,)`."""
    current = weights @ A
    total = current
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ A
        total = total + current
    raise RuntimeError(f"influence did not converge in {max_iter} steps")


def partial_influences(edges: Tensor, probabilities: Tensor, row_node: Tensor) -> Tensor:
    """The influence of every node on the logits from the rows computed so far: `edges`
    `(r, N)` whose row `i` is node `row_node[i]`'s (circuit-tracer's
    `compute_partial_influences`)."""
    normalized = edges.abs()
    normalized = normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-8)
    total = torch.zeros(edges.shape[1])
    prod = torch.zeros(edges.shape[1])
    prod[-len(probabilities) :] = probabilities
    for _ in range(128):
        prod = prod[row_node] @ normalized
        if not prod.any():
            return total
        total = total + prod
    raise RuntimeError("partial influences did not converge in 128 steps")


def find_threshold(scores: Tensor, threshold: float) -> Tensor:
    """The score above which the highest scores hold `threshold` of their sum."""
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    index = min(int(torch.searchsorted(cumulative, threshold).item()), len(cumulative) - 1)
    return ordered[index]


class Pruned(NamedTuple):
    """`node_mask` `(N,)`, `edge_mask` `(N, N)` bool; `node_influence` `(N,)`;
    `cumulative_scores` `(N,)`: the share of influence held by the nodes at least as influential."""

    node_mask: Tensor
    edge_mask: Tensor
    node_influence: Tensor
    cumulative_scores: Tensor


def prune(
    adjacency: Tensor,
    probabilities: Tensor,
    n_features: int,
    n_tokens: int,
    node_threshold: float = NODE_THRESHOLD,
    edge_threshold: float = EDGE_THRESHOLD,
) -> Pruned:
    """Prune a graph (module doc): `adjacency` `(N, N)`, the logits' `probabilities` `(k,)`,
    `n_features` feature nodes first, `n_tokens` token nodes before the `k` logits."""
    n_logits = len(probabilities)
    weights = torch.zeros(adjacency.shape[0])
    weights[-n_logits:] = probabilities
    node_influence = influence(normalize_matrix(adjacency), weights)
    node_mask = node_influence >= find_threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens :] = True
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (influence(normalized, weights) + weights)[:, None]
    edge_mask = edge_scores >= find_threshold(edge_scores.flatten(), edge_threshold)
    sources = slice(0, adjacency.shape[0] - n_logits - n_tokens)
    old = node_mask.clone()
    node_mask[sources] &= edge_mask[:, sources].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not torch.equal(node_mask, old):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[sources] &= edge_mask[:, sources].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    ordered, order = torch.sort(node_influence, descending=True)
    cumulative = torch.zeros_like(node_influence)
    cumulative[order] = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    return Pruned(node_mask, edge_mask, node_influence, cumulative)
