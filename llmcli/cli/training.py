"""`llmcli config`, `prepare-data`, `train` and `bench`: from a config to a trained run."""

from __future__ import annotations

import shutil
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli.app import app, log_to_stderr
from llmcli.cli.options import (
    RESUME_VALUES,
    ConfigArg,
    ConfigDeviceOption,
    ProgressOption,
    SetOption,
    TrainCommand,
    UsageCommand,
)
from llmcli.errors import InputError

if TYPE_CHECKING:
    from llmcli.training.log import TrainSummary


@app.command("config", cls=UsageCommand)
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
        columns = max(shutil.get_terminal_size().columns - 1, width + 30)
        for name, line in rows:  # wrapped at spaces, under the descriptions' column
            first, rest = f"{name:<{width}}  ", " " * (width + 2)
            wrap = textwrap.TextWrapper(columns, first, rest, break_on_hyphens=False)
            typer.echo(wrap.fill(line))
        return
    if config is None:
        raise InputError("give a CONFIG (a YAML file or a shipped name), or --list.")
    typer.echo(dump_yaml(load_config(config, set_ or [])), nl=False)


@app.command("prepare-data", cls=UsageCommand)
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
    from llmcli.progress import format_bytes, peak_rss_bytes

    log_to_stderr()
    cfg = load_config(config, set_ or [])
    if cfg.train.init_from:  # the tokenizer is the base's, as `train` will use it
        from llmcli.training.init_from import resolve_init_from

        cfg = resolve_init_from(cfg)
    start, began = time.perf_counter(), time.time()
    data = prepare_data(cfg.data, cfg.model.context_length, cache_dir=cache_dir)
    seconds = time.perf_counter() - start
    tokens = len(data.train) + len(data.val)
    typer.echo(
        f"{len(data.train):,} train + {len(data.val):,} validation tokens "
        f"({data.train.dtype}), vocab_size {data.tokenizer.vocab_size}; cache: "
        + ", ".join(str(f) for f in data.cache_files)
    )
    peak = format_bytes(peak_rss_bytes())
    if all(f.stat().st_mtime < began for f in data.cache_files):  # nothing written: a cache hit
        typer.echo(f"read from the cache in {seconds:,.1f} s, peak memory {peak}")
        return
    text = f"{data.text_bytes / 2**20 / seconds:,.1f} MiB/s of text, " if data.text_bytes else ""
    typer.echo(
        f"prepared in {seconds:,.1f} s: {text}{tokens / seconds:,.0f} tokens/s, peak memory {peak}"
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
        bool,
        typer.Option(
            help="Start afresh even if the run directory holds a run (its files are replaced) "
            "or other files (they are kept)."
        ),
    ] = False,
    threads: Annotated[
        Optional[int],
        typer.Option(
            help="CPU threads (default: train.threads, auto: the CPUs this process may use "
            "that nothing else is using); more pays only on cores that nothing else uses.",
            metavar="N",
        ),
    ] = None,
    progress: ProgressOption = True,
) -> None:
    """Train a model (Ctrl-C saves and stops; under torchrun, trains with DDP)."""
    from llmcli.config import load_config
    from llmcli.device import check_threads
    from llmcli.training.interrupt import EXIT_TERMINATED, Preempted
    from llmcli.training.loop import train

    log_to_stderr()
    if resume is not None and resume not in RESUME_VALUES:
        raise InputError(f"--resume takes no value, or 'auto'; got {resume!r}.")
    cfg = load_config(config, set_ or [])
    if threads is not None:
        cfg.train.threads = check_threads(threads)
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
    _print_summary(summary)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _print_summary(summary: TrainSummary) -> None:
    """The run's two lines on stdout: where it got to, and its last losses."""
    rate = f", {summary.tokens_per_s:,.0f} tokens/s" if summary.tokens_per_s else ""
    saves = (
        f", {_plural(summary.saves, 'save')} of at most {summary.save_s:.2f} s"
        if summary.saves
        else ""
    )
    guard = (
        f", spike guard: {_plural(summary.skipped, 'step')} skipped, "
        f"{_plural(summary.rollbacks, 'rollback')}"
        if summary.skipped or summary.rollbacks
        else ""
    )
    typer.echo(
        f"run {summary.run_dir}: step {summary.step}/{summary.max_steps}, "
        f"{summary.tokens:,} tokens, {summary.elapsed_s:.0f} s{rate}{saves}{guard}"
    )
    if summary.val_loss is not None:
        ppl = f" (perplexity {summary.val_ppl:.2f})" if summary.val_ppl is not None else ""
        typer.echo(
            f"val loss {summary.val_loss:.4f}{ppl}, train loss {summary.train_loss:.4f}, "
            f"best val loss {summary.best_val_loss:.4f}"
        )


@app.command("bench", cls=UsageCommand)
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
    device: ConfigDeviceOption = None,
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
    from llmcli.bench.measure import BenchSettings, parse_int_list
    from llmcli.bench.report import bench_and_report, format_table
    from llmcli.config import load_config

    log_to_stderr()
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
