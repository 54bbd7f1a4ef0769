"""The attribution graph of one prompt, as circuit-tracer's `attribute` computes it.

Nodes, in circuit-tracer's order: the active features `(layer, position, feature)` (sorted so),
the error nodes (layer-major, then position), the token embeddings (one per position), and the
logit targets: the most probable next tokens at the last position, up to `max_logits`, until
their probability reaches `logit_probability` (circuit-tracer's `_from_salient`).

The edge `A[t, s]` is the direct effect of source `s` on target `t` through the frozen local
replacement model (`replacement`): what `s` writes into the residual stream (a feature's
`activation * W_dec row`, an error, a token's embedding row) dotted with the gradient of what `t`
reads (a feature's `W_enc row . mlp_in`, a logit's demeaned unembedding row `. final_norm` at the
last position) with respect to that write. One frozen forward of a batch of `batch_size` copies
of the prompt serves every target: each backward (`torch.autograd.grad`) injects one target per
row of the batch. Rows are the targets, columns the sources; only feature and logit nodes have
incoming edges. With `max_feature_nodes` below the number of active features, the features are
visited in the order of their influence on the logits so far (circuit-tracer's greedy queue,
`update_interval` batches at a time), and only those visited keep rows and columns.

Three identities hold for every graph and are checked as it is made (`GraphChecks`): the
replacement model with its error nodes gives the model's logits; each logit's incoming edges sum
to its demeaned logit, and each feature's to its pre-activation less its encoder bias, each less
the part of the constants (position embeddings, biases, the first position's MLP output), which
the frozen model run with every node at zero gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.inspection.graph.options import GraphOptions
from llmcli.inspection.graph.prune import partial_influences
from llmcli.inspection.graph.replacement import (
    FrozenRun,
    PromptState,
    check_logits,
    demeaned_unembedding,
    frozen_hooks,
    read_prompt,
    replacement_logits,
)
from llmcli.inspection.sae.transcoder import TranscoderSet
from llmcli.progress import Progress

#: The relative tolerance of the edge-sum identities (float32 sums of a few hundred terms).
EDGE_TOLERANCE = 1e-4
#: The most memory the edge rows may take (the adjacency needs as much again): 2 GiB.
MAX_EDGE_BYTES = 2 * 2**30


@dataclass
class GraphChecks:
    """The largest deviations of the built-in identities (module doc): `logits` (relative to
    the largest logit), `logit_edges` and `feature_edges` (relative to the sum of |edges|)."""

    logits: float
    logit_edges: float
    feature_edges: float


@dataclass
class AttributionGraph:
    """An unpruned attribution graph, under circuit-tracer's `Graph` field names.

    Attributes:
        input_string: the prompt's text (its tokens decoded, the special token first).
        input_tokens: `(T,)` long.
        active_features: `(n, 3)` long `(layer, position, feature)` of every active feature.
        activation_values: `(n,)` their activations.
        selected_features: `(m,)` long, the indices into `active_features` that have nodes.
        adjacency_matrix: `(N, N)` float32, rows targets, columns sources,
            `N = m + L * T + T + k`.
        logit_targets: `(k,)` long token ids; logit_probabilities: `(k,)` their probabilities.
        vocab_size: `V`.
        scan: the transcoder set's identifier.
        cfg: the model's shape, under circuit-tracer's `UnifiedConfig` names (`model_shape`).
        checks: the exactness identities' deviations.
    """

    input_string: str
    input_tokens: Tensor
    active_features: Tensor
    activation_values: Tensor
    selected_features: Tensor
    adjacency_matrix: Tensor
    logit_targets: Tensor
    logit_probabilities: Tensor
    vocab_size: int
    scan: str
    cfg: dict[str, Any]
    checks: GraphChecks
    token_texts: list[str] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return self.cfg["n_layers"]


def logit_targets(
    logits: Tensor, max_logits: int, logit_probability: float
) -> tuple[Tensor, Tensor]:
    """The most probable tokens of `logits` `(V,)`, up to `max_logits`, until their cumulative
    probability reaches `logit_probability`: `(ids (k,), probabilities (k,))`."""
    probs = torch.softmax(logits, dim=-1)
    top_p, top_ids = torch.topk(probs, min(max_logits, len(probs)))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), logit_probability)) + 1
    ids = top_ids[:cutoff]
    return ids, probs[ids]


class _Rows:
    """Edge rows by backward passes through one frozen forward of `B` copies of the prompt."""

    def __init__(
        self,
        model: nn.Module,
        transcoders: TranscoderSet,
        state: PromptState,
        features: Tensor,
        batch: int,
    ) -> None:
        self.state, self.features = state, features
        self.run = FrozenRun()
        hooks = frozen_hooks(model, transcoders, state, self.run)
        with torch.enable_grad(), model.hooks(hooks):
            model(state.tokens[None].expand(batch, -1))
        layers, positions, ids = features.T
        values = state.acts[layers, positions, ids]  # (n,)
        C = state.mlp_in.shape[-1]
        pick = [(transcoders[int(layer)], int(f)) for layer, f in zip(layers, ids, strict=True)]
        decoders = torch.stack([tc.W_dec[f] for tc, f in pick]) if pick else torch.zeros(0, C)
        self.decoders = (decoders * values[:, None]).detach()  # (n, C): a_s * W_dec[s]
        self.encoders = (  # (n, C)
            torch.stack([tc.W_enc[f] for tc, f in pick]).detach() if pick else torch.zeros(0, C)
        )
        self.token_vectors = model.wte.weight[state.tokens].detach()  # (T, C)
        self.batch = batch

    def compute(self, layers: list[int], positions: Tensor, vectors: Tensor) -> Tensor:
        """The rows of `len(vectors)` targets: target i reads `vectors[i]` `(C,)` at position
        `positions[i]` of layer `layers[i]`'s MLP input (`-1`: the final norm's output).

        Returns:
            `(len(vectors), n + (L + 1) * T)` float32: its edges from every non-logit node.
        """
        run, state = self.run, self.state
        L, T, _ = state.mlp_in.shape
        n = len(vectors)
        outputs, grads = [], []
        for layer in sorted(set(layers)):
            read = run.final if layer == -1 else run.reads[layer]
            inject = torch.zeros_like(read)
            chosen = [i for i in range(n) if layers[i] == layer]
            inject[chosen, positions[chosen]] = vectors[chosen].to(read.dtype)
            outputs.append(read)
            grads.append(inject)
        inputs = [run.embed, *run.writes]
        got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
        n_feat = len(self.features)
        rows = vectors.new_zeros(n, n_feat + (L + 1) * T)
        if got[0] is not None:
            g = got[0][:n]  # (n, T, C)
            rows[:, n_feat + L * T :] = torch.einsum("btc,tc->bt", g, self.token_vectors)
        f_layers, f_pos = self.features[:, 0], self.features[:, 1]
        for layer, g in enumerate(got[1:]):
            if g is None:
                continue
            g = g[:n]  # (n, T, C)
            at = (f_layers == layer).nonzero().squeeze(1)
            rows[:, at] = torch.einsum("bnc,nc->bn", g[:, f_pos[at]], self.decoders[at])
            start = n_feat + layer * T
            rows[:, start : start + T] = torch.einsum("btc,tc->bt", g, state.errors[layer])
        return rows

    def visit_features(
        self,
        edges: Tensor,
        row_node: Tensor,
        probabilities: Tensor,
        n_kept: int,
        options: GraphOptions,
        bar: Progress,
    ) -> Tensor:
        """Fill the rows of `n_kept` features into `edges` after the logits' rows (`row_node`
        names each row's node): every feature in order, or the most influential on the logits
        by the rows so far, re-ranked every `update_interval` batches (circuit-tracer's queue).

        Returns:
            `(n,)` bool: the features visited.
        """
        n_feat, k = len(self.features), len(probabilities)
        batch, columns = self.batch, edges.shape[1] - k
        visited = torch.zeros(n_feat, dtype=torch.bool)
        done, row = 0, k
        while done < n_kept:
            if n_kept == n_feat:
                pending = torch.arange(n_feat)
            else:
                influence = partial_influences(edges[:row], probabilities, row_node[:row])
                rank = torch.argsort(influence[:n_feat], descending=True)
                pending = rank[~visited[rank]][
                    : min(options.update_interval * batch, n_kept - done)
                ]
            for start in range(0, len(pending), batch):
                chunk = pending[start : start + batch]
                got = self.compute(
                    self.features[chunk, 0].tolist(), self.features[chunk, 1], self.encoders[chunk]
                )
                edges[row : row + len(chunk), :columns] = got
                row_node[row : row + len(chunk)] = chunk
                visited[chunk] = True
                row, done = row + len(chunk), done + len(chunk)
                bar.update(len(chunk))
        return visited


def attribute_graph(
    model: nn.Module,
    transcoders: TranscoderSet,
    tokens: Tensor,
    options: GraphOptions = GraphOptions(),
    *,
    progress: bool = False,
) -> AttributionGraph:
    """The attribution graph of `tokens` `(T,)` (special token first) through `model` with
    `transcoders` on every layer (see the module doc).

    Raises:
        RuntimeError: an exactness identity that does not hold (an internal error).
    """
    state = read_prompt(model, transcoders, tokens)
    L, T, _ = state.mlp_in.shape
    features = state.acts.nonzero()  # (n, 3) (layer, position, feature), sorted so
    n_feat = len(features)
    ids, probabilities = logit_targets(
        state.logits[-1], options.max_logits, options.logit_probability
    )
    k = len(ids)
    logit_offset = n_feat + (L + 1) * T
    most = options.max_feature_nodes
    n_kept = n_feat if most is None else min(most, n_feat)
    check_size(n_kept, k, logit_offset + k)
    batch = max(1, min(options.batch_size, max(k, n_kept)))
    rows = _Rows(model, transcoders, state, features, batch)

    edges = torch.zeros(n_kept + k, logit_offset + k)
    row_node = torch.zeros(n_kept + k, dtype=torch.long)
    logit_vectors = demeaned_unembedding(model, ids)  # (k, C)
    for i in range(0, k, batch):
        part = logit_vectors[i : i + batch]
        last = torch.full((len(part),), T - 1)
        edges[i : i + len(part), :logit_offset] = rows.compute([-1] * len(part), last, part)
        row_node[i : i + len(part)] = torch.arange(i, i + len(part)) + logit_offset

    with Progress(n_kept, desc="graph", unit="feature", enabled=progress) as bar:
        visited = rows.visit_features(edges, row_node, probabilities, n_kept, options, bar)

    # Checked on every row before unvisited features lose their columns (their edges count).
    checks = _check(model, transcoders, state, features, ids, edges, row_node[k:])
    selected = torch.where(visited)[0]
    if n_kept < n_feat:
        edges = edges[:, torch.cat([selected, torch.arange(n_feat, logit_offset + k)])]
    edges = edges[row_node.argsort()]
    size = edges.shape[1]
    adjacency = torch.zeros(size, size)
    adjacency[:n_kept] = edges[:n_kept]
    adjacency[size - k :] = edges[n_kept:]
    return AttributionGraph(
        input_string="",
        input_tokens=tokens.cpu(),
        active_features=features.cpu(),
        activation_values=state.acts[tuple(features.T)].cpu(),
        selected_features=selected,
        adjacency_matrix=adjacency,
        logit_targets=ids.cpu(),
        logit_probabilities=probabilities.cpu(),
        vocab_size=int(state.logits.shape[-1]),
        scan="",
        cfg=model_shape(model),
        checks=checks,
    )


def check_size(n_kept: int, k: int, columns: int) -> None:
    """Raise `InputError` when the edge rows of `n_kept` features and `k` logits over `columns`
    nodes (float32) would pass `MAX_EDGE_BYTES`: a set with many active features (a short
    training's, say) is read with fewer kept."""
    need = (n_kept + k) * columns * 4
    if need > MAX_EDGE_BYTES:
        most = max(1, MAX_EDGE_BYTES // (4 * columns) - k)
        raise InputError(
            f"the graph's edges would take {need / 2**30:.1f} GiB ({n_kept:,} feature rows of "
            f"{columns:,} nodes; twice that with the adjacency): keep the most influential "
            f"features only with --max-feature-nodes (at most {most:,} fit), or train the "
            "transcoders longer (fewer features active per token)."
        )


def model_shape(model: nn.Module) -> dict[str, Any]:
    """The model's shape under the names of circuit-tracer's `UnifiedConfig` (its `from_dict`
    reads them back: `tokenizer_name` and `model_name` are filled in by the caller, who knows
    the run), as a graph file records it."""
    return {
        "n_layers": model.n_layer,
        "d_model": model.n_embed,
        "n_heads": model.n_head,
        "d_head": model.config.head_size,
        "d_mlp": 4 * model.n_embed,
        "n_ctx": model.context_length,
        "d_vocab": model.vocab_size,
        "tokenizer_name": "",
        "model_name": "",
        "original_architecture": "GPT2LMHeadModel",
    }


@torch.no_grad()
def _check(
    model: nn.Module,
    transcoders: TranscoderSet,
    state: PromptState,
    features: Tensor,
    ids: Tensor,
    edges: Tensor,
    visited: Tensor,
) -> GraphChecks:
    """The three identities of the module doc on the rows `edges`, the `k` logits' first, then
    those of the features `visited` (indices into `features`); a RuntimeError where one fails."""
    logits_diff = check_logits(
        state.logits, replacement_logits(model, transcoders, state), "the replacement logits"
    )
    zero = FrozenRun()
    with model.hooks(frozen_hooks(model, transcoders, state, zero, without_nodes=True)):
        model(state.tokens[None])
    vectors = demeaned_unembedding(model, ids)  # (k, C)
    # The demeaned logits less the constants' part: what the edges into each logit must sum to.
    wanted = vectors @ (state.final[-1] - zero.final[0, -1])  # (k,)
    k = len(ids)
    logit_dev = _deviation(edges[:k], wanted)
    chosen = features[visited]  # (m, 3)
    feature_dev = 0.0
    if len(chosen):
        layers, positions, fs = chosen.T
        enc = torch.stack(
            [transcoders[int(layer)].W_enc[f] for layer, f in zip(layers, fs, strict=True)]
        )  # (m, C)
        reads = torch.stack([r[0] for r in zero.reads])  # (L, T, C)
        delta = state.mlp_in[layers, positions] - reads[layers, positions]  # (m, C)
        feature_dev = _deviation(edges[k:], (enc * delta).sum(-1))
    for what, dev in (("logit", logit_dev), ("feature", feature_dev)):
        if dev > EDGE_TOLERANCE:
            raise RuntimeError(
                f"exactness check failed: the edges into a {what} node miss their sum by "
                f"{dev:.2e} of their size (> {EDGE_TOLERANCE})"
            )
    return GraphChecks(logits_diff, logit_dev, feature_dev)


def _deviation(rows: Tensor, wanted: Tensor) -> float:
    """The largest `|sum(row) - wanted| / (sum |row| + |wanted|)` over the rows."""
    if not len(rows):
        return 0.0
    got = rows.double().sum(-1)
    size = rows.double().abs().sum(-1) + wanted.double().abs() + 1e-12
    return float(((got - wanted.double()).abs() / size).max())


def graph_to_dict(graph: AttributionGraph) -> dict[str, Any]:
    """What `--out graph.pt` holds: circuit-tracer's `Graph.to_pt` fields (tensors, numbers,
    strings, lists and dicts only, so `torch.load(weights_only=True)` reads it); `logit_targets`
    as token ids (the form circuit-tracer's `Graph.from_pt` converts), `cfg` the shape as a dict
    (`UnifiedConfig.from_dict(d["cfg"])` makes circuit-tracer's config of it: a config object
    would need `weights_only=False`)."""
    return {
        "input_string": graph.input_string,
        "adjacency_matrix": graph.adjacency_matrix,
        "cfg": dict(graph.cfg),
        "active_features": graph.active_features,
        "logit_targets": graph.logit_targets,
        "logit_probabilities": graph.logit_probabilities,
        "vocab_size": graph.vocab_size,
        "input_tokens": graph.input_tokens,
        "selected_features": graph.selected_features,
        "activation_values": graph.activation_values,
        "scan": graph.scan,
    }
