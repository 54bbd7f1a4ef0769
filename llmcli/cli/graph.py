"""`llmcli graph`: the attribution graph of a prompt over a run's transcoder features, as
circuit-tracer computes it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli.cli.app import app, log_to_stderr, notify, result_text
from llmcli.cli.options import (
    CheckpointOption,
    DeviceOption,
    JsonOption,
    ProgressOption,
    RunThreadsOption,
    WeightsOption,
)
from llmcli.inspection.graph.options import EDGE_THRESHOLD, NODE_THRESHOLD, GraphOptions

# The defaults are circuit-tracer's, declared once in `GraphOptions`.
_DEFAULT = GraphOptions()


TranscodersOption = Annotated[
    Optional[Path],
    typer.Option(
        help="The transcoder folder (default: <run>/transcoders/, which `llmcli sae train "
        "--kind transcoder --layers all` writes).",
        metavar="DIR",
    ),
]

MaxLogitsOption = Annotated[int, typer.Option(help="The most logit nodes.", metavar="N")]

LogitProbabilityOption = Annotated[
    float,
    typer.Option(help="Logit nodes are added until their probability reaches this.", metavar="P"),
]

MaxFeatureNodesOption = Annotated[
    Optional[int],
    typer.Option(
        help="The most feature nodes, the most influential first (default: every active feature).",
        metavar="N",
    ),
]

NodeThresholdOption = Annotated[
    float,
    typer.Option(help="Pruning keeps the nodes holding this share of influence.", metavar="S"),
]

EdgeThresholdOption = Annotated[
    float,
    typer.Option(help="Pruning keeps the edges holding this share of influence.", metavar="S"),
]

BatchSizeOption = Annotated[int, typer.Option(help="Targets per backward pass.", metavar="N")]

OutOption = Annotated[
    Optional[Path],
    typer.Option(
        help="Write the unpruned graph here (graph.pt, circuit-tracer's Graph.to_pt fields).",
        metavar="FILE",
    ),
]

PageOption = Annotated[
    Optional[Path],
    typer.Option(
        help="Write the pruned graph as a page of the offline viewer (graph.html): nodes by "
        "layer and position, a click on a feature shows its top contexts.",
        metavar="FILE",
    ),
]

FrontendOption = Annotated[
    Optional[Path],
    typer.Option(
        help="Write circuit-tracer's frontend files here (SLUG.json and graph-metadata.json, "
        "as its create_graph_files writes them).",
        metavar="DIR",
    ),
]

SlugOption = Annotated[
    str, typer.Option(help="The graph's name in the frontend files.", metavar="NAME")
]

ContextStepsOption = Annotated[
    int,
    typer.Option(
        help="Batches of validation text read for the page's feature contexts.", metavar="N"
    ),
]


@app.command("graph")
def graph_command(
    prompt: Annotated[str, typer.Option(help="The text to attribute.", metavar="TEXT")],
    checkpoint: CheckpointOption = None,
    transcoders: TranscodersOption = None,
    max_logits: MaxLogitsOption = _DEFAULT.max_logits,
    logit_probability: LogitProbabilityOption = _DEFAULT.logit_probability,
    max_feature_nodes: MaxFeatureNodesOption = None,
    node_threshold: NodeThresholdOption = NODE_THRESHOLD,
    edge_threshold: EdgeThresholdOption = EDGE_THRESHOLD,
    batch_size: BatchSizeOption = _DEFAULT.batch_size,
    out: OutOption = None,
    page: PageOption = None,
    frontend: FrontendOption = None,
    slug: SlugOption = "graph",
    context_steps: ContextStepsOption = 4,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """The attribution graph of a prompt (circuit-tracer's): active transcoder features, errors,
    tokens and top logits, linked by their direct effects, pruned; --json prints the top paths
    into each logit."""
    from llmcli.inspection.graph.command import GraphRequest, format_graph, run_graph

    log_to_stderr()
    options = GraphOptions(max_logits, logit_probability, max_feature_nodes, batch_size)
    request = GraphRequest(
        prompt=prompt,
        checkpoint=checkpoint,
        transcoders=transcoders,
        options=options,
        node_threshold=node_threshold,
        edge_threshold=edge_threshold,
        out=out,
        page=page,
        frontend=frontend,
        slug=slug,
        context_steps=context_steps,
        weights=weights,
        device=device,
        threads=threads,
    )
    result = run_graph(request, progress=progress, notify=notify)
    typer.echo(result_text(result, json_, format_graph))
