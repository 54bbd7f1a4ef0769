"""`llmcli.inspection.graph`: the attribution graph's exactness identities, held against the
model's own forward, its logit targets, its file, and its pruning.

circuit-tracer itself is the reference of tests/test_graph_circuit_tracer.py; here the graph is
held to what must be true of any such graph: in a model with no constant terms (no biases, no
position embeddings, transcoders without a decoder bias, the first position's MLP output at 0),
each logit's incoming edges sum to its demeaned logit as the model computes it, and each
feature's to its pre-activation less its encoder bias."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import prompt_ids, transcoders_for
from model_helpers import assert_close
from sae_helpers import small_run

from llmcli.inspection.graph.attribute import (
    attribute_graph,
    graph_to_dict,
    logit_targets,
)
from llmcli.inspection.graph.options import GraphOptions
from llmcli.inspection.graph.prune import prune
from llmcli.inspection.sae.transcoder_folder import load_transcoders
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")

#: The fields of circuit-tracer's `Graph.to_pt`.
TO_PT_FIELDS = {
    "input_string",
    "adjacency_matrix",
    "cfg",
    "active_features",
    "logit_targets",
    "logit_probabilities",
    "vocab_size",
    "input_tokens",
    "selected_features",
    "activation_values",
    "scan",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, small_corpus):
    """A run with no constant term in its residual stream: no biases, rotary positions, RMSNorm."""
    folder = tmp_path_factory.mktemp("plain") / "run"
    return small_run(folder, small_corpus, pos_emb="rope", norm="rmsnorm", bias=False)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    return transcoders_for(run, tmp_path_factory.mktemp("tc") / "tc")


def test_the_edges_sum_to_the_demeaned_logits_and_pre_activations_the_model_computes(
    plain_run, tmp_path
) -> None:
    folder = transcoders_for(plain_run, tmp_path / "tc", activation="relu", skip=False)
    loaded = load_run(plain_run)
    model, transcoders = loaded.model, load_transcoders(folder).transcoders
    for tc in transcoders.transcoders:
        with torch.no_grad():
            tc.b_dec.zero_()
    ids = prompt_ids(loaded.tokenizer)
    seen = {}

    def first_mlp_output_zero(x):
        x = x.clone()
        x[:, 0] = 0
        return x

    hooks = {f"blocks.{i}.mlp_out": first_mlp_output_zero for i in range(2)}
    hooks |= {f"blocks.{i}.mlp_in": (lambda x, i=i: seen.__setitem__(i, x[0])) for i in range(2)}
    with model.hooks(hooks):
        graph = attribute_graph(model, transcoders, ids)
        with torch.no_grad():
            logits, _ = model(ids[None])
    k = len(graph.logit_targets)
    demeaned = logits[0, -1, graph.logit_targets] - logits[0, -1].mean()
    assert_close(graph.adjacency_matrix[-k:].sum(-1), demeaned, "logit rows", atol=1e-5)
    layers, positions, features = graph.active_features.T
    pre = torch.stack(
        [
            transcoders[int(layer)].W_enc[f] @ seen[int(layer)][p]
            for layer, p, f in zip(layers, positions, features, strict=True)
        ]
    )  # the pre-activation less the encoder bias
    n = len(graph.active_features)
    assert n > 20
    assert_close(graph.adjacency_matrix[:n].sum(-1), pre.detach(), "feature rows", atol=1e-5)
    assert graph.checks.logits < 1e-5


@pytest.mark.parametrize("options", [GraphOptions(), GraphOptions(max_feature_nodes=15)])
def test_the_built_in_identities_hold_with_every_constant_term(run, folder, options) -> None:
    loaded = load_run(run)
    transcoders = load_transcoders(folder).transcoders
    graph = attribute_graph(loaded.model, transcoders, prompt_ids(loaded.tokenizer), options)
    # the replacement model with its errors gives the model's logits; the edge sums hold
    assert graph.checks.logits < 1e-5
    assert graph.checks.logit_edges < 1e-4 and graph.checks.feature_edges < 1e-4
    L, T, k = 2, len(graph.input_tokens), len(graph.logit_targets)
    m = len(graph.selected_features)
    assert graph.adjacency_matrix.shape == (m + (L + 1) * T + k,) * 2
    assert m == (15 if options.max_feature_nodes else len(graph.active_features))
    # the first position is left out: no feature there, and its errors write nothing
    assert (graph.active_features[:, 1] > 0).all()
    errors_at_first = [m + layer * T for layer in range(L)]
    assert not graph.adjacency_matrix[:, errors_at_first].any()
    # only features and logits have incoming edges
    assert not graph.adjacency_matrix[m : m + (L + 1) * T].any()


def test_logit_targets_are_the_likeliest_until_their_probability_is_reached() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0]).log_softmax(-1)
    probs = logits.softmax(-1)  # 0.03, 0.64, 0.09, 0.23, 0.01 (about)
    ids, p = logit_targets(logits, 10, 0.8)
    assert ids.tolist() == [1, 3] and torch.equal(p, probs[[1, 3]])
    assert logit_targets(logits, 10, 0.5)[0].tolist() == [1]
    assert logit_targets(logits, 2, 0.99)[0].tolist() == [1, 3]  # capped by max_logits
    assert logit_targets(logits, 10, 0.95)[0].tolist() == [1, 3, 2]


def test_the_graph_file_holds_circuit_tracers_fields_and_loads_safely(
    run, folder, tmp_path
) -> None:
    loaded = load_run(run)
    graph = attribute_graph(
        loaded.model, load_transcoders(folder).transcoders, prompt_ids(loaded.tokenizer)
    )
    torch.save(graph_to_dict(graph), tmp_path / "graph.pt")
    saved = torch.load(tmp_path / "graph.pt", weights_only=True)
    assert set(saved) == TO_PT_FIELDS
    assert torch.equal(saved["adjacency_matrix"], graph.adjacency_matrix)
    assert saved["logit_targets"].dtype == torch.long
    assert saved["active_features"].shape[1] == 3 and saved["vocab_size"] == 65
    assert saved["cfg"] == {
        "n_layers": 2,
        "d_model": 16,
        "n_heads": 2,
        "d_head": 8,
        "d_mlp": 64,
        "n_ctx": 16,
        "d_vocab": 65,
        "tokenizer_name": "",
        "model_name": "",
        "original_architecture": "GPT2LMHeadModel",
    }


def test_pruning_keeps_tokens_logits_and_the_nodes_holding_the_influence_asked() -> None:
    # nodes: feature 0, feature 1, error, token, logit (rows targets, columns sources)
    A = torch.zeros(5, 5)
    A[4, 0], A[0, 3], A[1, 3], A[4, 2] = 2.0, 1.0, 1.0, 1.0
    pruned = prune(A, torch.tensor([1.0]), n_features=2, n_tokens=1)
    # influences 2/3 (feature 0, token), 1/3 (error), 0: 0.8 of 5/3 is held by the first two
    assert pruned.node_mask.tolist() == [True, False, False, True, True]
    assert pruned.edge_mask[4, 0] and pruned.edge_mask[0, 3]
    assert not pruned.edge_mask[1, 3] and not pruned.edge_mask[4, 2]
    # the influence is the share of the logit along every path: 2/3 for feature 0
    assert pruned.node_influence[0] == pytest.approx(2 / 3)
    assert pruned.node_influence[3] == pytest.approx(2 / 3)


def test_a_graph_too_big_for_memory_is_refused_naming_the_option(monkeypatch) -> None:
    from llmcli.errors import InputError
    from llmcli.inspection.graph import attribute

    monkeypatch.setattr(attribute, "MAX_EDGE_BYTES", 4 * 100 * 1000)
    attribute.check_size(90, 10, 1000)  # 100 rows of 1,000 nodes: just fits
    with pytest.raises(InputError, match=r"--max-feature-nodes \(at most 90 fit\)"):
        attribute.check_size(91, 10, 1000)


def test_the_prompt_starts_with_end_of_text_or_says_how_the_first_position_is_used() -> None:
    from types import SimpleNamespace

    from llmcli.data.tokenizer import CharTokenizer
    from llmcli.inspection.graph.command import prompt_tokens

    model = SimpleNamespace(context_length=8)
    with_eot = SimpleNamespace(tokenizer=CharTokenizer("abc"), model=model)
    heard = []
    assert prompt_tokens(with_eot, "abc", heard.append).tolist() == [3, 0, 1, 2]
    assert heard == []
    without = SimpleNamespace(tokenizer=CharTokenizer("abc", eot=None), model=model)
    assert prompt_tokens(without, "cab", heard.append).tolist() == [2, 0, 1]
    assert "no end-of-text token" in heard[0] and "first token" in heard[0]
