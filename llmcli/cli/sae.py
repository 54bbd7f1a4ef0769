"""`llmcli sae train`, `sae eval` and `sae features`: sparse autoencoders on a run's hook points."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmcli.cli.app import app, log_to_stderr, notify, result_text
from llmcli.cli.options import (
    CheckpointOption,
    DataOption,
    DeviceOption,
    JsonOption,
    ProgressOption,
    RunThreadsOption,
    WeightsOption,
)
from llmcli.inspection.sae.config import SAEConfig

# The training options' defaults are `SAEConfig`'s, declared there once.
_DEFAULT = SAEConfig(hook="blocks.0.resid_post")

sae_app = typer.Typer(
    name="sae",
    help="Sparse autoencoders on a hook point of a run: train one, score it, read its "
    "features (sae train, sae eval, sae features; `llmcli sae COMMAND --help`).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(sae_app, name="sae")

SaeOption = Annotated[
    Optional[Path],
    typer.Option(
        "--sae",
        help="The SAE folder, or a transcoder folder (sae features: with --layer) (default: the "
        "SAE written last under <run>/sae/); its run is the default --checkpoint.",
        metavar="DIR",
    ),
]
StepsOption = Annotated[
    Optional[int],
    typer.Option(
        help="Batches of the validation text to read (default: 40, about 80K tokens on the "
        "tiny run).",
        metavar="N",
    ),
]
BatchOption = Annotated[
    Optional[int],
    typer.Option(help="Windows of context_length tokens per batch (default: 32).", metavar="N"),
]
FeaturesOption = Annotated[
    Optional[int],
    typer.Option(help="Number of features (default: 16 x the hook point's width).", metavar="N"),
]
ActivationOption = Annotated[
    str,
    typer.Option(
        help="topk (k per token) or batchtopk (k per token on average over a batch; runs as a "
        "JumpReLU after training); transcoders also relu (an L1 penalty) or tanh (Anthropic's "
        "tanh penalty).",
        metavar="KIND",
    ),
]


HookOption = Annotated[
    str,
    typer.Option(
        help="The hook point to train an SAE on, e.g. blocks.1.resid_post, blocks.0.mlp_out, "
        "blocks.0.attn.z (docs/hook-points.md lists them).",
        metavar="NAME",
    ),
]
KindOption = Annotated[
    str,
    typer.Option(
        help="sae, or transcoder: per layer, features that read the MLP's input "
        "(blocks.L.mlp_in) and predict its output, saved as circuit-tracer's transcoder set "
        "(default folder <run>/transcoders/).",
        metavar="KIND",
    ),
]
LayersOption = Annotated[
    Optional[str],
    typer.Option(
        help="The transcoders' layers: all (the default), or indices joined by commas (0,2).",
        metavar="LAYERS",
    ),
]
SkipOption = Annotated[
    bool, typer.Option("--skip", help="Give each transcoder a linear skip (W_skip).")
]
SparsityOption = Annotated[
    float,
    typer.Option(help="The weight of the relu (L1) and tanh sparsity penalties.", metavar="W"),
]


@sae_app.command("train")
def sae_train_command(
    hook: HookOption = "",
    kind: KindOption = _DEFAULT.kind,
    layers: LayersOption = None,
    skip: SkipOption = False,
    sparsity_coef: SparsityOption = _DEFAULT.sparsity_coef,
    checkpoint: CheckpointOption = None,
    features: FeaturesOption = None,
    k: Annotated[
        int, typer.Option("--k", help="Features active per token.", metavar="K")
    ] = _DEFAULT.k,
    activation: ActivationOption = _DEFAULT.activation,
    steps: Annotated[
        int, typer.Option(help="Optimizer steps in all.", metavar="S")
    ] = _DEFAULT.steps,
    batch_tokens: Annotated[
        int, typer.Option(help="Activations per step (whole windows).", metavar="N")
    ] = _DEFAULT.batch_tokens,
    lr: Annotated[float, typer.Option(help="Adam's learning rate.", metavar="LR")] = _DEFAULT.lr,
    seed: Annotated[
        int, typer.Option(help="Seeds the initial weights and the windows' order.", metavar="S")
    ] = _DEFAULT.seed,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="The SAE folder (default: <run>/sae/<hook>/; transcoders: <run>/transcoders/).",
            metavar="DIR",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Go on training the SAE saved in the folder, exactly.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Train afresh over the SAE saved in the folder.")
    ] = False,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """Train a sparse autoencoder on a hook point, streaming the run's training data (Ctrl-C
    saves and stops; --resume goes on)."""
    from llmcli.inspection.sae.config import SAEConfig
    from llmcli.inspection.sae.train import TrainOptions, train_sae
    from llmcli.inspection.sae.transcoder_train import train_transcoders
    from llmcli.training.interrupt import EXIT_TERMINATED, Preempted

    log_to_stderr()
    config = SAEConfig(
        hook=hook,
        kind=kind,
        layers=layers,
        skip=skip,
        sparsity_coef=sparsity_coef,
        features=features,
        k=k,
        activation=activation,
        steps=steps,
        batch_tokens=batch_tokens,
        lr=lr,
        seed=seed,
    )
    options = TrainOptions(
        checkpoint=checkpoint,
        out=out,
        resume=resume,
        overwrite=overwrite,
        weights=weights,
        device=device,
        threads=threads,
    )
    try:
        train = train_transcoders if config.kind == "transcoder" else train_sae
        summary = train(config, options, progress=progress, notify=notify)
    except Preempted:  # saved: the status schedulers read as "preempted, requeue"
        raise typer.Exit(EXIT_TERMINATED) from None
    _echo_summary(summary, "transcoders" if config.kind == "transcoder" else "SAE")


def _echo_summary(summary: Any, what: str) -> None:
    """`sae train`'s closing lines: where, how far, and the last log line's figures."""
    typer.echo(
        f"{what} {summary.folder}: step {summary.step}/{summary.steps}, {summary.tokens:,} "
        f"activations, {summary.elapsed_s:.0f} s"
    )
    if summary.last:  # the means over the steps since the log line before
        last = summary.last
        typer.echo(
            f"explained variance {last['explained_variance']:.4f}, L0 {last['l0']:.2f}, dead "
            f"{last['dead_fraction']:.2%}; `llmcli sae eval` measures the loss recovered"
        )


@sae_app.command("eval")
def sae_eval_command(
    sae: SaeOption = None,
    checkpoint: CheckpointOption = None,
    data: DataOption = None,
    steps: StepsOption = None,
    batch_size: BatchOption = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """Explained variance, L0, dead features, and the loss with the SAE spliced in against the
    clean, zero- and mean-ablated losses (ce_recovered); for a transcoder folder, each layer's
    normalised MSE, L0 and dead features, and the loss with every MLP replaced at once."""
    from llmcli.inspection.sae.evaluate import ReadOptions, evaluate_sae, format_eval
    from llmcli.inspection.sae.transcoder_eval import evaluate_transcoders, format_transcoder_eval
    from llmcli.inspection.sae.transcoder_folder import is_transcoder_folder

    log_to_stderr()
    options = ReadOptions(sae, checkpoint, data, steps, batch_size, weights, device, threads)
    if sae is not None and is_transcoder_folder(sae):  # every layer's MLP replaced at once
        result = evaluate_transcoders(options, progress=progress, notify=notify)
        typer.echo(result_text(result, json_, format_transcoder_eval))
        return
    result = evaluate_sae(options, progress=progress, notify=notify)
    typer.echo(result_text(result, json_, format_eval))


@sae_app.command("features")
def sae_features_command(
    feature: Annotated[
        Optional[list[int]],
        typer.Option(
            help="A feature to show in full; repeatable (default: every feature in the page "
            "and JSON, the densest 20 as text).",
            metavar="I",
        ),
    ] = None,
    sae: SaeOption = None,
    checkpoint: CheckpointOption = None,
    layer: Annotated[
        Optional[int],
        typer.Option(
            help="For a transcoder folder (--sae): the layer whose features to read.",
            metavar="L",
        ),
    ] = None,
    top: Annotated[int, typer.Option(help="Top activating contexts per feature.", metavar="N")] = 8,
    data: DataOption = None,
    steps: StepsOption = None,
    batch_size: BatchOption = None,
    page: Annotated[
        bool,
        typer.Option(
            "--page/--no-page",
            help="Write features.html (the offline viewer's page) into the SAE folder.",
        ),
    ] = True,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """Each feature's top activating contexts (activating tokens marked), its density and its
    logit effect (the tokens its direction promotes and suppresses)."""
    import json

    from llmcli.inspection.sae.evaluate import ReadOptions
    from llmcli.inspection.sae.features import feature_report, format_features
    from llmcli.inspection.sae.page import write_features_page
    from llmcli.inspection.sae.transcoder_folder import is_transcoder_folder

    log_to_stderr()
    options = ReadOptions(sae, checkpoint, data, steps, batch_size, weights, device, threads, layer)
    report = feature_report(options, feature or (), top=top, progress=progress, notify=notify)
    if json_:
        typer.echo(json.dumps(report.to_dict(), ensure_ascii=False))
    else:
        typer.echo(format_features(report, limit=None if feature else 20))
    if page:
        where = None  # a transcoder set's pages, one per layer, sit beside its files
        if sae is not None and is_transcoder_folder(sae):
            where = sae / f"features_layer_{layer}.html"
        notify(f"wrote {write_features_page(report, where)}")
