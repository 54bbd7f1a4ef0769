"""`llmcli graph` computes circuit-tracer's graph: circuit-tracer itself, given the run's Hugging
Face export and the transcoder folder, finds the same active features and activations, the same
logit targets and the same adjacency matrix entry by entry (unpruned).

circuit-tracer runs in its own environment (see `graph_helpers.circuit_tracer_python`):
`LLMCLI_CIRCUIT_TRACER_PYTHON=/path/to/python` names it; without it, and without circuit-tracer
here, the test is skipped and says so.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from graph_helpers import (
    CIRCUIT_TRACER_SCRIPT,
    PROMPT,
    circuit_tracer_python,
    prompt_ids,
    transcoders_for,
)
from sae_helpers import small_run

from llmcli.hf.export import export_hf
from llmcli.inspection.graph.attribute import attribute_graph
from llmcli.inspection.graph.command import GraphRequest, run_graph
from llmcli.inspection.graph.options import GraphOptions
from llmcli.inspection.sae.transcoder_folder import load_transcoders
from llmcli.runs.loading import load_run

PYTHON = circuit_tracer_python()
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        PYTHON is None,
        reason="circuit-tracer is not installed here and LLMCLI_CIRCUIT_TRACER_PYTHON names no "
        "Python that has it (circuit-tracer 0.5.0 pins transformers <= 4.57.3 and "
        "huggingface_hub < 1.0, which llmcli excludes: give it a venv of its own)",
    ),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def export(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "export"
    export_hf(run, out)
    return out


@pytest.fixture(scope="module")
def default_folder(run):
    """Transcoders in the run's default folder, which `llmcli graph` finds by itself."""
    return transcoders_for(run, run / "transcoders")


def circuit_tracer_graph(export, folder, ids, out, **options) -> dict:
    args = [PYTHON, str(CIRCUIT_TRACER_SCRIPT), str(export), str(folder), str(out)]
    args += ["--tokens", ",".join(str(int(i)) for i in ids)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(args, check=True, capture_output=True, timeout=600)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    ("settings", "options"),
    [
        ({"activation": "batchtopk", "skip": True}, {}),
        ({"activation": "relu", "skip": False}, {"max_logits": 5, "logit_probability": 0.5}),
        ({"activation": "batchtopk", "skip": True}, {"max_feature_nodes": 20, "batch_size": 8}),
    ],
    ids=["jumprelu-skip", "relu", "max-feature-nodes"],
)
def test_circuit_tracer_computes_the_same_graph(run, export, tmp_path, settings, options) -> None:
    folder = transcoders_for(run, tmp_path / "tc", **settings)
    loaded = load_run(run)
    ids = prompt_ids(loaded.tokenizer)
    theirs = circuit_tracer_graph(export, folder, ids, tmp_path / "ct.pt", **options)
    transcoders = load_transcoders(folder).transcoders
    ours = attribute_graph(loaded.model, transcoders, ids, GraphOptions(**options))
    assert torch.equal(theirs["input_tokens"], ours.input_tokens)
    assert torch.equal(theirs["active_features"], ours.active_features)
    assert len(ours.active_features) > 20
    torch.testing.assert_close(ours.activation_values, theirs["activation_values"])
    assert torch.equal(theirs["logit_targets"], ours.logit_targets)
    torch.testing.assert_close(ours.logit_probabilities, theirs["logit_probabilities"])
    assert torch.equal(theirs["selected_features"], ours.selected_features)
    A, B = ours.adjacency_matrix, theirs["adjacency_matrix"]
    assert A.shape == B.shape and A.abs().max() > 0
    # entry by entry within 1e-4 relative, and 1e-6 of the largest edge where edges are ~0
    torch.testing.assert_close(A, B, rtol=1e-4, atol=1e-6 * float(B.abs().max()))


def test_circuit_tracers_frontend_files_are_what_llmcli_writes(
    run, export, default_folder, tmp_path
) -> None:
    import json

    folder = default_folder
    loaded = load_run(run)
    ids = prompt_ids(loaded.tokenizer)
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    options = {"frontend": theirs_dir, "slug": "g"}
    circuit_tracer_graph(export, folder, ids, tmp_path / "ct.pt", **options)
    request = GraphRequest(prompt=PROMPT, checkpoint=run, frontend=ours_dir, slug="g")
    run_graph(request, notify=lambda _: None)
    theirs = json.loads((theirs_dir / "g.json").read_text())
    ours = json.loads((ours_dir / "g.json").read_text())
    theirs["metadata"]["scan"] = ours["metadata"]["scan"]  # the transcoders' name in each
    assert ours["metadata"] == theirs["metadata"] and ours["qParams"] == theirs["qParams"]
    assert [n["node_id"] for n in ours["nodes"]] == [n["node_id"] for n in theirs["nodes"]]
    for a, b in zip(ours["nodes"], theirs["nodes"], strict=True):
        for key in ("influence", "activation", "token_prob"):
            assert (a[key] is None) == (b[key] is None), (a["node_id"], key)
            if a[key] is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["node_id"], key)
        assert {
            k: v for k, v in a.items() if k not in ("influence", "activation", "token_prob")
        } == {k: v for k, v in b.items() if k not in ("influence", "activation", "token_prob")}
    pairs = [(link["source"], link["target"]) for link in ours["links"]]
    assert pairs == [(link["source"], link["target"]) for link in theirs["links"]]
    weights = torch.tensor([link["weight"] for link in ours["links"]])
    torch.testing.assert_close(weights, torch.tensor([link["weight"] for link in theirs["links"]]))
    listing = json.loads((ours_dir / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["g"]


READ_AND_PRUNE = """
import sys, torch
from circuit_tracer.graph import Graph, prune_graph
from circuit_tracer.utils.tl_nnsight_mapping import UnifiedConfig
d = torch.load(sys.argv[1], weights_only=True)
d["cfg"] = UnifiedConfig.from_dict(d["cfg"])
nodes, edges, scores = prune_graph(Graph(**d))
torch.save({"nodes": nodes, "edges": edges, "scores": scores}, sys.argv[2])
"""


def test_circuit_tracer_reads_graph_pt_and_prunes_it_as_llmcli_does(
    run, default_folder, tmp_path
) -> None:
    out = tmp_path / "graph.pt"
    result = run_graph(GraphRequest(prompt=PROMPT, checkpoint=run, out=out), notify=print)
    args = [PYTHON, "-c", READ_AND_PRUNE, str(out), str(tmp_path / "pruned.pt")]
    subprocess.run(args, check=True, capture_output=True, timeout=600)
    theirs = torch.load(tmp_path / "pruned.pt", weights_only=True)
    assert torch.equal(theirs["nodes"], result.pruned.node_mask)
    assert torch.equal(theirs["edges"], result.pruned.edge_mask)
    torch.testing.assert_close(theirs["scores"], result.pruned.cumulative_scores)
