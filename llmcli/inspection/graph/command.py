"""`llmcli graph`: a run, its transcoders and a prompt in; the attribution graph, pruned, out.

Every input is checked before anything is computed or written: the transcoder folder exists (its
message names the command that trains one), belongs to this run (its width, its run and that
run's step), covers every layer, and the prompt is neither empty nor longer than the context
once the special token is put first. Then the graph (`attribute`), its pruning (`prune`), and
what was asked for: `graph.pt` (`--out`), and the top paths from each logit (`--json`).

The prompt's tokens begin with the run's end-of-text token, whose position attribution leaves
out (its features and error are set to 0), as circuit-tracer puts a special token first. A run
whose tokenizer has none gets no token put first: its first token then stands at the position
left out, and a notice says so (circuit-tracer does the same where it finds no special token).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.fileio import atomic_path
from llmcli.generation.prompts import encode_prompt
from llmcli.inspection.graph.attribute import AttributionGraph, attribute_graph, graph_to_dict
from llmcli.inspection.graph.frontend import frontend_graph, listed_graphs, write_frontend_files
from llmcli.inspection.graph.options import EDGE_THRESHOLD, NODE_THRESHOLD, GraphOptions
from llmcli.inspection.graph.page import page_data, write_graph_page
from llmcli.inspection.graph.paths import node_labels, top_paths
from llmcli.inspection.graph.prune import Pruned, prune
from llmcli.inspection.sae.evaluate import ReadOptions
from llmcli.inspection.sae.features import feature_report
from llmcli.inspection.sae.transcoder_folder import (
    LoadedTranscoders,
    check_fits,
    is_transcoder_folder,
    load_transcoders,
)
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)

TRAIN_COMMAND = "llmcli sae train --kind transcoder --layers all"


@dataclass(frozen=True)
class GraphRequest:
    """What `llmcli graph` is asked for.

    Attributes:
        prompt: the text to attribute.
        checkpoint: the run (None: the latest).
        transcoders: the transcoder folder (None: `<run>/transcoders/`).
        options: how the graph is computed.
        node_threshold, edge_threshold: the pruning's shares of influence kept.
        out: where to write `graph.pt` (None: not written).
        page: where to write the viewer's page (None: not written).
        frontend: a folder for circuit-tracer's frontend files (None: not written).
        slug: the graph's name there.
        context_steps: batches of validation text read for the page's feature contexts.
        weights, device, threads: as the other commands take them.
    """

    prompt: str
    checkpoint: str | Path | None = None
    transcoders: str | Path | None = None
    options: GraphOptions = field(default_factory=GraphOptions)
    node_threshold: float = NODE_THRESHOLD
    edge_threshold: float = EDGE_THRESHOLD
    out: str | Path | None = None
    page: str | Path | None = None
    frontend: str | Path | None = None
    slug: str = "graph"
    context_steps: int = 4
    weights: str = "best"
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        for option, value in (
            ("--node-threshold", self.node_threshold),
            ("--edge-threshold", self.edge_threshold),
            ("--logit-probability", self.options.logit_probability),
        ):
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{option} ({value}) must be between 0 and 1.")
        for option, value in (
            ("--max-logits", self.options.max_logits),
            ("--max-feature-nodes", self.options.max_feature_nodes),
            ("--batch-size", self.options.batch_size),
        ):
            if value is not None and value < 1:
                raise InputError(f"{option} ({value}) must be at least 1.")
        if self.context_steps < 1:
            raise InputError(f"--context-steps ({self.context_steps}) must be at least 1.")
        self._check_outputs()

    def _check_outputs(self) -> None:
        """The files and folder the graph goes to, checked before it is computed, not when
        it is written, minutes later."""
        if self.frontend is not None and Path(self.frontend).is_file():
            raise InputError(f"--frontend '{self.frontend}' is a file: give a folder.")
        for option, path in (("--out", self.out), ("--page", self.page)):
            if path is not None and Path(path).is_dir():
                raise InputError(f"{option} '{path}' is a folder: give a file name.")
        for option, path in (
            ("--out", self.out),
            ("--page", self.page),
            ("--frontend", self.frontend),
        ):
            if path is not None and not Path(path).absolute().parent.is_dir():
                raise InputError(
                    f"the folder of {option} '{path}' does not exist: create it first."
                )
        if self.frontend is not None:
            listed_graphs(self.frontend)  # a listing it cannot add to: said now
        if not self.slug or "/" in self.slug or "\\" in self.slug or self.slug in (".", ".."):
            raise InputError(f"--slug '{self.slug}' must be a name, without a folder in it.")


@dataclass
class GraphResult:
    """A graph, its pruning and the labels of its nodes; `to_dict` is `--json`'s."""

    graph: AttributionGraph
    pruned: Pruned
    labels: list[str]
    paths: list[dict[str, Any]]
    written: list[Path]
    logit_texts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        g, kept = self.graph, self.pruned.node_mask
        return {
            "prompt": g.input_string,
            "tokens": g.token_texts,
            "logits": [
                {"label": label, "id": int(i), "probability": float(p)}
                for label, i, p in zip(
                    self.labels[len(self.labels) - len(g.logit_targets) :],
                    g.logit_targets,
                    g.logit_probabilities,
                    strict=True,
                )
            ],
            "nodes": len(kept),
            "features": len(g.selected_features),
            "kept_nodes": int(kept.sum()),
            "kept_edges": int(self.pruned.edge_mask.sum()),
            "checks": vars(g.checks),
            "paths": self.paths,
            "written": [str(path) for path in self.written],
        }


def prompt_tokens(run: LoadedRun, prompt: str, notify: Callable[[str], Any]) -> torch.Tensor:
    """The prompt's ids `(T,)`, the run's end-of-text token first (see the module doc).

    Raises:
        InputError: an empty prompt, or one longer than the context with the token put first.
    """
    eot = run.tokenizer.eot_id
    room = run.model.context_length - (eot is not None)
    fix = f"shorten it to at most {room} tokens (the context less the special token put first)."
    ids, _ = encode_prompt(
        run.tokenizer, prompt, room, empty="error", too_long="error", label="--prompt", fix=fix
    )
    if eot is None:
        notify(
            "the run's tokenizer has no end-of-text token to put first: the prompt's first "
            "token takes the position the graph leaves out (no features, no error there)"
        )
        return torch.tensor(ids)
    return torch.tensor([eot, *ids] if ids[0] != eot else ids)


def open_transcoders(run: LoadedRun, folder: str | Path | None) -> LoadedTranscoders:
    """The transcoder set for `run`, checked against it.

    Raises:
        InputError: no set there, one of another width or run, or one lacking layers.
    """
    folder = Path(folder) if folder is not None else run.run_dir / "transcoders"
    if not is_transcoder_folder(folder):
        raise InputError(
            f"no transcoders for run '{run.run_dir}' in '{folder}': train them with "
            f"`{TRAIN_COMMAND} --checkpoint {run.run_dir}`, or pass --transcoders DIR."
        )
    loaded = load_transcoders(folder)
    fix = f"train this run's with `{TRAIN_COMMAND} --checkpoint {run.run_dir}`."
    stale = check_fits(loaded, run, fix)
    if stale is not None:  # a graph is exact only on the weights its transcoders read
        raise InputError(f"{stale}: {fix}")
    missing = sorted(set(range(run.model.n_layer)) - set(loaded.transcoders.layers))
    if missing:
        raise InputError(
            f"the transcoder set in '{folder}' lacks layer(s) {', '.join(map(str, missing))}: a "
            f"graph replaces every MLP; train them all with `{TRAIN_COMMAND}`."
        )
    return loaded


def run_graph(
    request: GraphRequest, *, progress: bool = False, notify: Callable[[str], Any] = logger.warning
) -> GraphResult:
    """`llmcli graph` (see the module doc).

    Raises:
        InputError: a bad run, transcoder folder, prompt or option; nothing is written then.
    """
    device = resolve_device(request.device, what="--device")
    run = load_run(request.checkpoint, weights=request.weights, device=device, notify=notify)
    loaded = open_transcoders(run, request.transcoders)
    tokens = prompt_tokens(run, request.prompt, notify).to(device)
    loaded.transcoders.to(device)
    with torch_threads(request.threads or run.config.train.threads):
        graph = attribute_graph(
            run.model, loaded.transcoders, tokens, request.options, progress=progress
        )
    graph.input_string = run.tokenizer.decode(tokens.tolist())
    graph.token_texts = [run.tokenizer.decode([i]) for i in tokens.tolist()]
    graph.scan = f"llmcli/{run.run_dir.name}"
    graph.cfg |= {"tokenizer_name": str(run.run_dir), "model_name": run.run_dir.name}
    n_feat = len(graph.selected_features)
    pruned = prune(
        graph.adjacency_matrix,
        graph.logit_probabilities,
        n_feat,
        len(tokens),
        request.node_threshold,
        request.edge_threshold,
    )
    labels = node_labels(graph, run.tokenizer)
    result = GraphResult(graph, pruned, labels, top_paths(graph, pruned, labels), [])
    result.logit_texts = [run.tokenizer.decode([i]) for i in graph.logit_targets.tolist()]
    if request.out is not None:
        with atomic_path(request.out) as tmp:
            torch.save(graph_to_dict(graph), tmp)
        result.written.append(Path(request.out))
    if request.frontend is not None:
        data = frontend_graph(result, request.slug, request.node_threshold)
        result.written.append(write_frontend_files(data, request.frontend))
    if request.page is not None:
        contexts = feature_contexts(request, run, loaded, result, notify)
        data = page_data(result, str(run.run_dir), contexts)
        result.written.append(write_graph_page(data, request.page))
    return result


def feature_contexts(
    request: GraphRequest,
    run: LoadedRun,
    loaded: LoadedTranscoders,
    result: GraphResult,
    notify: Callable[[str], Any],
) -> dict[tuple[int, int], list[dict]]:
    """The top contexts of the feature nodes the pruning kept, layer by layer, as `sae
    features` finds them on `context_steps` batches of the run's validation text."""
    g = result.graph
    kept = result.pruned.node_mask[: len(g.selected_features)]
    chosen = g.active_features[g.selected_features[kept]].tolist()
    by_layer: dict[int, set[int]] = {}
    for layer, _, feature in chosen:
        by_layer.setdefault(layer, set()).add(feature)
    found: dict[tuple[int, int], list[dict]] = {}
    for layer, features in sorted(by_layer.items()):
        options = ReadOptions(
            sae=loaded.folder,
            checkpoint=run.run_dir,
            steps=request.context_steps,
            weights=request.weights,
            device=request.device,
            threads=request.threads,
            layer=layer,
        )
        report = feature_report(options, sorted(features), top=5, notify=notify)
        for f in report.features:
            found[(layer, f.index)] = [asdict(c) for c in f.contexts]
    return found


def format_graph(result: GraphResult) -> str:
    """The text `llmcli graph` prints: the logits, the sizes, the checks and the top paths."""
    d = result.to_dict()
    lines = [f"prompt {d['prompt']!r}: {d['nodes']} nodes ({d['features']} features)"]
    lines.append(f"pruned: {d['kept_nodes']} nodes, {d['kept_edges']} edges kept")
    checks = d["checks"]
    lines.append(
        f"exactness: logits {checks['logits']:.1e}, logit edges {checks['logit_edges']:.1e}, "
        f"feature edges {checks['feature_edges']:.1e}"
    )
    for logit in d["logits"]:
        lines.append(f"{logit['label']} (p = {logit['probability']:.3f})")
        for path in [p for p in d["paths"] if p["logit"] == logit["label"]]:
            lines.append(f"  {path['weight']:.3f}  " + " -> ".join(path["nodes"]))
    lines += [f"wrote {path}" for path in d["written"]]
    return "\n".join(lines)
