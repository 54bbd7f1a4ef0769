"""`llmcli info`, `export` and `compare`: a run's facts, its Hugging Face copy, runs compared."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli.cli.app import app, notify, result_text
from llmcli.cli.options import CheckpointOption, JsonOption, UsageCommand, WeightsOption


@app.command("info")
def info_command(
    checkpoint: CheckpointOption = None,
    weights: WeightsOption = "best",
    json_: JsonOption = False,
) -> None:
    """Show a run: model size, training summary, recorded versions, generation defaults."""
    import json

    from llmcli.runs.info import format_info, run_info

    info = run_info(checkpoint, weights=weights, notify=notify)
    typer.echo(json.dumps(info, indent=2) if json_ else format_info(info))


@app.command("export")
def export_command(
    out: Annotated[
        Path,
        typer.Option(
            help="Folder to write (must be new or empty); with --format gguf, the file.",
            metavar="PATH",
        ),
    ],
    checkpoint: CheckpointOption = None,
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="The transformers architecture: auto (the one that computes the run's model "
            "exactly), gpt2, gpt-neox or arcee; or gguf: one file for llama.cpp (byte-level "
            "BPE runs).",
            metavar="FORMAT",
        ),
    ] = "auto",
    dtype: Annotated[
        str,
        typer.Option(
            help="Precision of a GGUF file: f32, or f16 (matrices in float16, vectors float32). "
            "Hugging Face folders are float32.",
            metavar="DTYPE",
        ),
    ] = "f32",
    force: Annotated[
        bool, typer.Option(help="Write into a non-empty --out, replacing a previous export.")
    ] = False,
    weights: WeightsOption = "best",
    merge: Annotated[
        bool,
        typer.Option(
            help="A LoRA run: export the plain model with the adapters folded in, instead of "
            "its base with the adapters in PEFT's format in PATH/adapter.",
        ),
    ] = False,
) -> None:
    """Export a run as a Hugging Face folder for transformers (no custom code needed), or as a
    GGUF file for llama.cpp."""
    if format_ == "gguf":
        from llmcli.gguf.export import export_gguf

        gguf = export_gguf(
            checkpoint, out, dtype=dtype, force=force, weights=weights, notify=notify
        )
        typer.echo(
            f"exported {gguf.run_dir} as GGUF {gguf.architecture} {gguf.dtype} (step "
            f"{gguf.step}, {gguf.n_params:,} parameters, vocab {gguf.vocab_size}) to "
            f"{gguf.path} ({gguf.n_bytes:,} bytes)"
        )
        return
    from llmcli.errors import InputError
    from llmcli.hf.export import export_hf

    if dtype != "f32":
        raise InputError(f"--dtype {dtype} is for --format gguf; Hugging Face exports are f32.")
    result = export_hf(
        checkpoint,
        out,
        fmt=format_,
        force=force,
        weights=weights,
        merge=merge,
        notify=notify,
    )
    typer.echo(
        f"exported {result.run_dir} as {result.architecture} (step {result.step}, "
        f"{result.n_params:,} parameters, "
        f"vocab {result.vocab_size}) to {result.out_dir}/: {', '.join(result.files)}"
    )
    if result.adapter_dir is not None:
        typer.echo(
            f"the LoRA adapters in PEFT's format: {result.adapter_dir}/ (peft.PeftModel."
            "from_pretrained(model, that folder); --merge exports the merged model instead)"
        )


@app.command("compare", cls=UsageCommand)
def compare_command(
    runs: Annotated[
        list[str],
        typer.Argument(help="Run directories, or globs such as 'checkpoints/*'.", metavar="RUN..."),
    ],
    metric: Annotated[
        str,
        typer.Option(
            help="What to draw: val_loss, val_ppl, train_loss, lr, grad_norm, tok_per_s, or "
            "(runs trained with train.head_metrics) induction_max, prev_token_max, icl_score.",
            metavar="NAME",
        ),
    ] = "val_loss",
    x: Annotated[
        Optional[str],
        typer.Option(
            "--x",
            help="Against: step, tokens or elapsed_s (default: step; tokens with --reference).",
            metavar="AXIS",
        ),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="The picture to write (PNG; default: compare.png in the current folder, none "
            "with --json). A file already there is replaced, and stderr says so.",
            metavar="FILE",
        ),
    ] = None,
    reference: Annotated[
        bool,
        typer.Option(
            "--reference",
            help="Also draw each run's shipped config's reference curve, and say how far above "
            "or below it the run's last evaluation is and which keys that change the curve "
            "differ (one run is then enough).",
        ),
    ] = False,
    json_: JsonOption = False,
) -> None:
    """Compare runs: their curves in one PNG and a table (best val loss, steps, tokens, time,
    tokens/s, and the config keys that differ); with --reference, against the reference curve."""
    from llmcli.runs.compare import compare_runs, format_table

    if out is None and not json_:
        out = Path("compare.png")
    axis = x or ("tokens" if reference else "step")
    comparison = compare_runs(runs, metric=metric, x=axis, out=out, reference=reference)
    if comparison.replaced:
        notify(f"note: {comparison.picture} was there already: replaced it")
    typer.echo(result_text(comparison, json_, format_table))
    if not json_:
        typer.echo(f"wrote {comparison.picture}")
