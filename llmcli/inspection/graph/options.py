"""`GraphOptions`: how `llmcli graph` computes a graph (no torch here: the CLI reads its defaults
while `llmcli --help` answers)."""

from __future__ import annotations

from dataclasses import dataclass

# How much of the influence on the logits the pruned graph keeps, in its nodes and its edges
# (circuit-tracer's `prune_graph` defaults).
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98


@dataclass(frozen=True)
class GraphOptions:
    """How a graph is computed, with circuit-tracer's defaults (batch 256, not its 512: the
    CPU's memory is the bound here).

    Attributes:
        max_logits: the most logit targets.
        logit_probability: logit targets are added until their probability reaches this.
        max_feature_nodes: the most feature nodes (None: every active feature).
        batch_size: targets per backward pass (the frozen forward's batch).
        update_interval: batches between re-rankings of the features by influence.
    """

    max_logits: int = 10
    logit_probability: float = 0.95
    max_feature_nodes: int | None = None
    batch_size: int = 256
    update_interval: int = 4
