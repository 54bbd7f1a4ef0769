"""The `llmcli` command line: thin commands that parse options and call the library.

Heavy libraries (torch, numpy, datasets, matplotlib, transformers) are imported inside the
commands that need them, so `llmcli --help` answers at once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli import __version__
from llmcli.cli_options import (
    RESUME_VALUES,
    AblationCommand,
    CheckpointOption,
    ConfigArg,
    DeviceOption,
    JsonOption,
    ProgressOption,
    SetOption,
    TrainCommand,
    WeightsOption,
)
from llmcli.errors import InputError

app = typer.Typer(
    name="llmcli",
    help="Train, sample and inspect small causal language models.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _notify(line: str) -> None:
    """Lines for the user that are not the command's result (which run, warnings) go to stderr."""
    typer.echo(line, err=True)


class _ThrottledStdout:
    """Writes to stdout, flushed at most every 50 ms: streamed text reaches the terminal
    promptly without one flush per token (the caller flushes at the end)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.flushed = 0.0

    def __call__(self, text: str) -> None:
        sys.stdout.write(text)
        now = time.monotonic()
        if now - self.flushed >= self.interval_s:
            sys.stdout.flush()
            self.flushed = now


def _log_to_stderr() -> None:
    """Show the library's INFO messages (run notes, plain progress lines) on stderr."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Train, sample and inspect small causal language models."""


@app.command("config")
def config_command(
    config: Annotated[
        Optional[Path],
        typer.Argument(help="A YAML config file or a shipped config's name.", metavar="CONFIG"),
    ] = None,
    set_: SetOption = None,
    list_: Annotated[
        bool, typer.Option("--list", help="List the shipped configs, one line each.")
    ] = False,
) -> None:
    """Validate a config and print it fully resolved, or list the shipped configs."""
    from llmcli.config import describe_shipped, dump_yaml, load_config

    if list_:
        rows = describe_shipped()
        width = max((len(name) for name, _ in rows), default=0)
        for name, line in rows:
            typer.echo(f"{name:<{width}}  {line}")
        return
    if config is None:
        raise InputError("give a CONFIG (a YAML file or a shipped name), or --list.")
    typer.echo(dump_yaml(load_config(config, set_ or [])), nl=False)


@app.command("prepare-data")
def prepare_data_command(
    config: ConfigArg,
    set_: SetOption = None,
    cache_dir: Annotated[
        Optional[Path],
        typer.Option(
            help="Token cache folder (default: data.cache_dir, else $LLMCLI_CACHE, "
            "else ~/.cache/llmcli).",
            metavar="DIR",
        ),
    ] = None,
) -> None:
    """Train the tokenizer and tokenize the corpus into the cache, ahead of `train`."""
    from llmcli.config import load_config
    from llmcli.data.tokens import prepare_data

    _log_to_stderr()
    cfg = load_config(config, set_ or [])
    data = prepare_data(cfg.data, cfg.model.context_length, cache_dir=cache_dir)
    typer.echo(
        f"{len(data.train):,} train + {len(data.val):,} validation tokens "
        f"({data.train.dtype}), vocab_size {data.tokenizer.vocab_size}; cache: "
        + ", ".join(str(f) for f in data.cache_files)
    )


@app.command("train", cls=TrainCommand)
def train_command(
    config: ConfigArg,
    set_: SetOption = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Run directory (default: train.out_dir, else checkpoints/<config name>).",
            metavar="DIR",
        ),
    ] = None,
    resume: Annotated[
        Optional[str],
        typer.Option(
            help="Continue the run saved in the run directory, exactly; '--resume auto' "
            "continues it if there is one and starts otherwise (default: train.resume).",
            metavar="[auto]",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Start afresh even if the run directory holds a run.")
    ] = False,
    progress: ProgressOption = True,
) -> None:
    """Train a model (Ctrl-C saves and stops; under torchrun, trains with DDP)."""
    from llmcli.config import load_config
    from llmcli.training.interrupt import EXIT_TERMINATED, Preempted
    from llmcli.training.loop import train

    _log_to_stderr()
    if resume is not None and resume not in RESUME_VALUES:
        raise InputError(f"--resume takes no value, or 'auto'; got {resume!r}.")
    cfg = load_config(config, set_ or [])
    if resume is None:  # the config's train.resume, unless --overwrite asks for a fresh start
        resume_ = False if overwrite else cfg.train.resume
    else:
        resume_ = RESUME_VALUES[resume]
    try:
        summary = train(
            cfg,
            out_dir=out,
            resume=resume_,
            overwrite=overwrite,
            progress=progress,
        )
    except Preempted:  # saved: the status schedulers read as "preempted, requeue"
        raise typer.Exit(EXIT_TERMINATED) from None
    if summary.rank != 0:
        return
    rate = f", {summary.tokens_per_s:,.0f} tokens/s" if summary.tokens_per_s else ""
    saves = f", {summary.saves} saves of at most {summary.save_s:.2f} s" if summary.saves else ""
    typer.echo(
        f"run {summary.run_dir}: step {summary.step}/{summary.max_steps}, "
        f"{summary.tokens:,} tokens, {summary.elapsed_s:.0f} s{rate}{saves}"
    )
    if summary.val_loss is not None:
        typer.echo(
            f"val loss {summary.val_loss:.4f} (perplexity {summary.val_ppl:.2f}), "
            f"train loss {summary.train_loss:.4f}, best val loss "
            f"{summary.best_val_loss:.4f}"
        )


# `llmcli sample`'s prompts and generation options.
PromptOption = Annotated[
    Optional[str],
    typer.Option(
        help="Prompt text; '-' reads it from stdin (default: empty prompt).", metavar="TEXT"
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(
        help="File of prompts, one per line or a JSON list; all run as one batch.", metavar="FILE"
    ),
]
# The sample: settings (each defaults to the run's config).
MaxNewTokensOption = Annotated[
    Optional[int], typer.Option(help="Tokens to generate per sample (default: run config).")
]
TemperatureOption = Annotated[
    Optional[float], typer.Option(help="Sampling temperature, >= 0; 0 is greedy.")
]
TopKOption = Annotated[
    Optional[int],
    typer.Option(help="Keep the k most likely tokens (>= 1; >= vocab size keeps all)."),
]
TopPOption = Annotated[
    Optional[float], typer.Option(help="Nucleus sampling mass in (0, 1]; 1 keeps all.")
]
SeedOption = Annotated[Optional[int], typer.Option(help="Random seed; sample r uses seed + r.")]
ContextPolicyOption = Annotated[
    Optional[str],
    typer.Option(
        help="Past the context: exact (the last context_length tokens, recomputed each step) "
        "or shift (keep the last tokens, go on with the KV cache) (default: run config).",
        metavar="POLICY",
    ),
]
ContextKeepOption = Annotated[
    Optional[int],
    typer.Option(
        help="Tokens shift keeps when the context is full, 1..context_length-1 (default: run "
        "config, else context_length // 2).",
        metavar="N",
    ),
]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        help="CPU threads (default: 1 for a small model decoding one token per step, else "
        "torch's own).",
        metavar="N",
    ),
]


@app.command("sample")
def sample_command(
    checkpoint: CheckpointOption = None,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = None,
    num_samples: Annotated[int, typer.Option(help="Samples per prompt, run as one batch.")] = 1,
    stop: Annotated[
        Optional[list[str]],
        typer.Option(
            help="End a sample when this text appears (not printed; \\n, \\t work); repeatable.",
            metavar="TEXT",
        ),
    ] = None,
    stream: Annotated[
        Optional[bool],
        typer.Option("--stream/--no-stream", help="Print tokens as they come (default: on a TTY)."),
    ] = None,
    json_: Annotated[
        bool,
        typer.Option("--json", help="One JSON object per sample (prompt, completion, tokens...)."),
    ] = False,
    context_policy: ContextPolicyOption = None,
    context_keep: ContextKeepOption = None,
    threads: ThreadsOption = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
) -> None:
    """Generate text from a trained run (KV-cached, batched)."""
    import json

    from llmcli.generation.sample import (
        SampleOptions,
        format_samples,
        read_prompts,
        sample_run,
        unescape,
    )

    write = _ThrottledStdout()
    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_
    prompts = read_prompts(prompt, prompt_file)
    options = SampleOptions(
        num_samples=num_samples,
        stop=tuple(unescape(text) for text in stop or []),
        threads=threads,
        weights=weights,
        device=device,
    )
    # The run's sample: config, changed by the options given (None: not given).
    settings = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        context_policy=context_policy,
        context_keep=context_keep,
    )
    samples = sample_run(
        checkpoint,
        prompts,
        {key: value for key, value in settings.items() if value is not None},
        options,
        write=write if streaming else None,
        notify=_notify,
    )
    if json_:
        for sample in samples:
            typer.echo(json.dumps(sample.to_dict(), ensure_ascii=False))
    elif not streaming:
        write(format_samples(samples))
    sys.stdout.flush()


@app.command("inspect-attention", cls=AblationCommand)
def inspect_attention_command(
    checkpoint: CheckpointOption = None,
    prompt: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Prompt text; repeatable, one dump per prompt (default: the start of the "
            "run's validation text).",
            metavar="TEXT",
        ),
    ] = None,
    prompt_file: Annotated[
        Optional[Path],
        typer.Option(help="More prompts: one per line, or a JSON list of strings.", metavar="FILE"),
    ] = None,
    layer: Annotated[
        Optional[list[int]],
        typer.Option(
            help="Keep only this layer (0-based); repeatable (default: all).", metavar="L"
        ),
    ] = None,
    head: Annotated[
        Optional[list[int]],
        typer.Option(help="Keep only this head (0-based); repeatable (default: all).", metavar="H"),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Output folder (default: <run>/attention/); several prompts go to "
            "prompt-000/, prompt-001/, ... inside it.",
            metavar="DIR",
        ),
    ] = None,
    format_: Annotated[
        str, typer.Option("--format", help="Dump format: npz, safetensors or json.", metavar="FMT")
    ] = "npz",
    induction: Annotated[
        bool,
        typer.Option(help="Add an induction score per head (on a repeated random sequence)."),
    ] = False,
    truncate: Annotated[
        bool,
        typer.Option(help="Keep the last context_length tokens of a longer prompt."),
    ] = False,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    pictures: Annotated[
        bool, typer.Option("--pictures/--no-pictures", help="Write one PNG per layer.")
    ] = True,
    ablation: Annotated[
        Optional[str],
        typer.Option(
            help="Add each head's loss increase when it is removed, measured on validation "
            "batches: zero, mean or both (a metric column, ablation.png, the top heads).",
            metavar="METHOD",
        ),
    ] = None,
    ablation_steps: Annotated[
        Optional[int],
        typer.Option(help="Validation batches --ablation measures on (default: 20).", metavar="N"),
    ] = None,
) -> None:
    """Dump every head's attention for a prompt, score each head, draw it, write a viewer."""
    from llmcli.inspection.attention import InspectOptions, format_report, inspect_attention

    options = InspectOptions(
        layers=tuple(layer or ()),
        heads=tuple(head or ()),
        fmt=format_,
        induction=induction,
        truncate=truncate,
        pictures=pictures,
        ablation=ablation,
        ablation_steps=ablation_steps,
        weights=weights,
        device=device,
    )
    result = inspect_attention(
        checkpoint, prompt or [], options, prompt_file=prompt_file, out_dir=out, notify=_notify
    )
    typer.echo(format_report(result), nl=False)


@app.command("info")
def info_command(
    checkpoint: CheckpointOption = None,
    weights: WeightsOption = "best",
    json_: JsonOption = False,
) -> None:
    """Show a run: model size, training summary, recorded versions, generation defaults."""
    import json

    from llmcli.runs.info import format_info, run_info

    info = run_info(checkpoint, weights=weights, notify=_notify)
    typer.echo(json.dumps(info, indent=2) if json_ else format_info(info))


@app.command("export")
def export_command(
    out: Annotated[
        Path, typer.Option(help="Folder to write (must be new or empty).", metavar="DIR")
    ],
    checkpoint: CheckpointOption = None,
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="The transformers architecture: auto (the one that computes the run's model "
            "exactly), gpt2, gpt-neox or arcee.",
            metavar="ARCH",
        ),
    ] = "auto",
    force: Annotated[
        bool, typer.Option(help="Write into a non-empty --out, replacing a previous export.")
    ] = False,
    weights: WeightsOption = "best",
) -> None:
    """Export a run as a Hugging Face folder for transformers (no custom code needed)."""
    from llmcli.hf.export import export_hf

    result = export_hf(
        checkpoint,
        out,
        fmt=format_,
        force=force,
        weights=weights,
        notify=_notify,
    )
    typer.echo(
        f"exported {result.run_dir} as {result.architecture} (step {result.step}, "
        f"{result.n_params:,} parameters, "
        f"vocab {result.vocab_size}) to {result.out_dir}/: {', '.join(result.files)}"
    )


@app.command("eval", cls=AblationCommand)
def eval_command(
    checkpoint: CheckpointOption = None,
    data: Annotated[
        Optional[Path],
        typer.Option(
            help="A UTF-8 text file to score (default: the run's validation split).", metavar="PATH"
        ),
    ] = None,
    steps: Annotated[
        Optional[int],
        typer.Option(help="Score only the first N batches (default: the whole text).", metavar="N"),
    ] = None,
    batch_size: Annotated[
        Optional[int],
        typer.Option(
            help="Windows of context_length tokens per batch (default: the run's train.batch_size)."
        ),
    ] = None,
    ablate: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Remove a head: L.H (head H of layer L) or L (every head of layer L), 0-based; "
            "repeatable.",
            metavar="SPEC",
        ),
    ] = None,
    ablation: Annotated[
        Optional[str],
        typer.Option(
            help="How --ablate removes a head: zero (its output zeroed; the default) or mean "
            "(replaced by its mean output over the scored text).",
            metavar="METHOD",
        ),
    ] = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
) -> None:
    """Mean loss, perplexity and bits per byte of a run on its validation split or a text."""
    import json

    from llmcli.inspection.evaluate import EvalOptions, evaluate_run, format_result

    _log_to_stderr()
    options = EvalOptions(
        steps=steps,
        batch_size=batch_size,
        ablate=tuple(ablate or ()),
        ablation=ablation,
        weights=weights,
        device=device,
    )
    result = evaluate_run(checkpoint, data, options, progress=True, notify=_notify)
    typer.echo(json.dumps(result.to_dict()) if json_ else format_result(result))


@app.command("compare")
def compare_command(
    runs: Annotated[
        list[str],
        typer.Argument(help="Run directories, or globs such as 'checkpoints/*'.", metavar="RUN..."),
    ],
    metric: Annotated[
        str,
        typer.Option(
            help="What to draw: val_loss, val_ppl, train_loss, lr, grad_norm or tok_per_s.",
            metavar="NAME",
        ),
    ] = "val_loss",
    x: Annotated[
        str, typer.Option("--x", help="Against: step, tokens or elapsed_s.", metavar="AXIS")
    ] = "step",
    out: Annotated[Path, typer.Option(help="The picture to write (PNG).", metavar="FILE")] = Path(
        "compare.png"
    ),
    json_: JsonOption = False,
) -> None:
    """Compare runs: their curves in one PNG and a table (best val loss, steps, tokens, time,
    tokens/s, and the config keys that differ)."""
    import json

    from llmcli.runs.compare import compare_runs, format_table

    comparison = compare_runs(runs, metric=metric, x=x, out=out)
    if json_:
        typer.echo(json.dumps(comparison.to_dict()))
        return
    typer.echo(format_table(comparison))
    typer.echo(f"wrote {comparison.picture}")


@app.command("bench")
def bench_command(
    config: ConfigArg,
    set_: SetOption = None,
    heads: Annotated[
        str, typer.Option(help="Head counts to try, comma-separated.", metavar="LIST")
    ] = "1,2,4,8",
    seq: Annotated[
        str,
        typer.Option(
            help="Sequence lengths (context_length) to try, comma-separated.", metavar="LIST"
        ),
    ] = "64,128,256,512",
    device: Annotated[
        Optional[str],
        typer.Option(help="auto, cpu, cuda or mps (default: train.device).", metavar="DEVICE"),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Folder for bench.json and bench.png (default: checkpoints/bench/<config name>).",
            metavar="DIR",
        ),
    ] = None,
    steps: Annotated[
        int, typer.Option(help="Timed training steps per combination (after one warm-up).")
    ] = 3,
    sample_tokens: Annotated[
        int, typer.Option(help="New tokens sampled per combination (at most seq - 1).")
    ] = 64,
    isolate: Annotated[
        bool,
        typer.Option(
            help="Measure each combination in a fresh process (needed for the CPU's peak memory)."
        ),
    ] = True,
    progress: ProgressOption = True,
) -> None:
    """Training and sampling speed, forward latency and peak memory per head count and length."""
    from llmcli.bench import BenchSettings, bench_and_report, format_table, parse_int_list
    from llmcli.config import load_config

    _log_to_stderr()
    settings = BenchSettings(train_steps=steps, sample_tokens=sample_tokens)
    results, json_path, png_path = bench_and_report(
        load_config(config, set_ or []),
        parse_int_list(heads, "heads"),
        parse_int_list(seq, "seq"),
        device,
        out,
        settings,
        isolate=isolate,
        progress=progress,
    )
    typer.echo(format_table(results))
    typer.echo(f"wrote {json_path} and {png_path}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and maps errors to exit statuses (2 bad input, 130 Ctrl-C;
    `train` exits 143 after SIGTERM)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        code = app(args=args, prog_name="llmcli", standalone_mode=False)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:
        # Typer ships its own copy of click, so match its exceptions by what they offer.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # usage errors: exit 2
            exc.show()
            sys.exit(exc.exit_code)
        if hasattr(exc, "exit_code"):  # typer.Exit
            sys.exit(exc.exit_code)
        if type(exc).__name__ == "Abort":
            typer.echo("interrupted", err=True)
            sys.exit(130)
        raise
    sys.exit(code if isinstance(code, int) else 0)
